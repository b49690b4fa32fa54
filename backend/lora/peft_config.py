"""Read and validate a PEFT LoRA adapter's `adapter_config.json` into an AdapterConfigInfo, before any weight is read.

Accepted: peft_type LORA, ranks 1..max_lora_rank (`r`, `rank_pattern`), `lora_alpha` / `alpha_pattern` scaling or
rsLoRA, target_modules as a list of the projections loom serves (loom.lora.model_spec), "all-linear" or a regex
string, `target_parameters` (MoE experts), `exclude_modules`, `layers_to_transform` / `layers_pattern`.

Refused with an `AdapterLoadError` that names the adapter and the problem: anything that would change the math beyond
plain LoRA on those projections (DoRA, biases, modules_to_save, fan_in_fan_out, ...: _REFUSED_FIELDS), malformed
values and patterns, rank > max_lora_rank, a missing or oversized config, a missing weights file, and pickle-only
`adapter_model.bin` (never unpickled). What the config selects in a given model is loom.lora.peft_targets'; the
weights are loom.lora.peft_loader's. Reading the config is cheap, so the registry does it synchronously.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

from loom.lora.model_spec import FUSED_PROJS, MOE_V4_NAMES, SUPPORTED_PROJS

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
SAFETENSORS_MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header
PICKLE_WEIGHTS_NAME = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20


class AdapterLoadError(ValueError):
    """An adapter directory cannot be served; the message names the adapter and what is wrong."""


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
