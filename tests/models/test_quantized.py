"""Quantized checkpoints loaded as saved (compressed-tensors, GPTQ, AWQ, HF fine-grained FP8), their weights kept
quantized (QuantLinear over the C++ weight-only GEMM, dequantising in registers): loom's greedy tokens and logprobs
equal transformers in float32 running the same checkpoint's dequantised weights under the original config. The oracle
dequantises without loom: compressed-tensors' own decompressors for its format, transformers' own FP8 block
dequantisation, and plain torch written from the format documentation for GPTQ / AWQ. Llama loads q/k/v and gate/up
into its fused projections (their slices concatenated quantized, or one GEMM a slice where their act-order differs);
Phi-3 stores them fused."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.hf_models import make_peft_adapter, peft_model, random_prompts
from harness.quant_checkpoints import (
    AWQ_ORDER,
    gptq_pack,
    make_ct_checkpoint,
    make_packed_checkpoint,
    pack_along,
)
from loom.engine.llm import LLM
from loom.engine.sampling_params import SamplingParams
from loom.errors import ConfigError
from loom.kernels import cpu_quant_bf16
from loom.kernels.cpu_quant import PackedQuantWeight
from loom.layers.quant_linear import QuantLinear
from loom.models.loader import ModelLoadError, load_hf_config
from loom.models.quant import pack_int32, unpack_int32
from loom.models.quant.awq import Awq
from loom.models.quant.gptq import Gptq
from loom.models.spec import ModelSpec
from tests.models.parity import check

pytest.importorskip("compressed_tensors")

CHANNEL_ASYM_W4 = {"weights": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False}}
# (id, family, how the checkpoint is made)
CASES = [
    ("ct-w4a16-g128", "llama", ("ct", "W4A16", None)),
    ("ct-w4a16-asym-g128", "phi3", ("ct", "W4A16_ASYM", None)),
    ("ct-w4a16-channel-asym", "llama", ("ct", CHANNEL_ASYM_W4, None)),
    ("ct-w8a16-g128", "qwen2", ("ct", "W8A16", None)),
    ("ct-int8-naive", "llama", ("ct", "W8A8", "naive-quantized")),
    ("ct-fp8-tensor-static", "phi3", ("ct", "FP8", None)),
    ("ct-fp8-channel-dynamic", "llama", ("ct", "FP8_DYNAMIC", None)),
    ("ct-fp8-block", "llama", ("ct", "FP8_BLOCK", None)),
    ("gptq-g128-sym", "llama", ("gptq", {})),
    ("gptq-desc-act-asym-g32", "phi3", ("gptq", dict(desc_act=True, group_size=32, sym=False))),
    ("gptq-8bit-channel", "llama", ("gptq", dict(bits=8, group_size=-1))),
    ("awq-g128", "llama", ("awq", {})),
    ("awq-g64", "phi3", ("awq", dict(group_size=64))),
    ("fp8-block128", "llama", ("fp8", {})),
    ("fp8-block128", "phi3", ("fp8", {})),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("quantized")


def _make(root, case_id, family, how):
    name = f"{case_id}-{family}"
    if how[0] == "ct":
        return make_ct_checkpoint(family, root, how[1], name, fmt=how[2])
    return make_packed_checkpoint(family, root, how[0], name, how[1])


# ---- the oracle's dequantisation, independent of loom ----

def _unquantized(state: dict, modules: set[str]) -> dict:
    """The tensors that are not a quantized module's weight components: unquantized modules, every bias."""
    return {n: t for n, t in state.items() if n.rsplit(".", 1)[0] not in modules or n.endswith(".bias")}


