"""Per-head norms as one Triton pass over [T, heads, D] rows: the GDN output norm (`ops.norm.gated_rms_norm`), and
the attention's query / key norm with the partial rotation after it (`ops.rotary.norm_rope`).

inductor compiles the reference into one persistent reduction per 128-wide row; with the token count symbolic it ran
at about a third of the bandwidth at 8k tokens (238 us per layer for 300 MB moved). Here a program takes BLOCK_R rows
of D values: the sum of squares, the normalisation, the weight and the gate in registers, rounded where the eager
reference rounds (the normalised value and the weight product to the model dtype, the gate product in fp32). The
norm + rotation pass reads each row twice (the second time permuted: rotate_half's partners), from L1.
"""

import torch
import triton
import triton.language as tl

from .triton_gdn import _round_to
from .triton_pdl import launch_options, pdl_start


@triton.jit
def _head_rows(R, HEADS, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R rows of a [T, HEADS, D] tensor seen as R = T * HEADS rows: row ids, in range, token,
    head, and the dimension offsets."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, rows < R, rows // HEADS, rows % HEADS, tl.arange(0, D)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, out_ptr,
    R, HEADS, eps,
    stride_xt, stride_xh, stride_gt, stride_gh, stride_ot, stride_oh,
    D: tl.constexpr, BLOCK_R: tl.constexpr, SILU: tl.constexpr, ROUND_PRODUCT: tl.constexpr, BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    dtype = out_ptr.dtype.element_ty
    rows, ok, t, h, d = _head_rows(R, HEADS, D, BLOCK_R)
    x = tl.load(x_ptr + (t * stride_xt + h * stride_xh)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    normed = _round_to(x * rstd[:, None], dtype, BF16)
    y = tl.load(w_ptr + d).to(tl.float32)[None, :] * normed
    if ROUND_PRODUCT:  # weight and normed value share the model dtype: the eager product is rounded to it
        y = _round_to(y, dtype, BF16)
    g = tl.load(gate_ptr + (t * stride_gt + h * stride_gh)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    g = g.to(tl.float32)
    act = g * tl.sigmoid(g) if SILU else tl.sigmoid(g)
    tl.store(out_ptr + (t * stride_ot + h * stride_oh)[:, None] + d[None, :],
             _round_to(y * act, dtype, BF16).to(dtype), mask=ok[:, None])


def supported(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """[T, heads, D] (or [rows, D]) with contiguous rows of a power-of-two D, gate of the same shape."""
    D = x.shape[-1]
    return (x.dim() in (2, 3) and gate.shape == x.shape and x.stride(-1) == 1 and gate.stride(-1) == 1
            and D >= 16 and D & (D - 1) == 0 and D <= 1024)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str,
                   block_rows: int = 32, num_warps: int = 4) -> torch.Tensor:
    """Same contract as `ops.norm.gated_rms_norm` for `supported` inputs; returns a contiguous tensor."""
    shape = x.shape
    if x.dim() == 2:
        x, gate = x[:, None], gate[:, None]
    T, heads, D = x.shape
    out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    rows = T * heads
    if rows:
        low = x.dtype in (torch.bfloat16, torch.float16)
        _gated_rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
            x, gate, weight, out, rows, heads, eps,
            x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), out.stride(0), out.stride(1),
            D=D, BLOCK_R=block_rows, SILU=activation != "sigmoid",
            ROUND_PRODUCT=low and torch.promote_types(weight.dtype, x.dtype) == x.dtype,
            BF16=x.dtype == torch.bfloat16, num_warps=num_warps, **launch_options(x)
        )
    return out.reshape(shape)


@triton.jit(do_not_specialize=["R"])  # rows vary with the step's tokens: one compile for all
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    R, HEADS, eps,
    stride_xt, stride_xh, stride_ct, stride_st,
    D: tl.constexpr, ROT: tl.constexpr, BLOCK_R: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    dtype = out_ptr.dtype.element_ty
    rows, ok, t, h, d = _head_rows(R, HEADS, D, BLOCK_R)
    half: tl.constexpr = ROT // 2
    rot = d < ROT
    # rotate_half's partner of dimension d (NeoX pairs (i, i + ROT/2)); itself outside the rotated part
    partner = tl.where(d < half, d + half, tl.where(rot, d - half, d))
    base = (t * stride_xt + h * stride_xh)[:, None]
    x = tl.load(x_ptr + base + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    scale = 1.0 + tl.load(w_ptr + d).to(tl.float32)
    # the norm's output rounded to the model dtype, as `rms_norm` returns it; the partner's the same way
    normed = _round_to(x * rstd * scale[None, :], dtype, BF16)
    xp = tl.load(x_ptr + base + partner[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    scale_p = 1.0 + tl.load(w_ptr + partner).to(tl.float32)
    rotated = _round_to(xp * rstd * scale_p[None, :], dtype, BF16)
    rotated = tl.where((d < half)[None, :], -rotated, rotated)
    c = tl.load(cos_ptr + t[:, None] * stride_ct + d[None, :], mask=ok[:, None] & rot[None, :], other=0.0)
    s = tl.load(sin_ptr + t[:, None] * stride_st + d[None, :], mask=ok[:, None] & rot[None, :], other=0.0)
    y = tl.where(rot[None, :], normed * c.to(tl.float32) + rotated * s.to(tl.float32), normed)
    tl.store(out_ptr + rows[:, None] * D + d[None, :], _round_to(y, dtype, BF16).to(dtype), mask=ok[:, None])


def rope_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """[T, heads, D] with contiguous rows of a power-of-two D, cos and sin [T, R] with an even R <= D."""
    return (x.dim() == 3 and x.stride(-1) == 1 and cos.dim() == 2 and cos.shape[0] == x.shape[0]
            and cos.shape == sin.shape and cos.stride(-1) == sin.stride(-1) == 1 and cos.shape[1] % 2 == 0
            and 0 < cos.shape[1] <= x.shape[-1] and x.shape[-1] & (x.shape[-1] - 1) == 0 and 16 <= x.shape[-1] <= 1024)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  block_rows: int = 16, num_warps: int = 4) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight, eps), cos, sin) in one pass for `rope_supported` inputs: the norm's output is
    rounded to the model dtype as the separate op returns it, the rotation computed in fp32 and rounded once, as
    inductor's compiled `apply_rope` does. Returns a contiguous [T, heads, D]."""
    T, heads, D = x.shape
    out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    rows = T * heads
    if rows:
        _rms_norm_rope_kernel[(triton.cdiv(rows, block_rows),)](
            x, weight, cos, sin, out, rows, heads, eps,
            x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            D=D, ROT=cos.shape[1], BLOCK_R=block_rows, BF16=x.dtype == torch.bfloat16, num_warps=num_warps,
            **launch_options(x),
        )
    return out
