"""RMSNorm fused with the residual add (one kernel on CUDA)."""
from __future__ import annotations

import torch
from torch import nn

from loom.kernels import fused_add_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
