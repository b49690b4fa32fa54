"""Load a HF PEFT LoRA adapter directory (`save_pretrained` output) as is, into host tensors laid out for the pools.

Accepted: `adapter_config.json` + `adapter_model.safetensors` with LoRA A/B weights for any subset of the
model's projections (loom.lora.model_spec): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or
Phi-3's fused qkv_proj / gate_up_proj (target_modules given as a list, "all-linear" or a regex string), and on
MoE models the experts through `target_parameters` (mlp.experts.gate_up_proj, mlp.experts.down_proj: PEFT's
ParamWrapper, one LoRA per expert); ranks 1..max_lora_rank, `lora_alpha / r` scaling or rsLoRA, `rank_pattern`
/ `alpha_pattern` (matched like PEFT does), `layers_to_transform`, `exclude_modules`. Weights are converted to
the base model's dtype.

Refused with an `AdapterLoadError` that names the adapter and the problem: anything that would change
the math beyond plain LoRA on those projections (DoRA, biases, modules_to_save, embedding/lm_head/router
LoRA, fan_in_fan_out, ...), MoE targets that PEFT would first convert for transformers 5 (expert or router
names in target_modules, "all-linear" on a MoE model), shape mismatches with the base model, missing files,
pickle-only `adapter_model.bin` (never unpickled), rank > max_lora_rank, non-finite weights.

The result (`AdapterWeights`) holds, per module group (loom.lora.model_spec.GROUP_LAYOUT), A as
[group layers, (experts,) num_slices, rank, in] and B^T as [group layers, (experts,) rank, sum(output_sizes)] (the
layers that have the group, as the pools stack them; zeros for untargeted slices/layers); groups the adapter does not
touch at all are absent (the pool writes zeros there), and `ranks` gives each present group's largest module rank.
A fused projection (Phi-3's qkv_proj, the experts' gate_up_proj) has one A for all its slices: it is copied into
each slice, and B is split by slice.
If modules of one adapter have different ranks (rank_pattern) they are zero-padded to the adapter's
largest rank; if they have different scalings, the ratio to the adapter's scaling is folded into B.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from loom.lora.model_spec import (
    ALL_PROJS,
    EXPERT_PROJS,
    FUSED_PROJS,
    GROUP_LAYOUT,
    MOE_V4_NAMES,
    PROJ_TO_GROUP,
    SUPPORTED_PROJS,
    LoraGroupSpec,
    LoraModelSpec,
    hf_module_name,
)

__all__ = ["SUPPORTED_PROJS", "GROUP_LAYOUT", "PROJ_TO_GROUP", "LoraGroupSpec", "LoraModelSpec", "hf_module_name",
           "AdapterLoadError", "AdapterWeights", "AdapterConfigInfo", "read_adapter_config", "parse_adapter_config",
           "load_peft_adapter", "is_targeted", "target_ranks"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_WEIGHTS_NAME = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20


class AdapterLoadError(ValueError):
    """An adapter directory cannot be served; the message names the adapter and what is wrong."""


# ---------------------------------------------------------------------------------------------------------
# The loaded adapter
# ---------------------------------------------------------------------------------------------------------


@dataclass
class AdapterWeights:
    name: str
    path: str
    rank: int  # its largest module rank (every tensor is padded to it)
    scaling: float  # applied by the kernels; per-module differences are folded into B
    a: dict[str, torch.Tensor]  # group name -> [group layers, (experts,) num_slices, rank, in]
    b: dict[str, torch.Tensor]  # group name -> [group layers, (experts,) rank, sum(output_sizes)] (B transposed)
    target_modules: list[str] = field(default_factory=list)  # projection names with weights
    content_hash: str = ""  # sha256 of config + weights files
    ranks: dict[str, int] = field(default_factory=dict)  # group name -> largest rank of its modules (rows beyond: 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.a.values()) + list(self.b.values()))

    def pin_memory(self) -> "AdapterWeights":
        self.a = {k: v.pin_memory() for k, v in self.a.items()}
        self.b = {k: v.pin_memory() for k, v in self.b.items()}
        return self


@dataclass
class AdapterConfigInfo:
    """What the config alone says (cheap to read synchronously before the weights are loaded)."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    target_modules: object
    max_rank: int  # max(r, rank_pattern values)
    raw: dict

    def scaling_for(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fail(name: str, msg: str) -> AdapterLoadError:
    return AdapterLoadError(f"adapter {name!r}: {msg}")


def _pattern_key(pattern_keys, key_to_match: str) -> str | None:
    """PEFT's rule (peft.utils.other.get_pattern_key): the first pattern that matches a suffix of the module name."""
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", key_to_match):
            return key
    return None


def _suffix_match(names, key: str) -> bool:
    return key in names or any(key.endswith(f".{n}") for n in names)


def is_targeted(raw: dict, key: str, linear_names=SUPPORTED_PROJS) -> bool:
    """PEFT's rule (peft.tuners.tuners_utils.check_target_module_exists) for one linear module name: exclusions
    first; a string target is a full-match regex ("all-linear": every linear layer but the output head, i.e. the
    model's linear_names); list entries match the whole name or a dotted suffix of it, and only then
    layers_to_transform / layers_pattern narrow the choice to the layer index (the first numbered segment)."""
    exclude = raw.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str) and re.fullmatch(exclude, key) or \
                not isinstance(exclude, str) and _suffix_match(exclude, key):
            return False
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(linear_names)  # PEFT expands the shorthand to names, then applies the list rule
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if not _suffix_match(targets, key):
        return False
    if key in targets:
        return True
    indexes = raw.get("layers_to_transform")
    if indexes is None or indexes == []:
        return True
    patterns = raw.get("layers_pattern")
    if not patterns:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if m is not None:
                break
    if m is None:
        return False
    idx = int(m.group("idx"))
    return idx == indexes if isinstance(indexes, int) else idx in indexes