def _ct_dequantize(state: dict, qc: dict) -> dict:
    """Each quantized module decompressed by compressed-tensors' own compressor for its scheme's format."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    (group,) = qc["config_groups"].values()
    scheme = QuantizationScheme(**group)
    compressor = BaseCompressor.get_value_from_registry(group["format"] or qc["format"])
    modules = {n.rsplit(".", 1)[0] for n in state if n.endswith(".weight_scale")}
    out = _unquantized(state, modules)
    for m in modules:
        local = {n.rsplit(".", 1)[1]: t for n, t in state.items() if n.rsplit(".", 1)[0] == m}
        local.pop("input_scale", None)
        local.pop("input_zero_point", None)
        local.pop("bias", None)
        out[f"{m}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    return out


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> the 32 // bits unsigned values of each, consecutive along `dim` (value i at shift bits * i)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits).view(*([1] * (dim + 1)), per, *([1] * (words.dim() - dim - 1)))
    vals = (words.unsqueeze(dim + 1) >> shifts) & (2 ** bits - 1)
    return vals.flatten(dim, dim + 1)


def _gptq_dequantize(p: dict, bits: int) -> torch.Tensor:
    q = _unpack(p["qweight"], bits, 0)  # [in, out]
    zeros = _unpack(p["qzeros"], bits, 1) + 1  # [groups, out], v1 stores zero - 1
    g = p["g_idx"].long()
    return ((q - zeros[g]).float() * p["scales"].float()[g]).t()


def _awq_dequantize(p: dict, group_size: int) -> torch.Tensor:
    def columns(words):  # the value at shift 4 * i is column 8 * word + AWQ_ORDER[i]
        vals = _unpack(words, 4, 1).unflatten(1, (-1, 8))
        natural = torch.empty_like(vals)
        natural[..., list(AWQ_ORDER)] = vals
        return natural.flatten(1)

    q, zeros = columns(p["qweight"]), columns(p["qzeros"])  # [in, out], [groups, out]
    g = torch.arange(q.shape[0]) // group_size
    return ((q - zeros[g]).float() * p["scales"].float()[g]).t()


def _fp8_dequantize(p: dict, block) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(p["weight"], p["weight_scale_inv"], list(block), torch.float32)


def dequantized_state(path: str) -> dict:
    state = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    method = qc["quant_method"]
    if method == "compressed-tensors":
        return _ct_dequantize(state, qc)
    marker = "qweight" if method in ("gptq", "awq") else "weight_scale_inv"
    modules = {n.rsplit(".", 1)[0] for n in state if n.endswith("." + marker)}
    out = _unquantized(state, modules)
    for m in modules:
        parts = {n.rsplit(".", 1)[1]: t for n, t in state.items() if n.rsplit(".", 1)[0] == m}
        if method == "gptq":
            out[f"{m}.weight"] = _gptq_dequantize(parts, qc["bits"])
        elif method == "awq":
            out[f"{m}.weight"] = _awq_dequantize(parts, qc["group_size"])
        else:
            out[f"{m}.weight"] = _fp8_dequantize(parts, qc["weight_block_size"])
    return out


def oracle(float_model, path: str):
    """transformers in float32, the original (unquantized) config, the checkpoint's dequantised weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(float_model.config).float().eval()
    model.load_state_dict(dequantized_state(path), strict=True)
    return model


def _reference(theirs: dict, name: str) -> torch.Tensor:
    if name in theirs:
        return theirs[name]
    if ".qkv_proj." in name:
        return torch.cat([theirs[name.replace("qkv_proj", x)] for x in ("q_proj", "k_proj", "v_proj")])
    return torch.cat([theirs[name.replace("gate_up_proj", x)] for x in ("gate_proj", "up_proj")])


def _assert_same_weights(llm, hf) -> None:
    """loom's loaded weights are the oracle's dequantised ones, bit for bit (split q/k/v, gate/up fused here); every
    projection keeps its weight quantized (a QuantLinear re-laid out for the C++ weight-only GEMM), none dequantised
    at load."""
    theirs = hf.state_dict()
    model = llm.engine.runner.model
    for name, p in model.named_parameters():
        assert torch.equal(p.data, _reference(theirs, name)), name
    for i, layer in enumerate(model.model.layers):
        for mod_name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            mod = layer.get_submodule(mod_name)
            assert isinstance(mod, QuantLinear), f"layer {i} {mod_name} was dequantised at load"
            assert all(isinstance(w, PackedQuantWeight) for _, w in mod.parts), f"layer {i} {mod_name}"
            name = f"model.layers.{i}.{mod_name}.weight"
            assert torch.equal(mod.dequantized(), _reference(theirs, name)), name


