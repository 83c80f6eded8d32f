"""Hyper-connection mixing and combining as pure functions (compiled by inductor on the GPU, with Triton passes for
the one-token mix and the norm; hyper_connection_triton.py)."""

import torch
import torch.nn.functional as F

from . import tuning
from ._dispatch import HAS_TRITON, compiled_on_gpu, fast_path
from .linear import partial_products
from .norm import rms_norm

if HAS_TRITON:
    from . import hyper_connection_triton as hc_triton


def decode_max_tokens(width: int) -> int:
    """Tokens up to which a mix of `width` stream columns runs as the two decode launches on the GPU (ops/tuning.py)."""
    if width <= tuning.HC_DECODE_SMALL_WIDTH:
        return max(tuning.HC_DECODE_MAX_TOKENS, tuning.HC_DECODE_SMALL_MAX_TOKENS)
    return tuning.HC_DECODE_MAX_TOKENS


def hc_mix(streams, norm_weight, w_down_inject, w_up, eps: float, hc: int, rank: int, inject: bool,
           block_out=None, block_inject=None):
    """The pending combine of the previous block's output (when block_out is given), then the mix:
    returns (streams, block input [T, H], injection weights [T, hc] or None without `inject`).

    GPU dispatch: up to `decode_max_tokens` tokens two Triton launches, the combine in the first (batch-1
    decode); more tokens one Triton pass for the combine and the norm (`hc_prenorm`) and inductor's fusion of the
    rest, with the down projection as tuning.DOWN_SPLITS fp32 partial products up to tuning.PARTIALS_MAX_TOKENS
    tokens.

    block_out is [T, H], or fp32 partial products of it [T, P, H] (`ops.linear.output_linear`), summed and rounded
    to the streams' dtype as the projection's output would be."""
    if HAS_TRITON and fast_path(streams):
        if (streams.shape[0] <= decode_max_tokens(streams.shape[1]) and hc_triton.supported(streams, hc)
                and (block_out is None or block_out.dim() == 2)):
            return hc_triton.hc_mix_decode(streams, norm_weight, w_down_inject, w_up, eps, hc, rank, inject,
                                           block_out, block_inject)
        if hc_triton.prenorm_supported(streams, hc):
            streams, normed = hc_triton.hc_prenorm(streams, norm_weight, eps, hc, block_out, block_inject)
            splits = tuning.DOWN_SPLITS
            if streams.shape[0] <= tuning.PARTIALS_MAX_TOKENS and normed.shape[1] % splits == 0:
                partials = partial_products(normed, w_down_inject, splits)
                return (streams, *hc_mix_partials(normed, partials, w_up, hc, rank, inject))
            return (streams, *hc_mix_normed(normed, w_down_inject, w_up, hc, rank, inject))
    if block_out is not None:
        if block_out.dim() == 3:
            block_out = block_out.sum(1).to(streams.dtype)
        streams = hc_combine(streams, block_out, block_inject)
    return (streams, *hc_mix_ref(streams, norm_weight, w_down_inject, w_up, eps, hc, rank, inject))


@compiled_on_gpu
def hc_mix_ref(streams, norm_weight, w_down_inject, w_up, eps: float, hc: int, rank: int, inject: bool):
    """streams [T, hc*H] -> (block input [T, H], injection weights [T, hc] or None without `inject`).

    normed = per-stream RMSNorm(streams); gate = sigmoid(W_up silu(W_down normed / hc));
    input = mean over streams of gate * normed; inject = 2 sigmoid(W_inject normed / hc).
    w_down_inject holds W_down's `rank` rows, then W_inject's hc rows when the block injects (one GEMM for both),
    then possibly padding rows (ignored).
    """
    normed = rms_norm.eager(streams, norm_weight, eps, streams.shape[-1] // hc)
    return hc_mix_normed.eager(normed, w_down_inject, w_up, hc, rank, inject)


@compiled_on_gpu
def hc_mix_normed(normed, w_down_inject, w_up, hc: int, rank: int, inject: bool):
    """`hc_mix_ref` after the norm: normed [T, hc*H] (the per-stream RMSNorm of the streams, in their dtype)."""
    return _mix_scaled(normed, F.linear(normed, w_down_inject) / hc, w_up, hc, rank, inject)


@compiled_on_gpu
def hc_mix_partials(normed, partials, w_up, hc: int, rank: int, inject: bool):
    """`hc_mix_normed` with the down projection given as fp32 partial products [T, S, N]
    (`ops.linear.partial_products`): their sum is rounded to the model dtype, as the GEMM's output is."""
    # summed as a chain of adds: inductor's reduction over the strided middle dim took ~10 us at 64 tokens
    down = partials[:, 0]
    for i in range(1, partials.shape[1]):
        down = down + partials[:, i]
    return _mix_scaled(normed, down.to(normed.dtype) / hc, w_up, hc, rank, inject)


def _mix_scaled(normed, scaled, w_up, hc: int, rank: int, inject: bool):
    """The mix from the down projection's output over hc: scaled [T, N] (N >= rank + hc when injecting)."""
    hidden = normed.shape[-1] // hc
    # silu for the rank columns, 2 sigmoid for the inject columns: one elementwise pass (inductor made two kernels of
    # the two slices, each a launch per mix at decode); the extra columns' values are computed and not read
    columns = torch.arange(scaled.shape[-1], device=scaled.device)
    activated = torch.where(columns < rank, F.silu(scaled), 2 * torch.sigmoid(scaled))
    gate = torch.sigmoid(F.linear(activated[:, :rank], w_up))
    mixed = (gate * normed).unflatten(-1, (hc, hidden)).mean(dim=-2)
    if not inject:
        return mixed, None
    return mixed, activated[:, rank: rank + hc]


@compiled_on_gpu
def hc_combine(streams, block_out, inject):
    """streams + block_out * inject_s on every stream s. streams [T, hc*H]; block_out [T, H]; inject [T, hc]."""
    return streams + (block_out[:, None, :] * inject[:, :, None]).flatten(1)