def _describe(modules: list[tuple[int, str]]) -> str:
    """'q_proj (layers [0, 2]), ...' for (layer, proj) pairs."""
    by_proj: dict[str, list[int]] = {}
    for layer, proj in modules:
        by_proj.setdefault(proj, []).append(layer)
    ordered = sorted(by_proj.items(), key=lambda x: ALL_PROJS.index(x[0]))
    return ", ".join(f"{p} (layers {sorted(ls)})" for p, ls in ordered)


# config fields that change the math; refused unless at their neutral value
_REFUSED_FIELDS = {
    "use_dora": ("DoRA (use_dora) is not supported", lambda v: bool(v)),
    "modules_to_save": ("modules_to_save (fully trained extra modules) is not supported", lambda v: bool(v)),
    "fan_in_fan_out": ("fan_in_fan_out=true is not supported (Llama projections are nn.Linear)", lambda v: bool(v)),
    "lora_bias": ("lora_bias is not supported", lambda v: bool(v)),
    "layer_replication": ("layer_replication is not supported", lambda v: bool(v)),
    "trainable_token_indices": ("trainable_token_indices (trained embedding rows) is not supported", lambda v: bool(v)),
    "alora_invocation_tokens": ("activated LoRA (alora_invocation_tokens) is not supported", lambda v: bool(v)),
    "use_qalora": ("QA-LoRA (use_qalora) is not supported", lambda v: bool(v)),
    "kasa_config": ("KaSA (kasa_config) is not supported", lambda v: bool(v)),
    "monteclora_config": ("MonteCLoRA (monteclora_config) is not supported", lambda v: bool(v)),
    "use_bdlora": ("BD-LoRA (use_bdlora) is not supported", lambda v: bool(v)),
    "arrow_config": ("Arrow routing (arrow_config) is not supported", lambda v: bool(v)),
    "megatron_config": ("megatron_config is not supported", lambda v: bool(v)),
}


