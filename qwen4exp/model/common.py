"""Norm and rotary modules shared by the blocks."""

import torch
from torch import nn

from .. import ops
from ..ops.rotary import rope_cos_sin


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (weight stored as w, applied as 1 + w); `group_size` normalises each group alone."""

    def __init__(self, dim: int, eps: float, group_size: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.norm.rms_norm_op(x, self.weight, self.eps, self.group_size)


class GatedRMSNorm(nn.Module):
    """GDN output norm: w * norm(x) * act(gate)."""

    def __init__(self, dim: int, eps: float, activation: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.norm.gated_rms_norm_op(x, gate, self.weight, self.eps, self.activation)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, mrope_section: tuple[int, ...]):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu") / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = mrope_section

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, dtype, self.mrope_section)
