"""4-stream gated hyper-connections (`GatedResidual`).

The residual stream is hc_count copies of the hidden state, [T, hc*H]. Before a block, `mix` normalises each
stream, weighs it with a low-rank sigmoid gate and averages the streams into the block input [T, H]; it also
returns the per-stream injection weights 2*sigmoid(.) [T, hc]. `combine` adds the block output to every stream
with its weight. There is no final RMSNorm: a last `GatedResidual` without injection mixes the streams for lm_head.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .common import RMSNorm


class GatedResidual(nn.Module):
    def __init__(self, config: ModelConfig, use_combine: bool = True):
        super().__init__()
        self.hc_count = config.hc_count
        self.hidden_size = config.hidden_size
        width = self.hc_count * self.hidden_size
        self.hc_norm = RMSNorm(width, config.rms_norm_eps, group_size=self.hidden_size)
        self.input_mix_weight_down = nn.Linear(width, config.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(config.hc_lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, self.hc_count, bias=False) if use_combine else None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams: [T, hc*H] -> (block input [T, H], injection weights [T, hc] or None for the final mixer)."""
        normed = self.hc_norm(streams)
        gate = F.silu(self.input_mix_weight_down(normed) / self.hc_count)
        gate = torch.sigmoid(self.input_mix_weight_up(gate))
        mixed = (gate * normed).unflatten(-1, (self.hc_count, self.hidden_size)).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc_count)


def combine(streams: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """streams + block_out * inject_s on every stream s. streams [T, hc*H]; block_out [T, H]; inject [T, hc]."""
    return streams + (block_out[:, None, :] * inject[:, :, None]).flatten(1)