@pytest.mark.parametrize("case_id,family,how", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_greedy_tokens_equal_transformers_on_dequantised_weights(root, case_id, family, how):
    float_model, path = _make(root, case_id, family, how)
    hf = oracle(float_model, path)
    # the quantization changed the weights (the oracle is not just the float model)
    assert not torch.equal(hf.model.layers[0].mlp.down_proj.weight, float_model.model.layers[0].mlp.down_proj.weight)
    llm = LLM(path, block_size=16, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=32)
    _assert_same_weights(llm, hf)
    check(llm, hf, random_prompts([3, 21, 40], hf.config.vocab_size, seed=5), 8)


def test_bfloat16_engine_runs_the_bfloat16_kernel(root, monkeypatch):
    """A bfloat16 engine re-lays its quantized projections out for the VDPBF16PS kernel (kernels/cpu_quant_bf16.py;
    here its plain C++ build where the CPU lacks avx512_bf16) holding the oracle's dequantised weights bit for bit,
    and decodes with it (its numerics: tests/kernels/test_cpu_quant_bf16.py)."""
    if not cpu_quant_bf16.runs_here():
        monkeypatch.setattr(cpu_quant_bf16, "runs_here", lambda: True)
        monkeypatch.setattr(cpu_quant_bf16, "PackedQuantBf16",
                            _Emulated)
    float_model, path = _make(root, *CASES[1])  # W4A16 asymmetric, groups of 128, Phi-3 (q|k|v stored fused)
    theirs = oracle(float_model, path).state_dict()
    llm = LLM(path, dtype="bfloat16", block_size=16, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    for i, layer in enumerate(model.model.layers):
        for mod_name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            mod = layer.get_submodule(mod_name)
            assert all(isinstance(w, _BF16_CLASS) for _, w in mod.parts), f"layer {i} {mod_name}"
            name = f"model.layers.{i}.{mod_name}.weight"
            assert torch.equal(mod.dequantized(), _reference(theirs, name)), name
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


_BF16_CLASS = cpu_quant_bf16.PackedQuantBf16


class _Emulated(_BF16_CLASS):
    def __init__(self, w):
        super().__init__(w, emulate=True)


def test_activation_scheme_is_recorded(root):
    for scheme, want in (("FP8", "static"), ("FP8_DYNAMIC", "dynamic"), ("W4A16", None)):
        _, path = make_ct_checkpoint("llama", root, scheme, f"act-{scheme}")
        assert ModelSpec.from_hf_config(load_hf_config(path)).quant.activations == want


# ---- the packed layouts: the packers, compressed-tensors and loom's readers agree on every int ----

def test_canonical_packing_is_compressed_tensors_pack_to_int32():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        signed = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (12, 64), generator=g, dtype=torch.int8)
        unsigned = signed.to(torch.int32) + 2 ** (bits - 1)
        assert torch.equal(pack_int32(unsigned, bits), pack_to_int32(signed, bits))
        assert torch.equal(unpack_int32(pack_to_int32(signed, bits), bits, 64), unsigned)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_round_trip(bits):
    g = torch.Generator().manual_seed(1)
    out, inp, size = 16, 64, 32
    q = torch.randint(0, 2 ** bits, (out, inp), generator=g)
    zeros = torch.randint(1, 2 ** bits, (inp // size, out), generator=g)
    g_idx = torch.randperm(inp, generator=g).to(torch.int32) % (inp // size)
    parts = {"qweight": pack_along(q.t(), bits, 0), "qzeros": pack_along(zeros - 1, bits, 1),
             "scales": torch.rand(inp // size, out).half(), "g_idx": g_idx}
    qw = Gptq(bits, size, True, False, 1).read("m", parts)
    assert torch.equal(unpack_int32(qw.weight, bits, inp), q.to(torch.int32))
    assert torch.equal(qw.zero, zeros.t().to(torch.int32)) and torch.equal(qw.g_idx, g_idx)
    assert torch.equal(qw.scale, parts["scales"].t())


def test_gptq_packer_round_trip_and_plain_groups_need_no_g_idx():
    w = torch.randn(16, 256)
    parts = gptq_pack(w, bits=4, group_size=128, sym=True)
    assert torch.equal(parts["qzeros"], torch.full_like(parts["qzeros"], 0x77777777))  # sym v1: 8 stored as 7
    qw = Gptq(4, 128, False, True, 1).read("m", parts)
    assert qw.g_idx is None and qw.group_size == 128
    assert torch.equal(unpack_int32(qw.weight, 4, 256), _unpack(parts["qweight"], 4, 0).t())


def test_awq_round_trip():
    g = torch.Generator().manual_seed(2)
    out, inp, size = 24, 64, 32
    q = torch.randint(0, 16, (out, inp), generator=g)
    zeros = torch.randint(0, 16, (inp // size, out), generator=g)
    parts = {"qweight": pack_along(q.t(), 4, 1, AWQ_ORDER), "qzeros": pack_along(zeros, 4, 1, AWQ_ORDER),
             "scales": torch.rand(inp // size, out).half()}
    # the interleave: word 0 of row 0 holds columns 0, 2, 4, 6, 1, 3, 5, 7 at shifts 0, 4, ..., 28
    assert int(parts["qweight"][0, 0]) & 0xF == int(q[0, 0]) and (int(parts["qweight"][0, 0]) >> 4) & 0xF == q[2, 0]
    qw = Awq(size).read("m", parts)
    assert torch.equal(unpack_int32(qw.weight, 4, inp), q.to(torch.int32))
    assert torch.equal(qw.zero, zeros.t().to(torch.int32))


# ---- refusals ----

REFUSED = [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method", "'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits", "3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format",
     "'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size", "0"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version", "'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point", "false"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size", "[128]"),
    ({"quant_method": "fp8", "expert_dtype": "fp4"}, "expert_dtype", "'fp4'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}},
     "config_groups.group_0.weights.num_bits", "float 4-bit"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 2, "type": "int"}}}},
     "config_groups.group_0.weights.num_bits", "2-bit"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel"},  # fp8 per tensor only
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}},
     "kv_cache_scheme", "'strategy': 'channel'} is not supported"),
]


@pytest.mark.parametrize("qc,field,value", REFUSED, ids=[f"{r[0]['quant_method']}-{r[1]}" for r in REFUSED])
def test_refused_naming_the_field_and_value(tiny_model, tmp_path, qc, field, value):
    _, path = tiny_model("llama")
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError) as e:
        load_hf_config(bad)
    assert e.value.field == f"config.json quantization_config.{field}"
    assert value in str(e.value)


def test_a_module_missing_a_component_is_named(root, tmp_path):
    _, path = make_packed_checkpoint("llama", root, "gptq", "gptq-missing")
    state = load_file(os.path.join(path, "model.safetensors"))
    del state["model.layers.1.self_attn.o_proj.scales"]
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    save_file(state, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.o_proj.*scales"):
        LLM(bad, kv_cache_memory_bytes=1 << 20)


# ---- LoRA on a quantized base ----

def test_peft_adapter_on_a_quantized_base(root):
    """The adapter is made (and its oracle run) on the dequantised base: PEFT on transformers, float32."""
    float_model, path = make_packed_checkpoint("llama", root, "gptq", "gptq-lora")
    base = oracle(float_model, path)
    base_dir = str(root / "gptq-lora-dequantised")
    base.save_pretrained(base_dir, safe_serialization=True)
    adapters = root / "gptq-lora-adapters"
    make_peft_adapter(base_dir, str(adapters / "a"), seed=3, r=4, alpha=8, target_modules="all-linear")
    with_adapter = peft_model(base_dir, str(adapters / "a"))
    llm = LLM(path, block_size=16, kv_cache_memory_bytes=4 << 20, adapter_roots=[str(adapters)], max_lora_rank=8)
    names = [None, "a", "a"]
    prompts = random_prompts([5, 30, 3], base.config.vocab_size, seed=21)
    oracles = {None: base, "a": with_adapter}
    outs = check(llm, base, prompts, 6, lora_names=names, oracle=lambda i: oracles[names[i]])
    assert outs[1].token_ids != check(llm, base, prompts[1:2], 6)[0].token_ids  # the adapter matters
