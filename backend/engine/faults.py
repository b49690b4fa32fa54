"""Which engine failures are for good: device faults after which the process cannot compute again."""
from __future__ import annotations

# Errors after which a CUDA context is unusable: every later kernel launch fails the same way ("sticky" errors).
_STICKY = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
           "illegal instruction", "CUDA error: an illegal", "cudaErrorIllegalAddress", "cudaErrorLaunchFailure",
           "CUBLAS_STATUS_EXECUTION_FAILED", "CUDA-capable device(s) is/are busy or unavailable",
           "uncorrectable ECC error", "GPU has fallen off the bus")


def is_sticky_device_error(e: BaseException) -> bool:
    """A device fault the process cannot recover from (the serving layer then reports the model not ready)."""
    text = str(e).lower()
    return type(e).__name__ == "AcceleratorError" or any(s.lower() in text for s in _STICKY)
