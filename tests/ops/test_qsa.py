"""qsa_select_batched (torch and Triton scoring) vs the tie-exact reference qwen4exp.ops.qsa.qsa_select_ref.

Selections are compared as sets per row: the fast path may break exact score ties differently, so the data makes
ties improbable (positive queries and keys: relu never clamps and every score is a distinct positive sum).
Without CUDA the Triton kernels run in the interpreter on CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from qwen4exp.ops import attention as ref_ops
from qwen4exp.ops import qsa as qsa_ops
from qwen4exp.ops.qsa import qsa_block_scores_torch, qsa_select_batched

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
C = 4
# (context already cached, new tokens): prefill from 0, decode rows, prefill chunks starting mid-request; spans
# V < budget/C (all visible blocks picked), V == budget/C and V > budget/C, with every tail length 0..C-1
CTX = [0, 5, 40, 90, 3, 61]
NEW = [30, 1, 12, 1, 2, 1]


def make_batch(page, Hi=2, Di=16, ctx=CTX, new=NEW, positive=True, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(ctx, new)]
    pages_needed = [-(-t // page) for t in totals]
    maxp = max(pages_needed) + 2
    P = sum(pages_needed) + 3
    perm = torch.randperm(P - 1, generator=g) + 1
    block_tables = torch.zeros(len(ctx), maxp, dtype=torch.int32)
    # only complete blocks ever get a key; the rest stay nan so a read of an invisible block shows up
    block_key = torch.full((P, page // C, Di), float("nan"))
    used = 0
    for r in range(len(ctx)):
        block_tables[r, : pages_needed[r]] = perm[used : used + pages_needed[r]].int()
        used += pages_needed[r]
        for b in range(totals[r] // C):
            p, row = int(block_tables[r, (b * C) // page]), ((b * C) % page) // C
            k = torch.rand(Di, generator=g) + 0.05 if positive else torch.randn(Di, generator=g)
            block_key[p, row] = k
    T = sum(new)
    index_q = torch.rand(T, Hi, Di, generator=g) + 0.05 if positive else torch.randn(T, Hi, Di, generator=g)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    token_req = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(new)])
    token_pos = torch.cat([torch.arange(c, c + n, dtype=torch.int32) for c, n in zip(ctx, new)])
    return dict(
        index_q=index_q.to(DEVICE, dtype), block_key=block_key.to(DEVICE, dtype),
        block_tables=block_tables.to(DEVICE), token_req=token_req.to(DEVICE), token_pos=token_pos.to(DEVICE),
        qsl=qsl, ctx=list(ctx), max_blocks=maxp * page // C,
    )


def reference(b, budget):
    return qsa_ops.qsa_select_ref(
        b["index_q"], b["block_key"], b["block_tables"], b["qsl"], b["ctx"], budget, C
    )


def fast(b, budget, **kw):
    kw.setdefault("max_blocks", b["max_blocks"])
    return qsa_select_batched(
        b["index_q"], b["block_key"], b["block_tables"], b["token_req"], b["token_pos"], budget, C, **kw
    )


def assert_same_sets(out, expected, token_pos, budget):
    assert out.shape == expected.shape and out.dtype == torch.int32
    for t in range(out.shape[0]):
        got = out[t][out[t] >= 0].tolist()
        want = expected[t][expected[t] >= 0].tolist()
        assert len(got) == len(set(got)), f"row {t}: duplicate indices"
        assert set(got) == set(want), f"row {t}: {sorted(got)} != {sorted(want)}"
        # packed: every -1 after the last valid entry
        n = len(got)
        assert (out[t, :n] >= 0).all() and (out[t, n:] == -1).all(), f"row {t} not packed"
        p = int(token_pos[t])
        v = (p + 1) // C
        assert n == min(v, budget // C) * C + (p + 1 - v * C)


def triton_available():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_matches_reference_sets(page, use_triton):
    b = make_batch(page, seed=page)
    for budget in (16, 48):
        expected = reference(b, budget)
        assert_same_sets(fast(b, budget, use_triton=use_triton), expected, b["token_pos"], budget)


def assert_tie_equivalent(out, expected, scores, token_pos):
    """Same multiset of picked block scores and same tail per row: equal up to the order of tied blocks."""
    for t in range(out.shape[0]):
        v = (int(token_pos[t]) + 1) // C
        picked = [torch.unique(row[(row >= 0) & (row < v * C)].long() // C) for row in (out[t], expected[t])]
        assert picked[0].numel() == picked[1].numel()
        torch.testing.assert_close(scores[t, picked[0]].sort().values, scores[t, picked[1]].sort().values,
                                   atol=1e-5, rtol=1e-5)
        assert set(out[t][out[t] >= v * C].tolist()) == set(expected[t][expected[t] >= v * C].tolist())


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_chunked_equals_unchunked(use_triton):
    b = make_batch(16, seed=3, positive=False)  # signed data: relu zeroes whole scores, so ties are common
    whole = fast(b, 16, use_triton=use_triton)
    chunked = fast(b, 16, use_triton=use_triton, max_chunk_bytes=1)  # one token per chunk
    scores = qsa_block_scores_torch(b["index_q"], b["block_key"], b["block_tables"], b["token_req"], b["token_pos"],
                                    C, b["max_blocks"])
    assert_tie_equivalent(chunked, whole, scores, b["token_pos"])
    assert_tie_equivalent(whole, reference(b, 16), scores, b["token_pos"])


def test_budget_larger_than_max_blocks():
    # budget/C > max_blocks: every visible block is picked; rows are still W = budget + C - 1 wide
    b = make_batch(4, ctx=[10, 0], new=[3, 9], seed=4)
    budget = 4 * (b["max_blocks"] + 5)
    out = fast(b, budget)
    assert out.shape[1] == budget + C - 1
    assert_same_sets(out, reference(b, budget), b["token_pos"], budget)


@needs_triton
@pytest.mark.parametrize("block_t", [4, 16])
def test_triton_scores_match_torch(block_t):
    from qwen4exp.ops.qsa_triton import qsa_block_scores_triton

    b = make_batch(16, Hi=4, Di=32, seed=5, positive=False)
    # token order shuffled: a token tile then spans requests out of order, with gaps
    perm = torch.randperm(b["index_q"].shape[0], generator=torch.Generator().manual_seed(6)).to(DEVICE)
    args = (b["index_q"][perm], b["block_key"], b["block_tables"], b["token_req"][perm], b["token_pos"][perm], C,
            b["max_blocks"])
    expected = qsa_block_scores_torch(*args)
    got = qsa_block_scores_triton(*args, block_t=block_t, block_b=16)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert finite.sum() > 0 and torch.isfinite(got[finite]).all()
    torch.testing.assert_close(got[finite], expected[finite], atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("k", [1, 5, 8])
def test_triton_packing_equals_torch(k):
    """The packing of topk's picks, exactly as the torch reference: visible picks' tokens in pick order, the tail,
    -1 after; positions give 0 .. 12 visible blocks (fewer than k: invisible picks dropped) and every tail length.
    The picks are topk's over 16 blocks, invisible ones at -inf, in a random order within each row."""
    from qwen4exp.ops.qsa_triton import pack_selection

    g = torch.Generator().manual_seed(k)
    pos = torch.arange(0, 13 * C)
    scores = torch.rand(pos.numel(), 16, generator=g)
    scores[torch.arange(16)[None, :] >= ((pos + 1) // C)[:, None]] = float("-inf")
    top = scores.topk(k, dim=-1).indices
    top = torch.stack([row[torch.randperm(k, generator=g)] for row in top]).to(DEVICE)
    pos = pos.to(DEVICE)
    for width in (k * C + C - 1, 64):  # the engine's width, and a wider buffer
        expected = qsa_ops.pack_selection_ref(top, pos, C, width)
        got = pack_selection(top, pos, C, width)
        assert got.dtype == torch.int32 and torch.equal(got, expected)
    assert (expected >= 0).sum(1).tolist() == [min((p + 1) // C, k) * C + (p + 1) % C for p in pos.tolist()]


@needs_triton
def test_fp16_keys_triton():
    b = make_batch(16, seed=7, dtype=torch.float16)
    assert_same_sets(fast(b, 16, use_triton=True), reference(b, 16), b["token_pos"], 16)


@needs_triton
def test_end_to_end_with_sparse_attention():
    # fast selection -> Triton attention equals reference selection -> reference attention (same sets)
    from qwen4exp.ops.attention_triton import sparse_paged_attention

    page, hkv, hq, D, budget = 16, 2, 4, 16, 16
    b = make_batch(page, seed=8)
    g = torch.Generator().manual_seed(9)
    P = b["block_key"].shape[0]
    key_cache = torch.randn(P, page, hkv, D, generator=g).to(DEVICE)
    value_cache = torch.randn(P, page, hkv, D, generator=g).to(DEVICE)
    q = torch.randn(b["index_q"].shape[0], hq, D, generator=g).to(DEVICE)
    sel_ref = reference(b, budget)
    sel_fast = fast(b, budget, use_triton=True)
    expected = ref_ops.paged_attention_ref(q, key_cache, value_cache, b["block_tables"], b["qsl"], b["ctx"], 0.25,
                                           sel_ref)
    out = sparse_paged_attention(q, key_cache, value_cache, b["block_tables"], b["token_req"], b["token_pos"], 0.25,
                                 sel_fast, num_splits=2, block_n=16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture():
    b = make_batch(16, ctx=[90, 40, 61], new=[1, 1, 1], seed=10, dtype=torch.bfloat16)
    expected = fast(b, 16)  # warm-up (compiles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fast(b, 16)
    graph.replay()
    assert torch.equal(out, expected)
