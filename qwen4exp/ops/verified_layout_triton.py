"""`ops.verified_layout.advance_verified` and `shift_draft_rows` as one Triton launch each: a program per request
reads its rows and its per-request fields, then writes the next layout's (each program touches only its own
request's entries)."""

import torch
import triton
import triton.language as tl

from ._triton_utils import launch_options, pdl_start


@triton.jit
def _advance_kernel(ids, positions, slot_mapping, context_lens, state_slots, token_slots, ngram, ngram_stride,
                    tables, table_stride, block_token_slots, block_slots, block_positions, accepted, emitted, drafts,
                    ahead, ahead_stride, n, PAGE: tl.constexpr, K: tl.constexpr, K1_POW2: tl.constexpr,
                    M: tl.constexpr, M_POW2: tl.constexpr, C: tl.constexpr, C_POW2: tl.constexpr,
                    BLOCKS: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    a = tl.load(accepted + r).to(tl.int64)
    grow = a + 1
    row0 = (K + 1) * r
    rows = tl.arange(0, K1_POW2)
    mine = rows < K + 1
    if M > 0:  # the n-gram context: the last M of (context, the step's ids) up to the kept rows
        j = tl.arange(0, M_POW2)
        src = grow + j
        old = tl.load(ngram + r * ngram_stride + src, mask=(j < M) & (src < M), other=0)
        step = tl.load(ids + row0 + src - M, mask=(j < M) & (src >= M), other=0)
        tl.debug_barrier()  # every thread has read the context and the step's ids before any writes them
        tl.store(ngram + r * ngram_stride + j, tl.where(src < M, old, step), mask=j < M)
    kept = row0 + a
    tl.store(ids + row0, tl.load(emitted + kept))
    if K > 1:  # the drafts made ahead
        drafted = (rows >= 1) & mine
        tl.store(ids + row0 + rows, tl.load(ahead + r * ahead_stride + rows - 1, mask=drafted, other=0), mask=drafted)
    else:
        tl.store(ids + row0 + 1, tl.load(drafts + kept))
    p = tl.load(positions + row0 + rows, mask=mine, other=0) + grow
    tl.store(positions + row0 + rows, p, mask=mine)
    context = tl.load(context_lens + r).to(tl.int64) + grow
    tl.store(context_lens + r, context.to(tl.int32))
    s = tl.load(tables + r * table_stride + p // PAGE, mask=mine, other=0).to(tl.int64) * PAGE + p % PAGE
    tl.store(slot_mapping + row0 + rows, s, mask=mine)
    # a < K: the state after row a (in its spare slot) becomes the request's own, the own one that spare
    if a < K:
        spare = tl.load(token_slots + row0 + a)
        own = tl.load(state_slots + r)
        tl.store(state_slots + r, spare)
        tl.store(token_slots + row0 + a, own)
    if C > 0:  # the QSA blocks the rows complete, entry i * n + r for the i-th
        first = (C - 1 - context % C) % C
        c = tl.arange(0, C_POW2)
        for i in tl.static_range(BLOCKS):
            local = first + i * C
            has = local < K + 1
            position = context + local  # row `local`'s position
            slot = tl.load(tables + r * table_stride + position // PAGE, mask=has, other=0).to(tl.int64) * PAGE \
                + position % PAGE
            start = tl.where(has, slot - (C - 1), 0)
            entry = i * n + r
            tl.store(block_token_slots + entry * C + c, tl.where(has, start + c, 0), mask=c < C)
            tl.store(block_slots + entry, start // C)
            tl.store(block_positions + entry, tl.where(has, position - (C - 1), 0))


def advance_verified(buf: dict[str, torch.Tensor], num_reqs: int, page_size: int, compress: int,
                     accepted: torch.Tensor, emitted: torch.Tensor, drafts: torch.Tensor,
                     ahead: torch.Tensor | None = None) -> None:
    """Same result as `ops.verified_layout.advance_verified_ref`."""
    ngram, tables = buf["ngram_context"], buf["block_tables"]
    m = ngram.shape[1]
    k = 1 if ahead is None else ahead.shape[1]
    for name in ("input_ids", "positions", "slot_mapping", "state_slots", "state_token_slots", "new_block_slots",
                 "new_block_positions"):
        assert buf[name].dtype == torch.int64 and buf[name].is_contiguous(), name
    assert buf["context_lens"].dtype == torch.int32 and tables.dtype == torch.int32
    assert ahead is None or (ahead.dtype == torch.int64 and ahead.stride(1) == 1)
    _advance_kernel[(num_reqs,)](
        buf["input_ids"], buf["positions"], buf["slot_mapping"], buf["context_lens"], buf["state_slots"],
        buf["state_token_slots"], ngram, max(ngram.stride(0), 1), tables, tables.stride(0),
        buf["new_block_token_slots"], buf["new_block_slots"], buf["new_block_positions"], accepted.contiguous(),
        emitted.contiguous(), drafts.contiguous(), accepted if ahead is None else ahead,
        1 if ahead is None else ahead.stride(0), num_reqs, PAGE=page_size, K=k,
        K1_POW2=triton.next_power_of_2(k + 1), M=m, M_POW2=triton.next_power_of_2(max(m, 1)), C=compress,
        C_POW2=triton.next_power_of_2(max(compress, 1)), BLOCKS=-(-(k + 1) // compress) if compress else 0,
        **launch_options(accepted))


@triton.jit
def _shift_kernel(positions, slot_mapping, context_lens, tables, table_stride, block_token_slots, block_slots,
                  block_positions, shift, PAGE: tl.constexpr, C: tl.constexpr, C_POW2: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_start(PDL)
    r = tl.program_id(0).to(tl.int64)
    s = tl.load(shift + r).to(tl.int64)
    p = tl.load(positions + r) + s
    tl.store(positions + r, p)
    tl.store(context_lens + r, (tl.load(context_lens + r).to(tl.int64) + s).to(tl.int32))
    slot = tl.load(tables + r * table_stride + p // PAGE).to(tl.int64) * PAGE + p % PAGE
    tl.store(slot_mapping + r, slot)
    if C > 0:  # entry r: the block the row completes, else the null entry
        has = (p + 1) % C == 0
        start = tl.where(has, slot - (C - 1), 0)
        c = tl.arange(0, C_POW2)
        tl.store(block_token_slots + r * C + c, tl.where(has, start + c, 0), mask=c < C)
        tl.store(block_slots + r, start // C)
        tl.store(block_positions + r, tl.where(has, p - (C - 1), 0))


def shift_draft_rows(buf: dict[str, torch.Tensor], num_reqs: int, page_size: int, compress: int,
                     shift: torch.Tensor) -> None:
    """Same result as `ops.verified_layout.shift_draft_rows_ref`."""
    tables = buf["block_tables"]
    for name in ("positions", "slot_mapping", "new_block_slots", "new_block_positions"):
        assert buf[name].dtype == torch.int64 and buf[name].is_contiguous(), name
    assert buf["context_lens"].dtype == torch.int32 and tables.dtype == torch.int32
    _shift_kernel[(num_reqs,)](
        buf["positions"], buf["slot_mapping"], buf["context_lens"], tables, tables.stride(0),
        buf["new_block_token_slots"], buf["new_block_slots"], buf["new_block_positions"], shift.contiguous(),
        PAGE=page_size, C=compress, C_POW2=triton.next_power_of_2(max(compress, 1)), **launch_options(shift))
