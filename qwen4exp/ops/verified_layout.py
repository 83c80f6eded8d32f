"""Layouts finished on the device, where only the device knows how many drafts a verified step kept
(engine/spec_decode.py): the next verified step, launched before the step before it has been read
(`advance_verified`, SpecDecoder.chain), and the draft layer's further draft steps, launched behind a verification
before it is read (`shift_draft_rows`, MTPProposer.draft_ahead). The host builds every other layout
(engine/step_builder.py)."""

import torch

from ._dispatch import HAS_TRITON, fast_path

if HAS_TRITON:
    from . import verified_layout_triton


def advance_verified(buf: dict[str, torch.Tensor], num_reqs: int, page_size: int, compress: int,
                     accepted: torch.Tensor, emitted: torch.Tensor, drafts: torch.Tensor,
                     ahead: torch.Tensor | None = None) -> None:
    """`advance_verified_ref`; on the fast path one Triton launch (a program per request) instead of its forty-odd
    small kernels."""
    if HAS_TRITON and fast_path(accepted) and num_reqs:
        verified_layout_triton.advance_verified(buf, num_reqs, page_size, compress, accepted, emitted, drafts, ahead)
    else:
        advance_verified_ref(buf, num_reqs, page_size, compress, accepted, emitted, drafts, ahead)


def advance_verified_ref(buf: dict[str, torch.Tensor], num_reqs: int, page_size: int, compress: int,
                         accepted: torch.Tensor, emitted: torch.Tensor, drafts: torch.Tensor,
                         ahead: torch.Tensor | None = None) -> None:
    """The device layout of a step of `num_reqs` verified requests with k drafts each (rows r(1 + k) .. r(1 + k) + k:
    the last sampled token, the drafts; the speculative graphs' mixed buffers `buf` as CUDAGraphRunner.prepare_mixed
    fills them) turned, in place and on the device, into the layout of the same requests' next step, as
    `StepBuilder.build` would give it once the host has read this step: it is how a step is launched before the
    previous one is read (SpecDecoder.chain). From this step's results: `accepted` [R] drafts kept per request
    (greedy_acceptance), `emitted` [(1 + k)R] every row's argmax, and the next step's drafts: for k = 1 `drafts`
    [(1 + k)R] the draft layer's draft at every row, for k >= 2 `ahead` [R, k] each request's (MTPProposer.draft_ahead:
    the draft at its kept row, then the further ones; `drafts` is not read, the further draft steps may have
    overwritten it).

    Request r keeps 1 + a rows: its context grows by 1 + a, its next rows are the token emitted at row a and its
    drafts from there; its state moves to the slot of row a (the spare one it was stored into; the one after the last
    row when a = k), the slot it leaves becoming that spare; its n-gram context ends with its kept tokens; its cache
    slots and the QSA blocks its rows complete follow from the new positions and its block tables (which must
    already hold the pages of the next step's positions); `compress`: the QSA block size C (0: no QSA). Only rows of
    the step's requests change: the padding request's and the empty rows' stay as they are."""
    n = num_reqs
    k = 1 if ahead is None else ahead.shape[1]
    k1 = 1 + k
    rows = n * k1
    a = accepted[:n]
    grow = a + 1
    ids = buf["input_ids"][:rows].view(n, k1)
    context = buf["ngram_context"]
    if context.shape[1]:  # the last ngram_size - 1 committed tokens before the next step's first token
        m = context.shape[1]
        tokens = torch.cat([context[:n], ids], 1)
        context[:n] = tokens.gather(1, grow[:, None] + torch.arange(m, device=a.device))
    kept = torch.arange(n, device=a.device) * k1 + a  # each request's last kept row
    ids[:, 0] = emitted[kept]
    if k > 1:
        ids[:, 1:] = ahead[:n]
    else:
        ids[:, 1] = drafts[kept]
    positions = buf["positions"][:rows].view(n, k1)
    positions += grow[:, None]
    buf["context_lens"][:n] += grow.to(buf["context_lens"].dtype)
    pos = positions.reshape(-1)
    req = torch.arange(n, device=a.device).repeat_interleave(k1)
    slots = buf["block_tables"][req, pos // page_size].long() * page_size + pos % page_size
    buf["slot_mapping"][:rows] = slots
    # state slots: spares at rows 0 .. k-1, the own one; the kept row's becomes the own, the own one its spare
    spares = buf["state_token_slots"][:rows].view(n, k1)
    own = buf["state_slots"][:n]
    moved = a < k
    col = a.clamp(max=k - 1)[:, None]
    spare = spares.gather(1, col)[:, 0]
    spares.scatter_(1, col, torch.where(moved, own, spare)[:, None])
    own.copy_(torch.where(moved, spare, own))
    if compress:  # the QSA blocks each request's rows complete, ceil((1 + k) / C) at most, at entries i n + r
        c = buf["context_lens"][:n].long()
        first = (compress - 1 - c % compress) % compress  # the first row whose position + 1 is a multiple of C
        for i in range(-(-k1 // compress)):
            local = first + i * compress
            has = local < k1
            row = torch.arange(n, device=a.device) * k1 + local.clamp(max=k1 - 1)
            start = torch.where(has, slots[row] - (compress - 1), 0)
            entries = slice(i * n, (i + 1) * n)
            buf["new_block_token_slots"][entries] = torch.where(
                has[:, None], start[:, None] + torch.arange(compress, device=a.device), 0)
            buf["new_block_slots"][entries] = start // compress
            buf["new_block_positions"][entries] = torch.where(has, pos[row] - (compress - 1), 0)


def shift_draft_rows(buf: dict[str, torch.Tensor], num_reqs: int, page_size: int, compress: int,
                     shift: torch.Tensor) -> None:
    """`shift_draft_rows_ref`; on the fast path one Triton launch instead of its dozen small kernels."""
    if HAS_TRITON and fast_path(shift) and num_reqs:
        verified_layout_triton.shift_draft_rows(buf, num_reqs, page_size, compress, shift)
    else:
        shift_draft_rows_ref(buf, num_reqs, page_size, compress, shift)


def shift_draft_rows_ref(buf: dict[str, torch.Tensor], num_reqs: int, page_size: int, compress: int,
                         shift: torch.Tensor) -> None:
    """A step of one row per request (row r: request r, block table row r), as CUDAGraphRunner.prepare_mixed laid it
    out at positions p_r, moved in place and on the device to positions p_r + shift[r]: the layout StepBuilder.build
    would give the rows at those positions. Changes each row's position, context length (position + 1) and cache
    slot, and its QSA block: entry r of the block entries is the block the row completes where its position + 1 is
    a multiple of `compress` (the QSA block size C; 0: no QSA), else the null entry. Rows past num_reqs, and the
    entries past them, are left as they are (the host's layout has at most one block entry per row, at entries
    below num_reqs)."""
    n = num_reqs
    step = shift[:n].to(torch.long)
    pos = buf["positions"][:n]
    pos += step
    buf["context_lens"][:n] += step.to(buf["context_lens"].dtype)
    rows = torch.arange(n, device=pos.device)
    slots = buf["block_tables"][rows, pos // page_size].long() * page_size + pos % page_size
    buf["slot_mapping"][:n] = slots
    if compress:
        has = (pos + 1) % compress == 0
        start = torch.where(has, slots - (compress - 1), 0)
        buf["new_block_token_slots"][:n] = torch.where(
            has[:, None], start[:, None] + torch.arange(compress, device=pos.device), 0)
        buf["new_block_slots"][:n] = start // compress
        buf["new_block_positions"][:n] = torch.where(has, pos - (compress - 1), 0)
