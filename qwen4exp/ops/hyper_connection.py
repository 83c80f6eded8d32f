"""Hyper-connection mixing and combining as pure functions (one fused kernel each on GPU via inductor)."""

import torch
import torch.nn.functional as F

from . import compiled_on_gpu
from .norm import rms_norm


@compiled_on_gpu
def hc_mix(streams, norm_weight, w_down, w_up, w_inject, eps: float, hc: int):
    """streams [T, hc*H] -> (block input [T, H], injection weights [T, hc] or None when w_inject is None).

    normed = per-stream RMSNorm(streams); gate = sigmoid(W_up silu(W_down normed / hc));
    input = mean over streams of gate * normed; inject = 2 sigmoid(W_inject normed / hc).
    """
    hidden = streams.shape[-1] // hc
    normed = rms_norm.eager(streams, norm_weight, eps, hidden)
    gate = torch.sigmoid(F.linear(F.silu(F.linear(normed, w_down) / hc), w_up))
    mixed = (gate * normed).unflatten(-1, (hc, hidden)).mean(dim=-2)
    if w_inject is None:
        return mixed, None
    return mixed, 2 * torch.sigmoid(F.linear(normed, w_inject) / hc)


@compiled_on_gpu
def hc_combine(streams, block_out, inject):
    """streams + block_out * inject_s on every stream s. streams [T, hc*H]; block_out [T, H]; inject [T, hc]."""
    return streams + (block_out[:, None, :] * inject[:, :, None]).flatten(1)
