"""The n-gram row gather with dequantisation in Triton (`ops.table_gather.gather_rows` on the GPU). The table's
pointer is taken as is: a device tensor, or a device view of page-locked host memory (unified virtual addressing),
read row by row over PCIe."""

import torch
import triton
import triton.language as tl

from ._triton_utils import launch_options, pdl_start, rounding


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
    """Same result as `ops.table_gather.gather_rows_ref`. `table` is a device tensor or a device view of registered
    host memory."""
    T, G = ids.shape
    D = table.shape[1]
    if out is None:
        out = torch.empty(T, G * D, dtype=dtype, device=ids.device)
    n = T * G
    if n:
        rows = 16
        _gather_kernel[(triton.cdiv(n, rows),)](
            table, ids.contiguous(), scale, out, n, D=D, BLOCK_D=triton.next_power_of_2(D), ROWS=rows,
            ROUND=rounding(dtype), **launch_options(out),
        )
    return out
