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
from .merged_linear import MergedLinear


class GatedResidual(nn.Module):
    def __init__(self, config: ModelConfig, use_combine: bool = True):
        super().__init__()
        self.hc_count = config.hc_count
        self.hidden_size = config.hidden_size
        width = self.hc_count * self.hidden_size
        self.rank = config.hc_lowrank
        self.inject = use_combine
        self.hc_norm = RMSNorm(width, config.rms_norm_eps, group_size=self.hidden_size)
        if use_combine:  # the down projection and the injection weights read the normed streams: one GEMM
            self.down_inject = MergedLinear(width, {"input_mix_weight_down": self.rank,
                                                    "block_inject_weight": self.hc_count})
        else:  # the final mixer: no injection
            self.input_mix_weight_down = nn.Linear(width, self.rank, bias=False)
        self.input_mix_weight_up = nn.Linear(self.rank, width, bias=False)

    def forward(self, streams: torch.Tensor, block_out: torch.Tensor | None = None,
                block_inject: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """streams: [T, hc*H]; block_out, block_inject: the previous block's output and injection weights, combined
        into the streams first when given (one pass over the streams on the GPU, with the norm).
        Returns (streams, block input [T, H], injection weights [T, hc] or None for the final mixer)."""
        # the down projection happens inside hc_mix, which takes the merged weight with its padding rows
        w_down_inject = self.down_inject.weight if self.inject else self.input_mix_weight_down.weight
        return ops.hyper_connection.hc_mix(
            streams, self.hc_norm.weight, w_down_inject, self.input_mix_weight_up.weight, self.hc_norm.eps,
            self.hc_count, self.rank, self.inject, block_out, block_inject,
        )


def combine(streams: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """streams + block_out * inject_s on every stream s. streams [T, hc*H]; block_out [T, H]; inject [T, hc]."""
    return ops.hyper_connection.hc_combine(streams, block_out, inject)
