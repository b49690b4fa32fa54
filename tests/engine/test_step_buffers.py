"""StepBuffers: device views are the persistent buffers' memory, with the shape asked, step after step."""
import numpy as np
import torch

from loom.engine.worker.step_buffers import StepBuffers


def test_device_views_follow_the_shape_asked_and_alias_the_buffer():
    buf = StepBuffers({"a": (torch.int64, 40), "t": (torch.int32, 24)}, torch.device("cpu"))
    for n, cols in [(5, None), (5, None), (7, None), (3, 4), (3, 4), (2, 4), (6, 4), (3, None)]:
        name = "a" if cols is None else "t"
        buf.begin()
        host = buf.host(name, n, cols)
        vals = np.arange(host.size, dtype=host.dtype).reshape(host.shape) + 10 * n
        host[...] = vals
        buf.commit()
        view = buf.device_view(name, n, cols)
        assert tuple(view.shape) == ((n,) if cols is None else (n, cols))
        assert torch.equal(view, torch.from_numpy(vals))
        view.add_(1)  # what a kernel writes lands in the buffer the next step reads
        assert np.array_equal(buf.host(name, n, cols), vals + 1)
