"""The LoRA tests run tiny models: one intra-op thread (tests/conftest.py: single_thread_torch); the tiny Llama and
the mixed PEFT adapter set (harness.lora.ADAPTERS) that test_lora_engine and test_lora_parity both use, built once."""
import pytest

from harness.lora import ADAPTERS, make_peft_adapter, make_tiny_llama


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread_torch):
    """tests/conftest.py: single_thread_torch."""


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> str:
    """A 2-layer random Llama (harness.lora.tiny_llama_config), seed 0; read-only."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("base")), seed=0)


@pytest.fixture(scope="session")
def adapter_set(tmp_path_factory, tiny_base):
    """A folder with the ADAPTERS (ranks 1-16, different targets and options) for `tiny_base`; read-only."""
    root = tmp_path_factory.mktemp("adapters")
    for i, (name, r, alpha, tm, kw) in enumerate(ADAPTERS):
        make_peft_adapter(tiny_base, str(root / name), seed=100 + i, r=r, alpha=alpha, target_modules=tm, scale=2.0,
                          **kw)
    return root