def read_adapter_config(adapter_dir: str, name: str, max_lora_rank: int) -> AdapterConfigInfo:
    """Read and validate adapter_config.json (and that the weights file exists). Cheap; raises AdapterLoadError."""
    if not os.path.isdir(adapter_dir):
        raise _fail(name, f"{adapter_dir} is not a directory")
    cfg_path = os.path.join(adapter_dir, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise _fail(name, f"missing {CONFIG_NAME} in {adapter_dir} (expected a PEFT save_pretrained directory)")
    if not os.path.isfile(os.path.join(adapter_dir, WEIGHTS_NAME)):
        if os.path.isfile(os.path.join(adapter_dir, PICKLE_WEIGHTS_NAME)):
            raise _fail(name, f"only {PICKLE_WEIGHTS_NAME} (pickle) found in {adapter_dir}; pickled weights are "
                        f"refused because loading them can run arbitrary code. Save with safe_serialization=True "
                        f"(the default) to get {WEIGHTS_NAME}")
        raise _fail(name, f"missing {WEIGHTS_NAME} in {adapter_dir}")
    if os.path.getsize(cfg_path) > MAX_CONFIG_BYTES:
        raise _fail(name, f"{CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        with open(cfg_path, "rb") as f:
            raw = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(name, f"cannot read {CONFIG_NAME}: {e}") from None
    return parse_adapter_config(raw, name, max_lora_rank)


def parse_adapter_config(raw: dict, name: str, max_lora_rank: int) -> AdapterConfigInfo:
    if not isinstance(raw, dict):
        raise _fail(name, f"{CONFIG_NAME} must hold a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(name, f"peft_type {peft_type!r} is not supported (only LORA)")
    for key, (msg, bad) in _REFUSED_FIELDS.items():
        if key in raw and raw[key] is not None and bad(raw[key]):
            raise _fail(name, msg)
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise _fail(name, f"bias={bias!r} is not supported (only 'none')")

    r = raw.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(name, f"r must be a positive integer, got {r!r}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _fail(name, f"lora_alpha must be a number, got {alpha!r}")
    use_rslora = bool(raw.get("use_rslora", False))
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise _fail(name, "rank_pattern and alpha_pattern must be JSON objects")
    for k, v in rank_pattern.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _fail(name, f"rank_pattern[{k!r}] must be a positive integer, got {v!r}")
    for k, v in alpha_pattern.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise _fail(name, f"alpha_pattern[{k!r}] must be a number, got {v!r}")
    for k in list(rank_pattern) + list(alpha_pattern):
        try:
            re.compile(k)
        except re.error as e:
            raise _fail(name, f"invalid pattern {k!r} in rank_pattern/alpha_pattern: {e}") from None
    max_rank = max([r, *rank_pattern.values()])
    if max_rank > max_lora_rank:
        raise _fail(name, f"rank {max_rank} exceeds max_lora_rank={max_lora_rank}")

    params = raw.get("target_parameters") or []
    if not (isinstance(params, list) and all(isinstance(t, str) and t for t in params)):
        raise _fail(name, f"target_parameters must be a list of parameter names, got {params!r}")
    targets = raw.get("target_modules")
    if targets is None or targets == [] and params:
        if not params:
            raise _fail(name, "target_modules is not set")
        targets = []
    elif isinstance(targets, str):
        if targets != "all-linear":
            try:
                re.compile(targets)
            except re.error as e:
                raise _fail(name, f"target_modules regex {targets!r} is invalid: {e}") from None
    elif isinstance(targets, list):
        if not targets:
            raise _fail(name, "target_modules is empty")
        known = SUPPORTED_PROJS + FUSED_PROJS + MOE_V4_NAMES["mixtral"]  # the MoE names are judged with the model
        for t in targets:
            if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in known:
                raise _fail(name, f"unsupported target module {t!r} (supported: "
                            f"{', '.join(SUPPORTED_PROJS + FUSED_PROJS)})")
    else:
        raise _fail(name, f"target_modules must be a list or a string, got {type(targets).__name__}")
    exclude = raw.get("exclude_modules")
    if isinstance(exclude, str):
        try:
            re.compile(exclude)
        except re.error as e:
            raise _fail(name, f"exclude_modules regex {exclude!r} is invalid: {e}") from None
    elif exclude is not None and not (isinstance(exclude, list) and all(isinstance(x, str) for x in exclude)):
        raise _fail(name, "exclude_modules must be a regex string or a list of module names")
    layers = raw.get("layers_to_transform")
    if isinstance(targets, str) and (layers not in (None, []) or raw.get("layers_pattern")):
        raise _fail(name, "layers_to_transform / layers_pattern cannot be used when target_modules is a string "
                    "(PEFT refuses this config too)")
    if layers is not None and not (_is_int(layers) or isinstance(layers, list) and all(_is_int(x) for x in layers)):
        raise _fail(name, f"layers_to_transform must be an integer or a list of integers, got {layers!r}")
    pattern = raw.get("layers_pattern")
    if pattern is not None and not (isinstance(pattern, str) or isinstance(pattern, list)
                                    and all(isinstance(x, str) for x in pattern)):
        raise _fail(name, f"layers_pattern must be a string or a list of strings, got {pattern!r}")
    return AdapterConfigInfo(r, float(alpha), use_rslora, rank_pattern, alpha_pattern, targets, max_rank, raw)


_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>[A-Za-z_]+)\.(?P<proj>[A-Za-z_]+))"
    r"\.lora_(?P<ab>A|B)(?:\.[A-Za-z0-9_\-]+)?\.weight$"
)
# PEFT's ParamWrapper on the experts: one wrapper per targeted parameter, nested (inner ones under .base_layer)
_EXPERT_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)(?P<inner>(?:\.base_layer)*)"
    r"\.lora_(?P<ab>A|B)(?:\.[A-Za-z0-9_\-]+)?\.weight$"
)


