"""The CPU layer pass over a quantized checkpoint's linear layers (kernels/csrc/layer.cpp's quant_linear: the
weight-only GEMMs the Python QuantLinear calls, then its LoRA pass) gives the bits of the Python layer path: hidden
states and greedy tokens bitwise equal through single decodes, chunked mixed batches, a prefix-cache hit and LoRA
adapters (all projections, q/v only, mixed with base rows), for int8 per channel, int4 groups of 128 symmetric and
asymmetric, int4 per channel asymmetric, GPTQ act-order (desc_act) groups of 32 (a linear of several parts and a bias)
and FP8 blocks; float32 and bfloat16 activations, the bfloat16 ones on each kernel a bfloat16 engine may run:
VDPBF16PS (where the CPU has avx512_bf16), its emulated build, and the float32 kernel on widened rows (the latter two
run on any x86 host)."""
from __future__ import annotations

import pytest
import torch

from harness.hf_models import make_peft_adapter
from harness.quant_checkpoints import make_ct_checkpoint, make_packed_checkpoint
from loom.kernels import cpu_ext, cpu_linear, cpu_quant_bf16, policy
from loom.kernels.cpu_quant import PackedQuantWeight
from loom.models import layer_pass as lp_mod
from tests.engine.test_layer_pass import ATTN, MLP, _llm, _record

pytest.importorskip("compressed_tensors")

CHANNEL_ASYM_W4 = {"weights": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False}}
# (id, family, how the checkpoint is made): phi3 stores q|k|v and gate|up fused
CASES = [
    ("w8a16-channel", "llama", ("ct", "W8A16")),
    ("w4a16-g128", "qwen2", ("ct", "W4A16")),
    ("w4a16-asym-g128", "phi3", ("ct", "W4A16_ASYM")),
    ("w4a16-channel-asym", "llama", ("ct", CHANNEL_ASYM_W4)),
    # each of q, k, v its own act-order: q|k|v kept as three parts, with Qwen2's biases added after them
    ("gptq-desc-act-asym-g32", "qwen2", ("gptq", dict(desc_act=True, group_size=32, sym=False))),
    ("fp8-block128", "llama", ("fp8", {})),
]
BF16_KERNELS = ["native", "emulated", "float32-kernel"]  # native: the float32 kernel where there is no avx512_bf16
# bfloat16: every case on the emulated VDPBF16PS build (it runs on any host), the other two kernels on an int8 and an
# asymmetric int4 case (~10 s a case: the suite's time)
BF16_RUNS = [(c, "emulated") for c in CASES] + [(c, k) for c in CASES[:3:2] for k in ("native", "float32-kernel")]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def checkpoint(request, tmp_path_factory):
    case_id, family, how = request.param
    root = tmp_path_factory.mktemp(f"quantpass-{case_id}")
    if how[0] == "ct":
        float_model, path = make_ct_checkpoint(family, root, how[1], "ckpt")
    else:
        float_model, path = make_packed_checkpoint(family, root, how[0], "ckpt", how[1])
    float_model.save_pretrained(str(root / "float"), safe_serialization=True)  # what PEFT makes adapters on
    adapters = root / "adapters"
    every, some = ATTN + MLP, ["q_proj", "v_proj"]
    if family == "phi3":
        every, some = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj", "down_proj"]
    make_peft_adapter(str(root / "float"), str(adapters / "all"), seed=1, r=8, target_modules=every)
    make_peft_adapter(str(root / "float"), str(adapters / "qv"), seed=2, r=4, target_modules=some)
    return case_id, path, str(adapters)


def _quant_parts(llm) -> list:
    from loom.layers.quant_linear import QuantLinear

    return [w for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear) for _, w in m.parts]


def _compare(path: str, adapters: str, dtype: str, monkeypatch, kinds: tuple) -> None:
    calls = []
    run = lp_mod.decoder_layer
    monkeypatch.setattr(lp_mod, "decoder_layer", lambda *a: (calls.append(a[1].struct.groups), run(*a))[1])
    llm = _llm(path, adapters, 2, dtype)
    assert all(type(w) in kinds for w in _quant_parts(llm))
    toks_py, hidden_py = _record(llm, on=False)
    assert not calls
    toks, hidden = _record(_llm(path, adapters, 2, dtype), on=True)
    assert any(g == 0 for g in calls) and any(g > 0 for g in calls)  # steps without and with adapters in the pass
    assert toks == toks_py
    assert len(hidden) == len(hidden_py) > 20
    assert all(torch.equal(a, b) for a, b in zip(hidden, hidden_py))


def test_float32_quantized_layer_pass_gives_the_python_layers_bits(checkpoint, monkeypatch):
    if cpu_ext.load() is None:
        pytest.skip("the C++ CPU kernels did not build here")
    case_id, path, adapters = checkpoint
    _compare(path, adapters, "float32", monkeypatch, (PackedQuantWeight,))
    if case_id.startswith("gptq-desc-act"):
        from loom.layers.quant_linear import QuantLinear

        llm = _llm(path, adapters, 1)
        assert any(len(m.parts) > 1 and m.bias is not None for m in llm.engine.runner.model.modules()
                   if isinstance(m, QuantLinear))


class _Emulated(cpu_quant_bf16.PackedQuantBf16):
    def __init__(self, w):
        super().__init__(w, emulate=True)


@pytest.mark.parametrize("checkpoint,kernel", BF16_RUNS, indirect=["checkpoint"],
                         ids=[f"{c[0]}-{k}" for c, k in BF16_RUNS])
def test_bfloat16_quantized_layer_pass_gives_the_python_layers_bits(checkpoint, kernel, monkeypatch):
    """Over loom's bfloat16 GEMM (the policy's pick for the layer pass; its plain loop where the CPU lacks
    avx512_bf16, as tests/engine/test_layer_pass.py's loom_bf16_gemm fixture picks it)."""
    if cpu_ext.load() is None:
        pytest.skip("the C++ CPU kernels did not build here")
    case_id, path, adapters = checkpoint
    monkeypatch.setattr(cpu_linear, "loom_bf16_gemm", lambda lib=None: True)
    monkeypatch.setattr(policy, "_bf16_gemms", lambda: (True, False))
    assert policy.decide("cpu", torch.bfloat16).layer_pass
    native = cpu_quant_bf16.runs_here()
    if kernel == "emulated":
        monkeypatch.setattr(cpu_quant_bf16, "runs_here", lambda: True)
        monkeypatch.setattr(cpu_quant_bf16, "PackedQuantBf16", _Emulated)
    elif kernel == "float32-kernel":
        monkeypatch.setattr(cpu_quant_bf16, "runs_here", lambda: False)
    on_bf16 = kernel == "emulated" or kernel == "native" and native
    kinds = (PackedQuantWeight,)
    if on_bf16 and not case_id.startswith("fp8"):  # the bfloat16 kernel takes int8 / int4 only
        kinds = (_Emulated,) if kernel == "emulated" else (cpu_quant_bf16.PackedQuantBf16,)
    _compare(path, adapters, "bfloat16", monkeypatch, kinds)
