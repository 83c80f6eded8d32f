"""Row gather from an n-gram table with dequantisation: out[t] = concat_g(table[ids[t, g]] * scale).

The table may be bf16/fp16/fp32 (scale 1) or float8_e4m3fn with one fp32 scale for the whole table, and it may live
in GPU memory or in page-locked host memory. The Triton kernel reads either through the same pointer: with unified
virtual addressing a registered host page is addressable from a kernel, so a host table costs PCIe reads of just the
rows a step needs instead of a copy of the table.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton use the reference
    triton = None


def gather_rows_ref(table: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table [R, D]; ids [T, G] int64 row ids; scale: fp32 scalar tensor. Returns [T, G*D] in `dtype` on ids' device.

    Rows are widened to fp32, scaled and rounded once, so a bf16 table with scale 1 is returned unchanged.
    """
    rows = table[ids.to(table.device)].to(ids.device)
    return (rows.float() * scale.to(ids.device).float()).to(dtype).flatten(1)


if triton is not None:
    from .triton_pdl import launch_options, pdl_start

    @triton.jit(do_not_specialize=["n_ids"])
    def _gather_kernel(table, ids, scale, out, n_ids, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                      ROUND: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        valid = r < n_ids
        row = tl.load(ids + r, mask=valid, other=0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (d[None, :] < D)
        vals = tl.load(table + row[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        vals = vals * tl.load(scale)
        tl.store(out + r.to(tl.int64)[:, None] * D + d[None, :],
                 vals.to(out.dtype.element_ty, fp_downcast_rounding=ROUND), mask=mask)


def gather_rows_triton(
    table: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same result as `gather_rows_ref`. `table` is a device tensor or a device view of registered host memory."""
    T, G = ids.shape
    D = table.shape[1]
    if out is None:
        out = torch.empty(T, G * D, dtype=dtype, device=ids.device)
    n = T * G
    if n:
        rows = 16
        _gather_kernel[(triton.cdiv(n, rows),)](
            table, ids.contiguous(), scale, out, n, D=D, BLOCK_D=triton.next_power_of_2(D), ROWS=rows,
            ROUND="rtne" if dtype != torch.float32 else None,  # explicit: the interpreter truncates by default
            **launch_options(out),
        )
    return out


def gather_rows(
    table: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Dispatch on where the ids (and the step) live; the table may be on the GPU or registered host memory."""
    from . import fast_path

    if triton is not None and fast_path(ids):
        return gather_rows_triton(table, ids, scale, dtype, out)
    rows = gather_rows_ref(table, ids, scale, dtype)
    return rows if out is None else out.copy_(rows)
