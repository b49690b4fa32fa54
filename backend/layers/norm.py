"""RMSNorm fused with the residual add (one kernel on CUDA).

offset=True is Gemma's variant: the checkpoint stores w and the scale is (1 + w), computed in float32 as
transformers does (weights start at zero).
"""
from __future__ import annotations

import torch
from torch import nn

from loom.kernels import fused_add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def scale(self) -> torch.Tensor:
        """What the kernel multiplies the normalised rows by: w, or Gemma's 1 + w in float32."""
        return self.weight.float() + 1.0 if self.offset else self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rmsnorm(x + residual), x + residual); without a residual the second is x itself."""
        return fused_add_rms_norm(x, residual, self.scale(), self.eps)