def _explain_key(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key:
        return "LoRA on embed_tokens is not supported"
    if "lm_head" in key:
        return "LoRA on lm_head is not supported"
    if "lora_magnitude_vector" in key:
        return "DoRA weights (lora_magnitude_vector) are not supported"
    if "modules_to_save" in key or "original_module" in key:
        return "modules_to_save weights are not supported"
    if key.endswith(".bias"):
        return "bias weights are not supported"
    return "not a LoRA A/B weight of a projection loom serves"


def _moe_targets(name: str, config: AdapterConfigInfo, spec: LoraModelSpec) -> set[tuple[int, str]]:
    """The experts target_parameters selects, as PEFT matches them ((layer, experts.* projection) pairs); refuses
    what PEFT would convert or apply to the router first, and parameters that are not expert weights."""
    params = config.raw.get("target_parameters") or []
    family = spec.moe_family
    if family is None:
        if params:
            raise _fail(name, f"target_parameters {params!r}: only the experts of a MoE model are served as "
                        "parameter targets (use target_modules for linear layers)")
        return set()
    v4 = MOE_V4_NAMES[family]
    how = ("on transformers 5, PEFT converts such a config onto the fused experts / the router before applying it; "
           "loom serves expert LoRA as PEFT saves it there: target_parameters "
           "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']")
    g = spec.group("experts_gate_up")
    layers = spec.layers_of(g)
    targets = config.target_modules
    if isinstance(targets, str):
        probes = [f"model.layers.{i}.mlp.{n}" for i in layers for n in ["gate", "gate.weight", *EXPERT_PROJS]
                  + [f"experts.{old}" for old in v4 if old != "gate"]]
        hit = "all-linear" if targets.lower() == "all-linear" else \
            next((p for p in probes if re.fullmatch(targets, p)), None)
        if hit is not None:
            raise _fail(name, f"target_modules {targets!r} covers the MoE router or experts ({hit}): {how}")
    else:
        bad = [t for t in targets if t.rsplit(".", 1)[-1] in v4]
        if bad:
            raise _fail(name, f"target_modules {bad} name MoE router/expert modules of transformers 4: {how}")
    found = set()
    for t in params:
        keys = [(i, p) for i in layers for p in EXPERT_PROJS + ("gate.weight",)
                if (k := f"model.layers.{i}.mlp.{p}") == t or k.endswith(f".{t}")]
        if any(p == "gate.weight" for _, p in keys):
            raise _fail(name, f"target_parameters {t!r}: LoRA on the MoE router (mlp.gate) is not supported")
        if not keys:
            raise _fail(name, f"target_parameters {t!r} is not an expert weight of this model (supported: "
                        "mlp.experts.gate_up_proj, mlp.experts.down_proj)")
        found.update(keys)
    return found


def target_ranks(name: str, config: AdapterConfigInfo, spec: LoraModelSpec) -> dict[tuple[int, str], int]:
    """(layer, projection) -> rank, for every module (and expert weight) the config selects in this model as PEFT
    matches it, with rank_pattern applied; known from the config alone, so the registry sizes an adapter's rows in
    each row space before reading its weights (the loader then requires exactly these weights and ranks). Refuses
    MoE targets PEFT would convert first and target names this model does not have."""
    module_projs = spec.module_projs()
    linear_names = tuple(dict.fromkeys(p for _, p in module_projs))
    expert_targets = _moe_targets(name, config, spec)
    if isinstance(config.target_modules, list):
        for t in config.target_modules:
            if t.rsplit(".", 1)[-1] not in linear_names:
                raise _fail(name, f"target module {t!r} is not a module of this {spec.arch} (its projections: "
                            f"{', '.join(linear_names)})")
    targeted = {(layer, proj) for layer, proj in module_projs
                if is_targeted(config.raw, hf_module_name(layer, proj), linear_names)} | expert_targets
    out = {}
    for layer, proj in targeted:
        rk = _pattern_key(config.rank_pattern.keys(), hf_module_name(layer, proj))
        out[(layer, proj)] = config.rank_pattern[rk] if rk is not None else config.r
    return out


def _read_expert_weights(name: str, entries: dict, spec: LoraModelSpec, mods: dict) -> None:
    """PEFT's expert LoRA (A [r*E, in], B [out, r*E]) -> per expert A_e = A.view(E, r, in)[e] and
    B_e = B.view(out, r, E)[:, :, e], into mods[(layer, experts.* projection)]; which parameter a wrapper holds
    follows from its shapes (gate_up: in = hidden, out = 2 * intermediate; down: in = intermediate, out = hidden)."""
    if not entries:
        return
    gu, dn = spec.group("experts_gate_up"), spec.group("experts_down")
    E = gu.num_experts
    for (layer, inner), e in sorted(entries.items()):
        where = f"layers.{layer}.mlp.experts{inner}"
        if "A" not in e or "B" not in e:
            raise _fail(name, f"{where} has lora_{'A' if 'A' not in e else 'B'} missing")
        A, B = e["A"], e["B"]
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] % E or B.shape[1] != A.shape[0]:
            raise _fail(name, f"{where}: expert LoRA of {E} experts needs lora_A [r*{E}, in] and lora_B [out, r*{E}], "
                        f"got {tuple(A.shape)} and {tuple(B.shape)}")
        proj = next((p for p, g in zip(EXPERT_PROJS, (gu, dn)) if (A.shape[1], B.shape[0]) == g.proj_shape(p)), None)
        if proj is None:
            raise _fail(name, f"{where}: shape mismatch with the base model's experts: lora_A {tuple(A.shape)}, "
                        f"lora_B {tuple(B.shape)}")
        if (layer, proj) in mods:
            raise _fail(name, f"duplicate weights for layers.{layer}.{proj}")
        r = A.shape[0] // E
        mods[(layer, proj)] = {"module": f"{e['module']}.{proj.split('.')[1]}", "rank": r,
                               "A": A.reshape(E, r, A.shape[1]), "Bt": B.reshape(B.shape[0], r, E).permute(2, 1, 0)}


