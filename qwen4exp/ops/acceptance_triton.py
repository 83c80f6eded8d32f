"""`ops.acceptance.greedy_acceptance` as one Triton launch: a single program sets every request's count, then takes
the minimum of each request's row stops with atomics (a step verifies a few hundred rows at most)."""

import torch
import triton
import triton.language as tl

from ._triton_utils import launch_options, pdl_start


@triton.jit(do_not_specialize=["n", "num_tokens", "num_reqs"])
def _greedy_acceptance_kernel(tokens, rows_ptr, token_slots, input_ids, token_local, token_req, out,
                              n, num_tokens, num_reqs,
                              HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    for r0 in range(0, num_reqs, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        tl.store(out + r, tl.zeros([BLOCK], dtype=tl.int64) + num_tokens, mask=r < num_reqs)
    tl.debug_barrier()  # the counts are set before any thread lowers one
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        ok = i < n
        if HAS_ROWS:
            row = tl.load(rows_ptr + i, mask=ok, other=0).to(tl.int64)
        else:
            row = i.to(tl.int64)
        has_draft = tl.load(token_slots + row, mask=ok, other=-1) >= 0
        after_draft = tl.load(token_slots + tl.maximum(row - 1, 0), mask=ok & (row > 0), other=-1) >= 0
        nxt = tl.load(input_ids + tl.minimum(row + 1, num_tokens - 1), mask=ok, other=0)
        accept = has_draft & (tl.load(tokens + i, mask=ok, other=-1) == nxt)
        local = tl.load(token_local + row, mask=ok, other=0).to(tl.int64)
        stop = tl.where(accept, num_tokens, tl.where(has_draft | after_draft, local, 0)).to(tl.int64)
        req = tl.load(token_req + row, mask=ok, other=0).to(tl.int64)
        tl.atomic_min(out + req, stop, mask=ok)


def greedy_acceptance(tokens: torch.Tensor, state_token_slots: torch.Tensor, input_ids: torch.Tensor,
                      token_local: torch.Tensor, token_req: torch.Tensor, num_reqs: int,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """See `ops.acceptance.greedy_acceptance_ref`."""
    out = torch.empty(num_reqs, dtype=torch.long, device=tokens.device)
    n = tokens.shape[0] if rows is None else rows.shape[0]
    if num_reqs == 0:
        return out
    _greedy_acceptance_kernel[(1,)](
        tokens, rows if rows is not None else tokens, state_token_slots, input_ids, token_local, token_req, out,
        n, input_ids.shape[0], num_reqs,
        HAS_ROWS=rows is not None, BLOCK=256, num_warps=4, **launch_options(tokens)
    )
    return out
