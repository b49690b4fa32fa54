"""PEFT adapter loading: layout, scaling, dtype, and every refusal."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from harness.lora import load_hf, make_peft_adapter, make_tiny_llama, tiny_llama_config, write_raw_adapter
from loom.lora import AdapterLoadError, LoraModelSpec, load_peft_adapter, read_adapter_config

CFG = tiny_llama_config()
SPEC = LoraModelSpec.from_hf_config(CFG)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("base")))


def _load(path, name="ad", max_rank=64, dtype=torch.float32):
    return load_peft_adapter(path, name, SPEC, dtype, max_rank)


def _peft_state(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def test_spec_from_config():
    g = {x.name: x for x in SPEC.groups}
    assert g["qkv_proj"].output_sizes == (64, 32, 32) and g["qkv_proj"].in_features == 64
    assert g["gate_up_proj"].output_sizes == (128, 128) and g["down_proj"].in_features == 128
    assert SPEC.num_layers == 2


def test_layout_matches_peft(base_dir, tmp_path):
    d = make_peft_adapter(base_dir, str(tmp_path / "a"), seed=1, r=4, alpha=16,
                          target_modules=["q_proj", "v_proj", "down_proj"])
    w = _load(d)
    sd = _peft_state(d)
    assert w.rank == 4 and w.scaling == pytest.approx(16 / 4)
    assert set(w.a) == {"qkv_proj", "down_proj"}  # o_proj, gate_up untouched -> absent (pool writes zeros)
    assert w.target_modules == ["q_proj", "v_proj", "down_proj"]
    for layer in range(2):
        qa = sd[f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_A.weight"]
        qb = sd[f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_B.weight"]
        va = sd[f"base_model.model.model.layers.{layer}.self_attn.v_proj.lora_A.weight"]
        vb = sd[f"base_model.model.model.layers.{layer}.self_attn.v_proj.lora_B.weight"]
        torch.testing.assert_close(w.a["qkv_proj"][layer, 0], qa)
        torch.testing.assert_close(w.a["qkv_proj"][layer, 2], va)
        assert w.a["qkv_proj"][layer, 1].abs().sum() == 0  # k untargeted
        torch.testing.assert_close(w.b["qkv_proj"][layer, :, 0:64], qb.t())
        assert w.b["qkv_proj"][layer, :, 64:96].abs().sum() == 0
        torch.testing.assert_close(w.b["qkv_proj"][layer, :, 96:128], vb.t())
        db = sd[f"base_model.model.model.layers.{layer}.mlp.down_proj.lora_B.weight"]
        torch.testing.assert_close(w.b["down_proj"][layer], db.t())
    assert len(w.content_hash) == 64


def test_rslora_and_dtype(base_dir, tmp_path):
    d = make_peft_adapter(base_dir, str(tmp_path / "a"), seed=2, r=9, alpha=6, target_modules=["o_proj"],
                          use_rslora=True)
    w = _load(d, dtype=torch.bfloat16)
    assert w.scaling == pytest.approx(6 / math.sqrt(9))
    assert w.a["o_proj"].dtype == torch.bfloat16 and w.b["o_proj"].dtype == torch.bfloat16


def test_all_linear_and_regex_targets(base_dir, tmp_path):
    d = make_peft_adapter(base_dir, str(tmp_path / "a"), seed=3, r=2, alpha=2, target_modules="all-linear")
    w = _load(d)
    assert w.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    d = make_peft_adapter(base_dir, str(tmp_path / "b"), seed=3, r=2, alpha=2,
                          target_modules=r".*\.1\.mlp\.(gate|up)_proj")
    w = _load(d)
    assert w.target_modules == ["gate_proj", "up_proj"]
    assert w.a["gate_up_proj"][0].abs().sum() == 0 and w.a["gate_up_proj"][1].abs().sum() > 0


def test_rank_and_alpha_pattern(base_dir, tmp_path):
    d = make_peft_adapter(base_dir, str(tmp_path / "a"), seed=4, r=4, alpha=8, target_modules=["q_proj", "down_proj"],
                          rank_pattern={"down_proj": 2}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 2})
    w = _load(d)
    sd = _peft_state(d)
    assert w.rank == 4 and w.scaling == pytest.approx(2.0)
    # down_proj rank 2 (scaling 8/2 = 4 = 2x adapter scaling): padded rows zero, ratio folded into B
    db = sd["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    torch.testing.assert_close(w.b["down_proj"][0, :2], db.t() * 2.0)
    assert w.b["down_proj"][0, 2:].abs().sum() == 0 and w.a["down_proj"][0, 0, 2:].abs().sum() == 0
    # layer-1 q_proj alpha 2 -> scaling 0.5 = 0.25x
    qb = sd["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    torch.testing.assert_close(w.b["qkv_proj"][1, :, :64], qb.t() * 0.25)
    qb0 = sd["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    torch.testing.assert_close(w.b["qkv_proj"][0, :, :64], qb0.t())


def test_layers_to_transform(base_dir, tmp_path):
    d = make_peft_adapter(base_dir, str(tmp_path / "a"), seed=5, r=3, alpha=3, target_modules=["k_proj"],
                          layers_to_transform=[1])
    w = _load(d)
    assert w.a["qkv_proj"][0].abs().sum() == 0 and w.a["qkv_proj"][1, 1].abs().sum() > 0


# ------------------------------------------------------------------------------------------- refusals


def _raw(tmp_path, name="x", **kw):
    args = dict(seed=0, r=4, alpha=8, target_modules=["q_proj"])
    args.update(kw)
    return write_raw_adapter(str(tmp_path / name), CFG, **args)


def _refused(path, *fragments, max_rank=64, name="bad"):
    with pytest.raises(AdapterLoadError) as ei:
        _load(path, name=name, max_rank=max_rank)
    msg = str(ei.value)
    assert f"adapter {name!r}" in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_refuse_missing_dir_and_files(tmp_path):
    _refused(str(tmp_path / "nope"), "not a directory")
    d = _raw(tmp_path)
    os.remove(os.path.join(d, "adapter_config.json"))
    _refused(d, "missing adapter_config.json")
    d = _raw(tmp_path, "y")
    os.remove(os.path.join(d, "adapter_model.safetensors"))
    _refused(d, "missing adapter_model.safetensors")


def test_refuse_pickle_bin(tmp_path):
    d = _raw(tmp_path)
    os.remove(os.path.join(d, "adapter_model.safetensors"))
    marker = tmp_path / "pwned"
    # a pickle that would create a file if it were ever unpickled
    import pickle

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(d, "adapter_model.bin"), "wb") as f:
        pickle.dump(Evil(), f)
    _refused(d, "adapter_model.bin", "pickle", "safetensors")
    assert not marker.exists()


@pytest.mark.parametrize("extra,frag", [
    ({"target_modules": ["q_proj", "embed_tokens"]}, "unsupported target module 'embed_tokens'"),
    ({"target_modules": ["lm_head"]}, "unsupported target module 'lm_head'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias='all'"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"lora_bias": True}, "lora_bias"),
    ({"target_modules": "("}, "regex"),
    ({"r": 0}, "r must be a positive integer"),
])
def test_refuse_config(tmp_path, extra, frag):
    _refused(_raw(tmp_path, extra_config=extra), frag)


def test_refuse_bad_json(tmp_path):
    d = _raw(tmp_path)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write("{not json")
    _refused(d, "cannot read adapter_config.json")


def test_refuse_rank_over_max(tmp_path):
    _refused(_raw(tmp_path, r=8), "exceeds max_lora_rank=4", max_rank=4)
    _refused(_raw(tmp_path, "y", r=2, extra_config={"rank_pattern": {"q_proj": 16}}), "rank 16 exceeds", max_rank=8)


def test_refuse_unknown_weights(tmp_path):
    emb = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 256)}
    _refused(_raw(tmp_path, "a", extra_tensors=emb), "embed_tokens")
    head = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}
    _refused(_raw(tmp_path, "b", extra_tensors=head), "lm_head")
    dora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(64)}
    _refused(_raw(tmp_path, "c", extra_tensors=dora), "DoRA")
    bias = {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)}
    _refused(_raw(tmp_path, "d", extra_tensors=bias), "bias")


def test_refuse_shape_mismatch(tmp_path):
    other = tiny_llama_config(hidden=32, inter=96, heads=2, kv_heads=1)
    d = write_raw_adapter(str(tmp_path / "x"), other, seed=0, r=4, alpha=8, target_modules=["q_proj"])
    _refused(d, "shape mismatch with the base model", "layers.0.q_proj")
    deep = tiny_llama_config(layers=4)
    d = write_raw_adapter(str(tmp_path / "y"), deep, seed=0, r=4, alpha=8, target_modules=["v_proj"])
    _refused(d, "but the base model has 2 layers")


def test_refuse_inconsistent_files(tmp_path):
    # rank in weights != config r
    _refused(_raw(tmp_path, "a", extra_config={"r": 8}), "rank 4 but the config says 8")
    # weights for a module not in target_modules
    _refused(_raw(tmp_path, "b", target_modules=["q_proj", "o_proj"], extra_config={"target_modules": ["q_proj"]}),
             "o_proj (layers [0, 1]) are not in target_modules")
    # target listed without weights
    _refused(_raw(tmp_path, "c", extra_config={"target_modules": ["q_proj", "k_proj"]}),
             "k_proj (layers [0, 1])", "no weights")
    # A without B
    from safetensors.torch import load_file, save_file

    d = _raw(tmp_path, "d")
    p = os.path.join(d, "adapter_model.safetensors")
    sd = load_file(p)
    del sd["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    save_file(sd, p)
    _refused(d, "layers.1.q_proj has lora_B missing")
    # non-finite
    d = _raw(tmp_path, "e")
    p = os.path.join(d, "adapter_model.safetensors")
    sd = load_file(p)
    sd["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"][0, 0] = float("nan")
    save_file(sd, p)
    _refused(d, "NaN")
    # not a safetensors file
    d = _raw(tmp_path, "f")
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(b"garbage" * 10)
    _refused(d, "not a valid safetensors file")


def test_read_config_only_is_cheap_and_validates(tmp_path):
    d = _raw(tmp_path, r=4, extra_config={"rank_pattern": {"q_proj": 6}})
    info = read_adapter_config(d, "x", 64)
    assert info.max_rank == 6
    with open(os.path.join(d, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4


# PEFT target_modules forms: which modules PEFT itself wraps is the oracle for loom's matching rule.
TARGET_FORMS = [
    {"target_modules": ["layers.0.self_attn.q_proj", "layers.2.mlp.down_proj"]},
    {"target_modules": ["self_attn.v_proj", "model.layers.1.mlp.up_proj"]},
    {"target_modules": ["q_proj", "o_proj"], "layers_to_transform": [0, 2]},
    {"target_modules": ["k_proj"], "layers_to_transform": 1, "layers_pattern": "layers"},
    {"target_modules": ["gate_proj", "up_proj"], "exclude_modules": ["layers.1.mlp.up_proj"]},
    {"target_modules": "all-linear", "exclude_modules": r".*\.self_attn\..*"},
    {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     "layers_to_transform": [1], "layers_pattern": ["blocks", "layers"]},
    {"target_modules": r"model\.layers\.[02]\.self_attn\.(q|v)_proj"},
    {"target_modules": r".*(down|o)_proj", "exclude_modules": ["layers.0.self_attn.o_proj"]},
]


@pytest.mark.parametrize("form", TARGET_FORMS, ids=lambda f: json.dumps(f)[:60])
def test_target_matching_equals_peft(tmp_path, form):
    from peft import LoraConfig, get_peft_model

    from loom.lora.peft_loader import SUPPORTED_PROJS, hf_module_name, is_targeted

    base = make_tiny_llama(str(tmp_path / "base"), seed=0, layers=3)
    pm = get_peft_model(load_hf(base), LoraConfig(r=2, lora_alpha=4, **form))
    wrapped = {n.removeprefix("base_model.model.") for n, m in pm.named_modules() if hasattr(m, "lora_A")}
    ours = {hf_module_name(layer, p) for layer in range(3) for p in SUPPORTED_PROJS
            if is_targeted(form, hf_module_name(layer, p))}
    assert ours == wrapped


def test_dotted_list_targets_load_and_match_peft(tmp_path):
    """A list naming single layers' modules (PEFT matches them as dotted suffixes) is served like PEFT serves it."""
    base = make_tiny_llama(str(tmp_path / "base"), seed=0, layers=3)
    d = make_peft_adapter(base, str(tmp_path / "a"), seed=9, r=4, alpha=8, scale=2.0,
                          target_modules=["layers.0.self_attn.q_proj", "layers.2.mlp.down_proj"])
    spec = LoraModelSpec.from_hf_config(tiny_llama_config(layers=3))
    w = load_peft_adapter(d, "a", spec, torch.float32, 64)
    assert w.target_modules == ["q_proj", "down_proj"]
    assert w.a["qkv_proj"][0, 0].abs().sum() > 0 and w.a["qkv_proj"][1:].abs().sum() == 0
    assert w.a["down_proj"][2].abs().sum() > 0 and w.a["down_proj"][:2].abs().sum() == 0