def load_peft_adapter(
    adapter_dir: str,
    name: str,
    spec: LoraModelSpec,
    dtype: torch.dtype,
    max_lora_rank: int,
    config: AdapterConfigInfo | None = None,
    pin_memory: bool = False,
) -> AdapterWeights:
    """Read, validate and lay out one adapter (host memory). Raises AdapterLoadError."""
    from safetensors.torch import load as st_load

    if config is None:
        config = read_adapter_config(adapter_dir, name, max_lora_rank)
    linear_names = tuple(dict.fromkeys(p for _, p in spec.module_projs()))
    targeted = set(target_ranks(name, config, spec))
    cfg_bytes = b""
    try:
        with open(os.path.join(adapter_dir, CONFIG_NAME), "rb") as f:
            cfg_bytes = f.read()
        with open(os.path.join(adapter_dir, WEIGHTS_NAME), "rb") as f:
            data = f.read()
    except OSError as e:
        raise _fail(name, f"cannot read adapter files: {e}") from None
    content_hash = hashlib.sha256(cfg_bytes + b"\0" + data).hexdigest()
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error types
        raise _fail(name, f"{WEIGHTS_NAME} is not a valid safetensors file: {e}") from None
    del data
    if not tensors:
        raise _fail(name, f"{WEIGHTS_NAME} holds no tensors")

    # (layer, proj) -> {"module": PEFT module key, "A": [(E,) r, in], "Bt": [(E,) r, out], "rank": r}
    mods: dict[tuple[int, str], dict] = {}
    dense: dict[tuple[int, str], dict] = {}
    experts: dict[tuple[int, str], dict] = {}
    for key, t in tensors.items():
        m = _EXPERT_KEY_RE.match(key) if spec.moe_family else None
        if m:
            layer = int(m.group("layer"))
            entry = experts.setdefault((layer, m.group("inner")), {"module": m.group("module")})
        else:
            m = _KEY_RE.match(key)
            if not m:
                raise _fail(name, f"unsupported weight {key!r}: {_explain_key(key)}")
            proj, block = m.group("proj"), m.group("block")
            if proj == "gate" and spec.moe_family:
                raise _fail(name, f"unsupported weight {key!r}: LoRA on the MoE router (mlp.gate) is not supported")
            if proj not in linear_names or PROJ_TO_GROUP[proj][2] != block:
                raise _fail(name, f"unsupported target module {block}.{proj} in weight {key!r} "
                            f"(supported: {', '.join(linear_names)})")
            layer = int(m.group("layer"))
            entry = dense.setdefault((layer, proj), {"module": m.group("module")})
        if layer >= spec.num_layers:
            raise _fail(name, f"weight {key!r} is for layer {layer} but the base model has {spec.num_layers} layers")
        if m.group("ab") in entry:
            raise _fail(name, f"duplicate weight for layers.{layer} lora_{m.group('ab')} ({key})")
        entry[m.group("ab")] = t
    for (layer, proj), e in sorted(dense.items()):
        where = f"layers.{layer}.{proj}"
        if "A" not in e or "B" not in e:
            raise _fail(name, f"{where} has lora_{'A' if 'A' not in e else 'B'} missing")
        A, B = e["A"], e["B"]
        in_f, out_f = spec.proj_shape(proj)
        if A.dim() != 2 or B.dim() != 2:
            raise _fail(name, f"{where}: lora_A/lora_B must be 2-D, got {tuple(A.shape)} and {tuple(B.shape)}")
        if A.shape[1] != in_f or B.shape[0] != out_f or B.shape[1] != A.shape[0]:
            raise _fail(name, f"{where}: shape mismatch with the base model: lora_A {tuple(A.shape)}, lora_B "
                        f"{tuple(B.shape)}; expected lora_A [r, {in_f}] and lora_B [{out_f}, r]")
        mods[(layer, proj)] = {"module": e["module"], "rank": A.shape[0], "A": A, "Bt": B.t()}
    _read_expert_weights(name, experts, spec, mods)

    # validate ranks and scalings (patterns are matched against the module / parameter key, as PEFT does)
    module_rank: dict[tuple[int, str], int] = {}
    module_scaling: dict[tuple[int, str], float] = {}
    for (layer, proj), e in sorted(mods.items()):
        where = f"layers.{layer}.{proj}"
        r = e["rank"]
        if r < 1 or r > max_lora_rank:
            raise _fail(name, f"{where}: rank {r} is outside 1..max_lora_rank={max_lora_rank}")
        if not (e["A"].is_floating_point() and e["Bt"].is_floating_point()):
            raise _fail(name, f"{where}: weights must be floating point, got {e['A'].dtype}/{e['Bt'].dtype}")
        mkey = e["module"]
        rk = _pattern_key(config.rank_pattern.keys(), mkey)
        expected_r = config.rank_pattern[rk] if rk is not None else config.r
        if r != expected_r:
            raise _fail(name, f"{where}: weights have rank {r} but the config says {expected_r} "
                        f"(r / rank_pattern)")
        ak = _pattern_key(config.alpha_pattern.keys(), mkey)
        alpha = config.alpha_pattern[ak] if ak is not None else config.lora_alpha
        module_rank[(layer, proj)] = r
        module_scaling[(layer, proj)] = config.scaling_for(r, alpha)
        if not (torch.isfinite(e["A"]).all() and torch.isfinite(e["Bt"]).all()):
            raise _fail(name, f"{where}: weights contain NaN or Inf")

    present = sorted({proj for _, proj in mods}, key=ALL_PROJS.index)
    extra = sorted(set(mods) - targeted)
    if extra:
        raise _fail(name, f"weights for {_describe(extra)} are not in target_modules {config.target_modules!r}"
                    + (f" / target_parameters {config.raw.get('target_parameters')!r}" if spec.moe_family else ""))
    missing = sorted(targeted - set(mods))
    if missing:
        raise _fail(name, f"target_modules {config.target_modules!r} selects {_describe(missing)} but "
                    f"{WEIGHTS_NAME} has no weights for them")

    rank = max(module_rank.values())
    base_scaling = config.scaling_for(config.r, config.lora_alpha)
    if base_scaling == 0.0:
        base_scaling = 1.0 if all(s == 0.0 for s in module_scaling.values()) else max(module_scaling.values(), key=abs)

    a_out: dict[str, torch.Tensor] = {}
    b_out: dict[str, torch.Tensor] = {}
    group_ranks: dict[str, int] = {}
    for g in spec.groups:
        here = [(layer, proj) for (layer, proj) in mods if spec.group_of(proj) is g]
        if not here:
            continue
        pos = {layer: i for i, layer in enumerate(spec.layers_of(g))}  # the weights' layers all have the group
        lead = (len(pos),) + ((g.num_experts,) if g.num_experts else ())
        a = torch.zeros(*lead, g.num_slices, rank, g.in_features, dtype=dtype)
        b = torch.zeros(*lead, rank, g.out_features, dtype=dtype)
        offs = g.slice_offsets
        for layer, proj in here:
            e = mods[(layer, proj)]
            si = PROJ_TO_GROUP[proj][1]
            r = module_rank[(layer, proj)]
            ratio = module_scaling[(layer, proj)] / base_scaling
            bt = e["Bt"] if ratio == 1.0 else e["Bt"].float() * ratio
            for s in (range(g.num_slices) if si is None else [si]):  # a fused projection's A serves every slice
                a[pos[layer]][..., s, :r, :].copy_(e["A"])
            lo, hi = (0, g.out_features) if si is None else (offs[si], offs[si + 1])
            b[pos[layer]][..., :r, lo:hi].copy_(bt)
        a_out[g.name] = a
        b_out[g.name] = b
        group_ranks[g.name] = max(module_rank[m] for m in here)
    w = AdapterWeights(name, adapter_dir, rank, float(base_scaling), a_out, b_out, present, content_hash, group_ranks)
    if pin_memory:
        w.pin_memory()
    return w
