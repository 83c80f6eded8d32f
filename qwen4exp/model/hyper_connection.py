"""4-stream gated hyper-connections (`GatedResidual`).

The residual stream is hc_count copies of the hidden state, [T, hc*H]. Before a block, `mix` normalises each
stream, weighs it with a low-rank sigmoid gate and averages the streams into the block input [T, H]; it also
returns the per-stream injection weights 2*sigmoid(.) [T, hc]. `combine` adds the block output to every stream
with its weight; the model defers each combine into the next mix, which does both in one pass over the streams.
There is no final RMSNorm: a last `GatedResidual` without injection mixes the streams for lm_head.
"""

import torch
from torch import nn

from .. import ops
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

    def forward(self, streams: torch.Tensor, block_out: torch.Tensor | None = None,
                block_inject: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """streams: [T, hc*H]; block_out, block_inject: the previous block's output and injection weights, combined
        into the streams first when given (one pass over the streams on the GPU, with the norm).
        Returns (streams, block input [T, H], injection weights [T, hc] or None for the final mixer)."""
        weights = [self.input_mix_weight_down.weight]
        if self.block_inject_weight is not None:
            weights.append(self.block_inject_weight.weight)
        return ops.hyper_connection.hc_mix(
            streams, self.hc_norm.weight, ops.linear.merged_weight(weights, padded=True),
            self.input_mix_weight_up.weight, self.hc_norm.eps, self.hc_count,
            self.input_mix_weight_down.weight.shape[0], self.block_inject_weight is not None, block_out, block_inject,
        )


def combine(streams: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """streams + block_out * inject_s on every stream s. streams [T, hc*H]; block_out [T, H]; inject [T, hc]."""
    return ops.hyper_connection.hc_combine(streams, block_out, inject)
