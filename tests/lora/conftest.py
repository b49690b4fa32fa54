import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread_torch():
    """Tiny models: intra-op threads only add contention (50x slower on a loaded 2-core box)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
