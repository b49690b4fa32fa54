"""Which modules (and MoE expert weights) an adapter config selects in a model, matched as PEFT matches them.

PEFT's rules, mirrored: target_modules as a full-match regex, "all-linear" or a list of (dotted-suffix) names,
exclude_modules first, layers_to_transform / layers_pattern (peft.tuners.tuners_utils.check_target_module_exists),
rank_pattern / alpha_pattern keys (peft.utils.other.get_pattern_key), and the experts through target_parameters.
Known from the config alone, so the registry sizes an adapter's rows before reading its weights, and the loader
(loom.lora.peft_loader) then requires exactly these modules. Refuses, with an AdapterLoadError, MoE targets PEFT
would convert first (transformers 5) and target names this model does not have.
"""
from __future__ import annotations

import re

from loom.lora.model_spec import EXPERT_PROJS, MOE_V4_NAMES, SUPPORTED_PROJS, LoraModelSpec, hf_module_name
from loom.lora.peft_config import AdapterConfigInfo, _fail


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
