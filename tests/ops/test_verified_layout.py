"""Layouts finished on the device (a verified step's advanced to the next, a draft step's rows moved to the kept
positions): the Triton kernels (GPU, or the interpreter on CPU) against the torch references, on buffers shaped as
the speculative graphs' (requests beyond the step, padding and stale entries included, which neither may touch),
for every QSA block size, n-gram width and number of drafts."""

import pytest
import torch

from qwen4exp.ops.verified_layout import advance_verified_ref, shift_draft_rows_ref

triton = pytest.importorskip("triton")

from qwen4exp.ops.verified_layout_triton import advance_verified, shift_draft_rows  # noqa: E402


def buffers(g, n: int, R: int, m: int, C: int, page: int, device, k: int = 1) -> dict[str, torch.Tensor]:
    """Mixed-step buffers for n verified requests with k drafts (rows r(1 + k) .. r(1 + k) + k) among R request rows,
    (1 + k)R token rows; contexts and pages such that every row's page is in its table."""
    k1 = 1 + k
    T, width = k1 * R, 8
    context = torch.randint(1, width * page - 12, (R,), generator=g)
    local = torch.arange(T) % k1
    positions = context.repeat_interleave(k1) + local
    slots = torch.randperm(400, generator=g)[: T + R] + 1
    token_slots = torch.where(local < k, slots[R: R + T], -1)
    nb = max(C, 1)
    return {name: t.to(device) for name, t in dict(
        input_ids=torch.randint(3, 500, (T,), generator=g),
        positions=positions,
        slot_mapping=torch.randint(0, 999, (T,), generator=g),
        context_lens=context.to(torch.int32),
        state_slots=slots[:R].clone(),
        state_token_slots=token_slots,
        ngram_context=torch.randint(3, 500, (R, m), generator=g),
        block_tables=torch.randint(1, 64, (R, width), generator=g, dtype=torch.int32),
        new_block_token_slots=torch.randint(0, 999, (T, nb), generator=g),
        new_block_slots=torch.randint(0, 999, (T,), generator=g),
        new_block_positions=torch.randint(0, 999, (T,), generator=g),
    ).items()}


@pytest.mark.parametrize("C,m,k", [(4, 2, 1), (1, 2, 1), (8, 3, 1), (0, 0, 1), (4, 2, 2), (1, 3, 3), (2, 5, 3),
                                   (8, 0, 4)])
def test_advance_matches_reference(C, m, k):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(C * 10 + m + 100 * k)
    for n, R in ((1, 1), (3, 5), (6, 6)):
        for trial in range(3):
            buf = buffers(g, n, R, m, C, 16, device, k)
            accepted = torch.randint(0, k + 1, (n,), generator=g).to(device)
            emitted = torch.randint(3, 500, ((1 + k) * n,), generator=g).to(device)
            drafts = torch.randint(3, 500, ((1 + k) * n,), generator=g).to(device)
            # draft_ahead's output: column 0 the draft at the kept row
            ahead = torch.randint(3, 500, (R, k), generator=g).to(device) if k > 1 else None
            want = {name: t.clone() for name, t in buf.items()}
            advance_verified_ref(want, n, 16, C, accepted, emitted, drafts, ahead)
            advance_verified(buf, n, 16, C, accepted, emitted, drafts, ahead)
            for name in buf:
                assert torch.equal(buf[name], want[name]), (C, m, n, R, trial, name)


@pytest.mark.parametrize("C", [4, 1, 8, 0])
def test_shift_matches_reference(C):
    """Rows of one token per request (the first n of 2R rows, the rest padding or stale), moved by 0 .. 3."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(C + 100)
    for n, R in ((1, 1), (3, 5), (6, 6)):
        for trial in range(3):
            buf = buffers(g, n, R, 0, C, 16, device)
            shift = torch.randint(0, 4, (n,), generator=g).to(device)
            want = {k: v.clone() for k, v in buf.items()}
            shift_draft_rows_ref(want, n, 16, C, shift)
            shift_draft_rows(buf, n, 16, C, shift)
            for name in buf:
                assert torch.equal(buf[name], want[name]), (C, n, R, trial, name)
