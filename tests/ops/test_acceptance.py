"""Greedy verification on the device: the Triton kernel (GPU, or the interpreter on CPU) against the torch reference
and against the rule counted by hand, on steps mixing decodes, verified requests with 1-3 drafts, prefill chunks,
empty request rows and a padding request, as the speculative graphs lay them out."""

import pytest
import torch
from conftest import on_device

from qwen4exp.ops.acceptance import greedy_acceptance_ref

triton = pytest.importorskip("triton")

from qwen4exp.ops.acceptance_triton import greedy_acceptance  # noqa: E402

greedy_acceptance = on_device(greedy_acceptance)


def step(g, kinds: list[tuple[str, int]]):
    """Rows of requests of kind (decode | verify | prefill | empty, drafts or tokens); each verified request's
    drafts are right up to a random point. Returns the step's tensors, every row's argmax, and the drafts each
    request keeps."""
    ids, slots, local, req, tokens, expected = [], [], [], [], [], []
    for r, (kind, n) in enumerate(kinds):
        rows = {"decode": 1, "verify": n + 1, "prefill": n, "empty": 0}[kind]
        row_ids = torch.randint(3, 100, (rows,), generator=g).tolist()
        argmax = torch.randint(3, 100, (rows,), generator=g).tolist()
        kept = 0
        if kind == "verify":
            kept = int(torch.randint(0, n + 1, (1,), generator=g))
            for j in range(kept):  # the argmax of row j equals the draft after it
                argmax[j] = row_ids[j + 1]
            if kept < n and argmax[kept] == row_ids[kept + 1]:
                argmax[kept] = row_ids[kept + 1] + 1
        ids += row_ids
        tokens += argmax
        slots += [100 + len(slots) + j if kind == "verify" and j < n else -1 for j in range(rows)]
        local += list(range(rows))
        req += [r] * rows
        expected.append(kept if rows else None)
    # a request without rows (an empty row of a graph) is never read: it holds the row count
    expected = [len(ids) if e is None else e for e in expected]
    t = dict(dtype=torch.long)
    return (torch.tensor(tokens, **t), torch.tensor(slots, **t), torch.tensor(ids, **t), torch.tensor(local, **t),
            torch.tensor(req, **t)), expected


@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_reference_and_the_rule(seed):
    g = torch.Generator().manual_seed(seed)
    kinds = [("decode", 1), ("verify", 1), ("verify", 3), ("decode", 1), ("verify", 2), ("prefill", 7),
             ("verify", 1), ("empty", 0), ("empty", 0), ("prefill", 5)]  # the last: the padding request
    (tokens, slots, ids, local, req), expected = step(g, kinds)
    ref = greedy_acceptance_ref(tokens, slots, ids, local, req, len(kinds))
    assert ref.tolist() == expected
    got = greedy_acceptance(tokens, slots, ids, local, req, len(kinds))
    assert got.dtype == torch.long and got.tolist() == expected


def test_wanted_rows_only():
    """With `rows` (an eager step's logits rows): tokens are the argmax of those rows alone, which hold every row
    of the verified requests."""
    g = torch.Generator().manual_seed(9)
    kinds = [("verify", 2), ("prefill", 6), ("verify", 1), ("decode", 1)]
    (tokens, slots, ids, local, req), expected = step(g, kinds)
    rows = torch.tensor([0, 1, 2, 8, 9, 10, 11])  # the prefill chunk wants its last row only
    ref = greedy_acceptance_ref(tokens[rows], slots, ids, local, req, len(kinds), rows)
    got = greedy_acceptance(tokens[rows], slots, ids, local, req, len(kinds), rows)
    assert ref.tolist() == got.tolist()
    assert [ref[0], ref[2], ref[3]] == [expected[0], expected[2], 0]
    assert ref[1] == 0  # its wanted row is no verified row


def test_many_rows_and_requests():
    """More rows and requests than one block of the kernel."""
    g = torch.Generator().manual_seed(3)
    kinds = [("verify", int(torch.randint(1, 4, (1,), generator=g))) for _ in range(300)]
    (tokens, slots, ids, local, req), expected = step(g, kinds)
    assert greedy_acceptance(tokens, slots, ids, local, req, len(kinds)).tolist() == expected
