"""Kernel launches per decode layer (scripts/launch_count.py): a tiny 2-layer Llama with every op forced onto its
Triton path (the interpreter, on CPU), one decode step of 4 sequences, without and with LoRA. Structural, not timed:
the fused q|k|v and gate|up projections are used as views (no copy kernel), rope and the KV store run inside the
decode attention kernel.

Per layer without LoRA, <= 8: 2 fused add+RMSNorm, 4 GEMMs, decode attention with rope and the KV store (one launch
even where it splits: the block table spans 1,024 tokens, so flash-decoding runs, and its last program per sequence
and kv head merges the partitions in the same launch), SiLU-and-mul. With LoRA each of the 4 linears adds one fused
shrink+expand (decode: a few tokens per adapter): <= 12. No copy kernels."""
import pytest
import torch
from launch_count import count_decode_step, make_model, per_layer_max

from loom.kernels.launch_counter import LaunchCounter

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning

LAYERS = 2  # every layer is checked alike: two show that the count is per layer, at half the interpreter time of four
MAX_PER_LAYER = {False: 8, True: 12}


def test_counter_sees_copies_and_gemms_not_views():
    w = torch.randn(10, 8)
    for inference in (False, True):  # inference mode shows composite ops (linear, contiguous) undecomposed
        with torch.inference_mode(inference):
            x = torch.randn(4, 8)
            with LaunchCounter() as c:
                q, k = torch.nn.functional.linear(x, w).split([6, 4], dim=-1)
                q.view(4, 2, 3)
                k.contiguous()  # a strided view: a copy
                x.contiguous().reshape(-1)  # already contiguous, a view: nothing
        assert [kind for _, kind, _ in c.records] == ["gemm", "copy"], c.records


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("launch_count")), LAYERS)


@pytest.mark.parametrize("lora", [False, True], ids=["no_lora", "lora"])
def test_launches_per_decode_layer(tiny_llama, lora):
    c = count_decode_step(*tiny_llama, lora=lora, seqs=4)
    m = per_layer_max(c, LAYERS)
    assert m["copy"] == 0 and c.count(kind="copy") == 0, c.names(kind="copy")
    assert m["gemm"] == 4, c.names(0)
    assert m["total"] <= MAX_PER_LAYER[lora], c.names(0)
    for i in range(LAYERS):
        triton = c.names(i, "triton")
        assert "_rotary_kernel" not in triton and "_store_kv_kernel" not in triton, triton  # inside the attention
        assert triton.count("_decode_kernel") == 1 and "_decode_reduce_kernel" not in triton, triton
        if lora:  # one launch per linear, no zeroed buffer
            assert triton.count("_shrink_expand_kernel") == 4 and "_shrink_kernel" not in triton, triton
        assert triton.count("_fused_add_rms_norm_kernel") == 2 and triton.count("_act_and_mul_kernel") == 1, triton
