"""The attention's per-head query / key norm with the partial rotation after it (`ops.rotary.norm_rope`) as one Triton
pass over [T, heads, D] rows. Compiled, the norm and the rotation are two kernels, and inductor's rotation ran at a
fifth of the bandwidth on prefill steps (245 us for the 8k-token query of one step, 100 MB in and out). Each row is
read twice (the second time permuted: rotate_half's partners), from L1.
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import head_rows, launch_options, pdl_start, round_to


@triton.jit(do_not_specialize=["R"])  # rows vary with the step's tokens: one compile for all
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    R, HEADS, eps,
    stride_xt, stride_xh, stride_ct, stride_st,
    D: tl.constexpr, ROT: tl.constexpr, BLOCK_R: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    dtype = out_ptr.dtype.element_ty
    rows, ok, t, h, d = head_rows(R, HEADS, D, BLOCK_R)
    half: tl.constexpr = ROT // 2
    rot = d < ROT
    # rotate_half's partner of dimension d (NeoX pairs (i, i + ROT/2)); itself outside the rotated part
    partner = tl.where(d < half, d + half, tl.where(rot, d - half, d))
    base = (t * stride_xt + h * stride_xh)[:, None]
    x = tl.load(x_ptr + base + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    scale = 1.0 + tl.load(w_ptr + d).to(tl.float32)
    # the norm's output rounded to the model dtype, as `rms_norm` returns it; the partner's the same way
    normed = round_to(x * rstd * scale[None, :], dtype, BF16)
    xp = tl.load(x_ptr + base + partner[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    scale_p = 1.0 + tl.load(w_ptr + partner).to(tl.float32)
    rotated = round_to(xp * rstd * scale_p[None, :], dtype, BF16)
    rotated = tl.where((d < half)[None, :], -rotated, rotated)
    c = tl.load(cos_ptr + t[:, None] * stride_ct + d[None, :], mask=ok[:, None] & rot[None, :], other=0.0)
    s = tl.load(sin_ptr + t[:, None] * stride_st + d[None, :], mask=ok[:, None] & rot[None, :], other=0.0)
    y = tl.where(rot[None, :], normed * c.to(tl.float32) + rotated * s.to(tl.float32), normed)
    tl.store(out_ptr + rows[:, None] * D + d[None, :], round_to(y, dtype, BF16).to(dtype), mask=ok[:, None])


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
