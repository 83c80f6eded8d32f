"""Row gather from an n-gram table with dequantisation: out[t] = concat_g(table[ids[t, g]] * scale).

The table may be bf16/fp16/fp32 (scale 1) or float8_e4m3fn with one fp32 scale for the whole table, and it may live
in GPU memory or in page-locked host memory. The Triton kernel reads either through the same pointer: with unified
virtual addressing a registered host page is addressable from a kernel, so a host table costs PCIe reads of just the
rows a step needs instead of a copy of the table.
"""

from __future__ import annotations

import torch

from ._dispatch import HAS_TRITON, fast_path

if HAS_TRITON:
    from . import table_gather_triton


def gather_rows_ref(table: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table [R, D]; ids [T, G] int64 row ids; scale: fp32 scalar tensor. Returns [T, G*D] in `dtype` on ids' device.

    Rows are widened to fp32, scaled and rounded once, so a bf16 table with scale 1 is returned unchanged.
    """
    rows = table[ids.to(table.device)].to(ids.device)
    return (rows.float() * scale.to(ids.device).float()).to(dtype).flatten(1)


def gather_rows(
    table: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dispatch on where the ids (and the step) live; the table may be on the GPU or registered host memory."""
    if HAS_TRITON and fast_path(ids):
        return table_gather_triton.gather_rows_triton(table, ids, scale, dtype, out)
    rows = gather_rows_ref(table, ids, scale, dtype)
    return rows if out is None else out.copy_(rows)