def test_layer_selection_with_a_regex_target_refused_like_peft(tmp_path):
    for extra in ({"layers_to_transform": [0]}, {"layers_pattern": "layers"}):
        _refused(_raw(tmp_path, f"x{len(extra)}{list(extra)[0]}",
                      extra_config={"target_modules": "all-linear", **extra}),
                 "cannot be used when target_modules is a string")


@pytest.mark.parametrize("value,dtype,match", [
    (float("nan"), torch.float32, r"layers\.1\.v_proj: weights contain NaN or Inf"),
    (float("-inf"), torch.bfloat16, r"layers\.1\.v_proj: weights contain NaN or Inf"),
    (1e6, torch.float16, r"overflow float16 \(lora_dtype\)"),  # finite as saved, past float16's range
])
def test_refuse_non_finite_weights(tmp_path, value, dtype, match):
    """The check runs once over the laid-out pools' tensors (a float32 sum, then the module is named): a NaN / Inf in
    any module's A or B, or a finite value the pools' type cannot hold, refuses the adapter; 1e6 in float32 loads."""
    from safetensors.torch import save_file

    path = write_raw_adapter(str(tmp_path / "ad"), CFG, seed=0, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    sd = _peft_state(path)
    key = next(k for k in sd if "layers.1." in k and "v_proj.lora_B" in k)
    sd[key][3, 1] = value
    save_file(sd, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(AdapterLoadError, match=match):
        _load(path, dtype=dtype)
    if math.isfinite(value):
        assert _load(path, dtype=torch.float32).b["qkv_proj"].abs().max() > 1e3


def _write_st(path: str, tensors: dict, header_pad: int = 0, edit=None) -> None:
    """A safetensors file written by hand: the header JSON padded with header_pad spaces (0: none, so the data may be
    unaligned), edit(header) applied before it is written."""
    import struct

    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": {torch.float32: "F32", torch.bfloat16: "BF16"}[t.dtype], "shape": list(t.shape),
                     "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if edit is not None:
        edit(header)
    h = json.dumps(header).encode() + b" " * header_pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.mark.parametrize("map_file", [False, True])
def test_weights_read_in_place_equal_safetensors(tmp_path, map_file):
    """The file read as is or mapped (the loader process's way) gives safetensors' own tensors, also where a writer
    left the data unaligned (header length not a multiple of 8)."""
    d = _raw(tmp_path, "a", target_modules=["q_proj", "v_proj", "down_proj"], dtype=torch.bfloat16)
    sd = {k: v.clone() for k, v in _peft_state(d).items()}
    want = load_peft_adapter(d, "a", SPEC, torch.float32, 64)
    for pad in range(8):
        e = tmp_path / f"pad{pad}"
        e.mkdir()
        with open(os.path.join(d, "adapter_config.json")) as f, open(e / "adapter_config.json", "w") as g:
            g.write(f.read())
        _write_st(str(e / "adapter_model.safetensors"), sd, header_pad=pad)
        got = load_peft_adapter(str(e), "a", SPEC, torch.float32, 64, map_file=map_file)
        assert set(got.a) == set(want.a)
        assert all(torch.equal(got.a[k], want.a[k]) and torch.equal(got.b[k], want.b[k]) for k in want.a)


@pytest.mark.parametrize("map_file", [False, True])
def test_malformed_safetensors_refused(tmp_path, map_file):
    import struct

    d = _raw(tmp_path, "a", target_modules=["q_proj"])
    sd = {k: v.clone() for k, v in _peft_state(d).items()}  # (load_file maps the file this test rewrites)
    p = os.path.join(d, "adapter_model.safetensors")
    k0 = sorted(sd)[0]

    def refused(*fragments):
        with pytest.raises(AdapterLoadError) as ei:
            load_peft_adapter(d, "bad", SPEC, torch.float32, 64, map_file=map_file)
        assert "adapter 'bad'" in str(ei.value)
        for f in fragments:
            assert f in str(ei.value), str(ei.value)

    def setf(key, field, value):
        return lambda h: h[key].__setitem__(field, value)

    cases = [
        (dict(edit=setf(k0, "dtype", "F33")), ["bad entry"]),
        (dict(edit=setf(k0, "data_offsets", [0, 1 << 40])), ["outside the data"]),
        (dict(edit=setf(k0, "data_offsets", [0, sd[k0].numel() * 4 - 4])), ["bytes for shape"]),
        (dict(edit=setf(k0, "shape", [sd[k0].shape[0], -1])), ["negative"]),
        (dict(edit=lambda h: h.update({k: dict(v, data_offsets=h[k0]["data_offsets"]) for k, v in h.items()
                                       if k != k0 and v["shape"] == h[k0]["shape"]})), ["overlaps"]),
        (dict(edit=lambda h: h.clear()), ["holds no tensors"]),
    ]
    for kw, fragments in cases:
        _write_st(p, sd, **kw)
        refused(*fragments)
    for raw, fragments in ((b"\x01\x02", ["shorter than"]), (struct.pack("<Q", 1 << 50) + b"{}", ["exceeds the file"]),
                           (struct.pack("<Q", 4) + b"[1,2", ["not JSON"]),
                           (struct.pack("<Q", 2) + b"[]", ["not a JSON object"]), (b"", ["shorter than"])):
        with open(p, "wb") as f:
            f.write(raw)
        refused("not a valid safetensors file" if raw else "", *fragments)
    # a file cut short: the last tensor's bytes run past its end
    _write_st(p, sd)
    with open(p, "rb+") as f:
        f.truncate(os.path.getsize(p) - 8)
    refused("outside the data")


def test_content_hash_follows_the_bytes(tmp_path):
    """Same config and weights in another folder: the same fingerprint; one weight changed (same size): another."""
    import shutil

    d = _raw(tmp_path, "a")
    h = _load(d).content_hash
    shutil.copytree(d, tmp_path / "copy")
    assert _load(str(tmp_path / "copy")).content_hash == h
    sd = {k: v.clone() for k, v in _peft_state(d).items()}
    k = sorted(sd)[0]
    sd[k][0, 0] += 1.0
    from safetensors.torch import save_file

    save_file(sd, os.path.join(d, "adapter_model.safetensors"))
    assert _load(d).content_hash != h
