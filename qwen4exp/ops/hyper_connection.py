"""Hyper-connection mixing and combining as pure functions (one fused kernel each on GPU via inductor)."""

import torch
import torch.nn.functional as F

from . import compiled_on_gpu
from .norm import rms_norm


def hc_mix(streams, norm_weight, w_down_inject, w_up, eps: float, hc: int, rank: int, inject: bool):
    """Dispatch: on the GPU, two Triton launches for a single token (batch-1 decode), inductor's fusion otherwise."""
    from . import fast_path

    if fast_path(streams):
        from .triton_hc import hc_mix_decode, supported

        if supported(streams, hc):
            return hc_mix_decode(streams, norm_weight, w_down_inject, w_up, eps, hc, rank, inject)
    return hc_mix_ref(streams, norm_weight, w_down_inject, w_up, eps, hc, rank, inject)


@compiled_on_gpu
def hc_mix_ref(streams, norm_weight, w_down_inject, w_up, eps: float, hc: int, rank: int, inject: bool):
    """streams [T, hc*H] -> (block input [T, H], injection weights [T, hc] or None without `inject`).

    normed = per-stream RMSNorm(streams); gate = sigmoid(W_up silu(W_down normed / hc));
    input = mean over streams of gate * normed; inject = 2 sigmoid(W_inject normed / hc).
    w_down_inject holds W_down's `rank` rows, then W_inject's hc rows when the block injects (one GEMM for both),
    then possibly padding rows (ignored).
    """
    hidden = streams.shape[-1] // hc
    normed = rms_norm.eager(streams, norm_weight, eps, hidden)
    down_inject = F.linear(normed, w_down_inject)
    gate = torch.sigmoid(F.linear(F.silu(down_inject[:, :rank] / hc), w_up))
    mixed = (gate * normed).unflatten(-1, (hc, hidden)).mean(dim=-2)
    if not inject:
        return mixed, None
    return mixed, 2 * torch.sigmoid(down_inject[:, rank: rank + hc] / hc)


@compiled_on_gpu
def hc_combine(streams, block_out, inject):
    """streams + block_out * inject_s on every stream s. streams [T, hc*H]; block_out [T, H]; inject [T, hc]."""
    return streams + (block_out[:, None, :] * inject[:, :, None]).flatten(1)
