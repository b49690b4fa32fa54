"""Load a HF PEFT LoRA adapter directory (`save_pretrained` output) as is, into host tensors laid out for the pools.

Accepted: `adapter_config.json` (read and validated by loom.lora.peft_config) + `adapter_model.safetensors` with LoRA
A/B weights for exactly the modules the config selects (loom.lora.peft_targets) among the model's projections
(loom.lora.model_spec): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or Phi-3's fused qkv_proj /
gate_up_proj, and on MoE models the experts through `target_parameters` (mlp.experts.gate_up_proj,
mlp.experts.down_proj: PEFT's ParamWrapper, one LoRA per expert). Weights are converted to the base model's dtype.

Refused with an `AdapterLoadError` that names the adapter and the problem: weights of anything but plain LoRA on those
projections (DoRA magnitudes, biases, modules_to_save, embedding/lm_head/router LoRA), shape mismatches with the base
model, ranks that differ from the config's, weights missing for a selected module or present for an unselected one,
an unreadable safetensors file, non-finite weights.

The result (`AdapterWeights`) holds, per module group (loom.lora.model_spec.GROUP_LAYOUT), A as
[group layers, (experts,) num_slices, rank, in] and B^T as [group layers, (experts,) rank, sum(output_sizes)] (the
layers that have the group, as the pools stack them; zeros for untargeted slices/layers); groups the adapter does not
touch at all are absent (the pool writes zeros there), and `ranks` gives each present group's largest module rank.
A fused projection (Phi-3's qkv_proj, the experts' gate_up_proj) has one A for all its slices: it is copied into
each slice, and B is split by slice.
If modules of one adapter have different ranks (rank_pattern) they are zero-padded to the adapter's
largest rank; if they have different scalings, the ratio to the adapter's scaling is folded into B.

The config and target names this module used to define are re-exported from here (__all__).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from loom.lora.load_pace import PIECE_BYTES
from loom.lora.model_spec import (
    ALL_PROJS,
    EXPERT_PROJS,
    GROUP_LAYOUT,
    PROJ_TO_GROUP,
    SUPPORTED_PROJS,
    LoraGroupSpec,
    LoraModelSpec,
    hf_module_name,
)
from loom.lora.peft_config import (
    CONFIG_NAME,
    SAFETENSORS_MAX_HEADER,
    WEIGHTS_NAME,
    AdapterConfigInfo,
    AdapterLoadError,
    _fail,
    parse_adapter_config,
    read_adapter_config,
)
from loom.lora.peft_targets import _pattern_key, is_targeted, target_ranks

__all__ = ["SUPPORTED_PROJS", "GROUP_LAYOUT", "PROJ_TO_GROUP", "LoraGroupSpec", "LoraModelSpec", "hf_module_name",
           "AdapterLoadError", "AdapterWeights", "AdapterConfigInfo", "read_adapter_config", "parse_adapter_config",
           "load_peft_adapter", "is_targeted", "target_ranks", "CONFIG_NAME", "WEIGHTS_NAME"]


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


def _describe(modules: list[tuple[int, str]]) -> str:
    """'q_proj (layers [0, 2]), ...' for (layer, proj) pairs."""
    by_proj: dict[str, list[int]] = {}
    for layer, proj in modules:
        by_proj.setdefault(proj, []).append(layer)
    ordered = sorted(by_proj.items(), key=lambda x: ALL_PROJS.index(x[0]))
    return ", ".join(f"{p} (layers {sorted(ls)})" for p, ls in ordered)


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


Alloc = Callable[[list[tuple[str, str, tuple[int, ...]]], torch.dtype], dict[tuple[str, str], torch.Tensor]]


def zeros_alloc(shapes: list[tuple[str, str, tuple[int, ...]]], dtype: torch.dtype) -> dict:
    """load_peft_adapter's default allocation of the laid-out tensors: zero-filled, in this process's heap."""
    return {(kind, g): torch.zeros(shape, dtype=dtype) for kind, g, shape in shapes}


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in t. A float32 sum is finite only if every element is (NaN and Inf propagate): one vectorised
    pass, 1 ms for 5 M bfloat16 elements against isfinite's 16; only a sum that overflows takes the exact check."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _no_pace() -> None:
    pass


def _read_weights(adapter_dir: str, name: str, map_file: bool, pace: Callable[[], None] = _no_pace
                  ) -> tuple[dict[str, torch.Tensor], str]:
    """The weights file's tensors (views of one buffer) and a fingerprint of the config and weights contents (the
    registry compares it when it reads the adapter again: "changed on disk"). map_file: views of a private mapping of
    the file (its pages come from the page cache as the layout copies them: a read into a fresh buffer, then
    safetensors' own copy, were ~10 of a rank-16 float32 load's ~50 ms of CPU), else of a read copy. A mapped file cut
    short while it is read ends the process (SIGBUS): only the loader process maps (it is replaced, the job retried).
    The fingerprint is a sha256 of the config, the weights' size and their CRC-32 (a sha256 of 20 MB of weights was
    ~10 ms; CRC-32 is 3 and detects any change a later edit or copy makes, which is what it is for)."""
    try:
        with open(os.path.join(adapter_dir, CONFIG_NAME), "rb") as f:
            cfg_bytes = f.read()
        with open(os.path.join(adapter_dir, WEIGHTS_NAME), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if map_file and size:
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            else:
                data = bytearray(size)
                f.readinto(data)
    except (OSError, ValueError) as e:
        raise _fail(name, f"cannot read adapter files: {e}") from None
    crc, view = 0, memoryview(data)
    for i in range(0, size, PIECE_BYTES):
        crc = zlib.crc32(view[i:i + PIECE_BYTES], crc)
        pace()
    view.release()
    content_hash = hashlib.sha256(cfg_bytes + b"\0" + f"{size}:{crc:08x}".encode()).hexdigest()
    return _parse_safetensors(name, data, pace), content_hash


def _parse_safetensors(name: str, data, pace: Callable[[], None] = _no_pace) -> dict[str, torch.Tensor]:
    """safetensors' format read in place: an 8-byte little-endian header length, a JSON header {tensor: {dtype,
    shape, data_offsets}} (and an optional __metadata__), then the data. Every tensor checked as safetensors checks
    it (known dtype, offsets inside the data, in order, not overlapping, matching the shape) before any view."""
    def bad(why: str) -> AdapterLoadError:
        return _fail(name, f"{WEIGHTS_NAME} is not a valid safetensors file: {why}")

    if len(data) < 8:
        raise bad("shorter than its 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > min(SAFETENSORS_MAX_HEADER, len(data) - 8):
        raise bad(f"header length {n} exceeds the file")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError as e:
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    header.pop("__metadata__", None)
    buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) > 8 + n else torch.empty(0, dtype=torch.uint8)
    body = len(data) - 8 - n
    pace()
    entries = []
    for key, info in header.items():
        try:
            dtype, shape, (lo, hi) = _ST_DTYPES[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {key!r} has a bad entry {info!r}") from None
        if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= body) or min(shape, default=0) < 0:
            raise bad(f"tensor {key!r}: offsets {[lo, hi]} outside the data ({body} bytes) or a negative dimension")
        if hi - lo != torch.Size(shape).numel() * dtype.itemsize:
            raise bad(f"tensor {key!r}: {hi - lo} bytes for shape {shape} of {info['dtype']}")
        entries.append((lo, hi, key, dtype, shape))
    pace()
    entries.sort()
    end = 0
    for lo, hi, key, _, _ in entries:
        if lo < end:
            raise bad(f"tensor {key!r} overlaps the tensor before it")
        end = hi
    if not entries:
        raise _fail(name, f"{WEIGHTS_NAME} holds no tensors")
    # a writer whose header length is not a multiple of 8 leaves the data unaligned: those tensors are copied
    out = {}
    for i, (lo, hi, key, dtype, shape) in enumerate(entries):
        t = buf[8 + n + lo:8 + n + hi]
        out[key] = (t if (8 + n + lo) % dtype.itemsize == 0 else t.clone()).view(dtype).view(shape)
        if i % 128 == 127:
            pace()
    return out


def load_peft_adapter(
    adapter_dir: str,
    name: str,
    spec: LoraModelSpec,
    dtype: torch.dtype,
    max_lora_rank: int,
    config: AdapterConfigInfo | None = None,
    pin_memory: bool = False,
    alloc: Alloc | None = None,
    map_file: bool = False,
    pace: Callable[[], None] = _no_pace,
) -> AdapterWeights:
    """Read, validate and lay out one adapter (host memory). Raises AdapterLoadError. alloc: where the laid-out
    tensors are made, zero-filled (default zeros_alloc; the loader process's lands them in a slot of the engine's
    arena, loom.lora.load_arena). map_file: map the weights file instead of reading it (_read_weights: the loader
    process only). pace: called between pieces of the work (loom.lora.load_pace.Pacer: the loader process's CPU
    share)."""
    pace()
    if config is None:
        config = read_adapter_config(adapter_dir, name, max_lora_rank)
    linear_names = tuple(dict.fromkeys(p for _, p in spec.module_projs()))
    targeted = set(target_ranks(name, config, spec))
    tensors, content_hash = _read_weights(adapter_dir, name, map_file, pace)
    pace()

    # (layer, proj) -> {"module": PEFT module key, "A": [(E,) r, in], "Bt": [(E,) r, out], "rank": r}
    mods: dict[tuple[int, str], dict] = {}
    dense: dict[tuple[int, str], dict] = {}
    experts: dict[tuple[int, str], dict] = {}
    for i, (key, t) in enumerate(tensors.items()):
        if i % 64 == 63:
            pace()
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
    group_of = {p: spec.group_of(p) for p in PROJ_TO_GROUP}  # once a load: ~1,000 linear lookups were ~1 ms of it
    for (layer, proj), e in sorted(dense.items()):
        where = f"layers.{layer}.{proj}"
        if "A" not in e or "B" not in e:
            raise _fail(name, f"{where} has lora_{'A' if 'A' not in e else 'B'} missing")
        A, B = e["A"], e["B"]
        in_f, out_f = group_of[proj].proj_shape(proj)
        if A.dim() != 2 or B.dim() != 2:
            raise _fail(name, f"{where}: lora_A/lora_B must be 2-D, got {tuple(A.shape)} and {tuple(B.shape)}")
        if A.shape[1] != in_f or B.shape[0] != out_f or B.shape[1] != A.shape[0]:
            raise _fail(name, f"{where}: shape mismatch with the base model: lora_A {tuple(A.shape)}, lora_B "
                        f"{tuple(B.shape)}; expected lora_A [r, {in_f}] and lora_B [{out_f}, r]")
        mods[(layer, proj)] = {"module": e["module"], "rank": A.shape[0], "A": A, "Bt": B.t()}
    pace()
    _read_expert_weights(name, experts, spec, mods)
    pace()

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
    present_groups = [(g, [(layer, proj) for (layer, proj) in mods if group_of[proj] is g]) for g in spec.groups]
    present_groups = [(g, here) for g, here in present_groups if here]
    shapes = []  # ("a" / "b", group, shape) of every laid-out tensor, allocated at once (alloc)
    for g, _ in present_groups:
        lead = (len(spec.layers_of(g)),) + ((g.num_experts,) if g.num_experts else ())
        shapes += [("a", g.name, (*lead, g.num_slices, rank, g.in_features)),
                   ("b", g.name, (*lead, rank, g.out_features))]
    pace()
    out = (alloc or zeros_alloc)(shapes, dtype)
    for g, here in present_groups:
        pos = {layer: i for i, layer in enumerate(spec.layers_of(g))}  # the weights' layers all have the group
        a, b = out[("a", g.name)], out[("b", g.name)]
        a_layers, b_layers = a.unbind(0), b.unbind(0)
        offs = g.slice_offsets
        dst, src, nbytes = [], [], 0  # batched copies: 420 copies one by one were ~25 ms of a load's Python
        for layer, proj in here:
            e = mods[(layer, proj)]
            si = PROJ_TO_GROUP[proj][1]
            r = module_rank[(layer, proj)]
            ratio = module_scaling[(layer, proj)] / base_scaling
            a_l, n0 = a_layers[pos[layer]], len(dst)
            for s in (range(g.num_slices) if si is None else [si]):  # a fused projection's A serves every slice
                dst.append(a_l[..., s, :r, :])
                src.append(e["A"])
            lo, hi = (0, g.out_features) if si is None else (offs[si], offs[si + 1])
            dst.append(b_layers[pos[layer]][..., :r, lo:hi])
            src.append(e["Bt"] if ratio == 1.0 else e["Bt"].float() * ratio)
            nbytes += sum(d.numel() for d in dst[n0:]) * dtype.itemsize
            if nbytes >= PIECE_BYTES:
                torch._foreach_copy_(dst, src)
                pace()
                dst, src, nbytes = [], [], 0
        if dst:
            torch._foreach_copy_(dst, src)
            pace()
        a_out[g.name] = a
        b_out[g.name] = b
        group_ranks[g.name] = max(module_rank[m] for m in here)
    # NaN / Inf checked over each laid-out group (after B's scaling, which could overflow), not per tensor: 420
    # tensors' isfinite were 19 of a rank-16 bfloat16 adapter's 40 ms of CPU (the loader competes with the steps)
    def finite(t: torch.Tensor) -> bool:
        ok = _all_finite(t)
        pace()
        return ok

    if not all(map(finite, (*a_out.values(), *b_out.values()))):
        bad = next((f"layers.{layer}.{proj}" for (layer, proj), e in sorted(mods.items())
                    if not (torch.isfinite(e["A"]).all() and torch.isfinite(e["Bt"]).all())
                    or not torch.isfinite(e["Bt"].float() * (module_scaling[(layer, proj)] / base_scaling)).all()),
                   None)
        if bad is None:  # finite as saved, out of range of the pools' type (lora_dtype)
            raise _fail(name, f"weights overflow {str(dtype).removeprefix('torch.')} (lora_dtype): NaN or Inf")
        raise _fail(name, f"{bad}: weights contain NaN or Inf")
    tensors = mods = dense = experts = None  # the file's views: a mapped file is unmapped here, a piece of its own
    pace()
    w = AdapterWeights(name, adapter_dir, rank, float(base_scaling), a_out, b_out, present, content_hash, group_ranks)
    if pin_memory:
        w.pin_memory()
    return w
