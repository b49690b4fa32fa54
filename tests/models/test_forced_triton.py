"""The family parity with every kernel forced through its Triton version (the interpreter, on CPU), for one MoE
(Mixtral: fused_moe's grouped GEMMs) and one Gemma (Gemma 2: windows, soft-capping, GELU-tanh); a PEFT adapter
rides along in the mixed batch."""
from __future__ import annotations

import pytest

from harness.hf_models import PEFT_TARGETS, make_peft_adapter, peft_model, random_prompts
from loom.engine.llm import LLM
from tests.models.parity import block_bytes, check

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter-internal numpy warning


@pytest.mark.parametrize("family", ["mixtral", "gemma2"])
def test_parity_through_the_triton_kernels(tiny_model, tmp_path, monkeypatch, family):
    model, path = tiny_model(family)
    target = PEFT_TARGETS.get(family, dict(target_modules=["q_proj", "down_proj"]))
    ad = make_peft_adapter(path, str(tmp_path / "root" / "a"), seed=8, r=4, alpha=8, **target)
    oracles = {None: model, "a": peft_model(path, ad)}
    monkeypatch.setenv("LOOM_FORCE_TRITON", "1")
    # 3 blocks for prompts needing 1 + 2 + 2: preemption; 16 tokens a step: the window-crossing prompt is chunked
    llm = LLM(path, block_size=16, max_num_batched_tokens=16, kv_cache_memory_bytes=3 * block_bytes(model.config),
              enable_prefix_caching=False, adapter_roots=[str(tmp_path / "root")], max_lora_rank=8,
              lora_expert_memory_bytes=4 << 20)
    prompts = random_prompts([2, 15, 27], model.config.vocab_size, seed=31)
    names = ["a", None, None]  # the adapter request joins once its adapter is loaded
    check(llm, model, prompts[:1], 3)  # alone
    check(llm, model, prompts, 3, lora_names=names, oracle=lambda i: oracles[names[i]])
    assert llm.engine.scheduler.num_preemptions > 0
