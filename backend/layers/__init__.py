"""Model building blocks that call into `kernels` (Triton on CUDA, PyTorch references on CPU)."""
