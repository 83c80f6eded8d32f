"""Partial NeoX rotary embedding (optionally interleaved M-RoPE for 3-row positions)."""

import torch

from ._dispatch import HAS_TRITON, compiled_on_gpu, fast_path
from .norm import rms_norm

if HAS_TRITON:
    from . import rotary_triton


@compiled_on_gpu(token_dim=-1)
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, mrope_section=None):
    """positions: [T] (text) or [3, T] (t, h, w rows); inv_freq: [R/2] fp32. Returns cos, sin: [T, R] in `dtype`.

    With 3-row positions, frequency slot j takes the h row when j % 3 == 1 (j < 3*section[1]) and the w row when
    j % 3 == 2 (j < 3*section[2]); all other slots take the t row. Equal rows reduce to plain 1-D RoPE.
    """
    if positions.dim() == 1:
        freqs = positions[:, None].float() * inv_freq.float()
    else:
        per_row = positions[..., None].float() * inv_freq.float()  # [3, T, R/2]
        freqs = per_row[0].clone()
        for row, offset in ((1, 1), (2, 2)):
            idx = slice(offset, mrope_section[row] * 3, 3)
            freqs[..., idx] = per_row[row, ..., idx]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """apply_rope(rms_norm(x, weight, eps), cos, sin): the per-head query / key norm, then the rotation. On the GPU
    one Triton pass at every size (rotary_triton.py)."""
    if HAS_TRITON and fast_path(x) and rotary_triton.rope_supported(x, cos, sin):
        return rotary_triton.rms_norm_rope(x, weight, eps, cos, sin)
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


@compiled_on_gpu
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (or [T, D]); cos/sin: [T, R] with R <= D. Rotates the first R dims, NeoX pairs (i, i+R/2)."""
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
