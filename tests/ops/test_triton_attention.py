"""sparse_paged_attention (Triton) and its torch reference vs qwen4exp.ops.attention.paged_attention.

Without CUDA the kernels run in the Triton interpreter on CPU (small dims keep that fast). The interpreter cannot
do bf16 tl.dot (it multiplies the raw uint16 patterns), so bf16 is checked on GPU only.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

from qwen4exp.ops import attention as ref_ops
from qwen4exp.ops.triton_attention import (
    default_num_splits,
    sparse_paged_attention,
    sparse_paged_attention_ref,
    write_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (context already cached, new tokens): prefill from 0, decode rows, a prefill chunk starting mid-request
CTX = [0, 9, 37, 70, 5]
NEW = [23, 1, 6, 1, 1]


def make_batch(page, hkv, group, D, ctx=CTX, new=NEW, dtype=torch.float32, seed=0, maxp_extra=2):
    """Random ragged batch over shuffled pages. Unowned pages and not-yet-written rows hold nan: a kernel reading
    anything outside a query's visible positions poisons the output."""
    g = torch.Generator().manual_seed(seed)
    R, hq = len(ctx), hkv * group
    totals = [c + n for c, n in zip(ctx, new)]
    pages_needed = [-(-t // page) for t in totals]
    maxp = max(pages_needed) + maxp_extra
    P = sum(pages_needed) + 3
    perm = torch.randperm(P - 1, generator=g) + 1  # page 0 stays unowned: it is what table padding points at
    block_tables = torch.zeros(R, maxp, dtype=torch.int32)
    k_cache = torch.full((P, page, hkv, D), float("nan"))
    v_cache = torch.full((P, page, hkv, D), float("nan"))
    used = 0
    for r in range(R):
        block_tables[r, : pages_needed[r]] = perm[used : used + pages_needed[r]].int()
        used += pages_needed[r]
        for j in range(totals[r]):
            p, row = int(block_tables[r, j // page]), j % page
            k_cache[p, row] = torch.randn(hkv, D, generator=g)
            v_cache[p, row] = torch.randn(hkv, D, generator=g)
    T = sum(new)
    q = torch.randn(T, hq, D, generator=g)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    token_req = torch.cat([torch.full((n,), r, dtype=torch.int32) for r, n in enumerate(new)])
    token_pos = torch.cat([torch.arange(c, c + n, dtype=torch.int32) for c, n in zip(ctx, new)])
    dev = DEVICE
    return dict(
        q=q.to(dev, dtype), key_cache=k_cache.to(dev, dtype), value_cache=v_cache.to(dev, dtype),
        block_tables=block_tables.to(dev), token_req=token_req.to(dev), token_pos=token_pos.to(dev),
        qsl=qsl, ctx=list(ctx),
    )


def random_selection(token_pos, width, seed=0, keep=0.6):
    """Arbitrary subsets of 0..pos (always including pos), scattered over the row with -1 holes."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in token_pos.tolist():
        cand = torch.randperm(p + 1, generator=g)[: max(1, int(keep * (p + 1)))].tolist()
        cand = sorted(set(cand) | {p})[:width]
        row = torch.full((width,), -1, dtype=torch.int32)
        row[torch.randperm(width, generator=g)[: len(cand)]] = torch.tensor(cand, dtype=torch.int32)
        rows.append(row)
    return torch.stack(rows).to(token_pos.device)


def reference(b, scale, selected=None):
    return ref_ops.paged_attention_ref(
        b["q"], b["key_cache"], b["value_cache"], b["block_tables"], b["qsl"], b["ctx"], scale, selected
    )


def run(b, scale, selected=None, **kw):
    return sparse_paged_attention(
        b["q"], b["key_cache"], b["value_cache"], b["block_tables"], b["token_req"], b["token_pos"], scale,
        selected, **kw,
    )


def run_ref(b, scale, selected=None):
    return sparse_paged_attention_ref(
        b["q"], b["key_cache"], b["value_cache"], b["block_tables"], b["token_req"], b["token_pos"], scale, selected
    )


@pytest.mark.parametrize("page,group,splits", [(4, 2, 1), (4, 4, 3), (16, 2, 3), (16, 4, 1), (4, 3, 2)])
def test_dense_matches_paged_attention(page, group, splits):
    b = make_batch(page, hkv=2, group=group, D=16)
    scale = 16**-0.5
    expected = reference(b, scale)
    torch.testing.assert_close(run_ref(b, scale), expected, atol=1e-5, rtol=1e-5)
    out = run(b, scale, num_splits=splits, block_n=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page,group,splits", [(4, 4, 1), (16, 2, 2)])
def test_selected_from_qsa_select(page, group, splits):
    b = make_batch(page, hkv=2, group=group, D=32, seed=1)
    C, Hi, Di, budget = 4, 2, 16, 16
    g = torch.Generator().manual_seed(2)
    block_key = torch.randn(b["key_cache"].shape[0], page // C, Di, generator=g).to(DEVICE)
    index_q = torch.randn(b["q"].shape[0], Hi, Di, generator=g).to(DEVICE)
    selected = ref_ops.qsa_select_ref(index_q, block_key, b["block_tables"], b["qsl"], b["ctx"], budget, C)
    assert (selected >= 0).sum(1).max() > budget  # some rows are truly sparse: top blocks + tail
    scale = 32**-0.5
    expected = reference(b, scale, selected)
    torch.testing.assert_close(run_ref(b, scale, selected), expected, atol=1e-5, rtol=1e-5)
    out = run(b, scale, selected, num_splits=splits, block_n=16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_selected_unordered_with_holes():
    b = make_batch(4, hkv=2, group=2, D=24, seed=3)  # D not a power of two: masked head-dim lanes
    selected = random_selection(b["token_pos"], width=40, seed=4)
    scale = 24**-0.5
    expected = reference(b, scale, selected)
    for splits in (1, 3):
        torch.testing.assert_close(run(b, scale, selected, num_splits=splits, block_n=16), expected,
                                   atol=1e-5, rtol=1e-5)


def test_strided_q_and_default_splits():
    # q as the model produces it: a head-dim slice of the packed [q | gate] projection
    b = make_batch(16, hkv=2, group=2, D=16, seed=5)
    packed = torch.randn(b["q"].shape[0], 4, 32, device=DEVICE)
    b["q"] = packed[..., :16]
    scale = 0.3
    torch.testing.assert_close(run(b, scale), reference(b, scale), atol=1e-5, rtol=1e-5)


def test_decode_long_context_split():
    # one decode token over a long context: the case split-K exists for
    b = make_batch(16, hkv=2, group=4, D=16, ctx=[300], new=[1], seed=6)
    scale = 0.25
    expected = reference(b, scale)
    n = default_num_splits(1, 2, b["block_tables"].shape[1] * 16, torch.device(DEVICE))
    assert n > 1
    for splits in (1, 5, n, 40):  # 40: the merge reads splits in tiles of 16, the last one partial; most are empty
        torch.testing.assert_close(run(b, scale, num_splits=splits, block_n=32), expected, atol=1e-5, rtol=1e-5)
    # a context bound (the step's max_seq_len) sizes the splits for 512 keys instead of the table's capacity
    torch.testing.assert_close(run(b, scale, max_context=301, block_n=32), expected, atol=1e-5, rtol=1e-5)


def test_model_head_layout():
    # Hq=24 over Hkv=2 (group 12, padded to 16 rows) at D=256, with a QSA-shaped selection (C=4)
    b = make_batch(16, hkv=2, group=12, D=256, ctx=[0, 45], new=[5, 1], seed=12)
    C, budget = 4, 8
    rows = []
    for p in b["token_pos"].tolist():
        v = (p + 1) // C
        blocks = sorted(torch.randperm(v, generator=torch.Generator().manual_seed(p))[: budget // C].tolist())
        idx = [blk * C + i for blk in blocks for i in range(C)] + list(range(v * C, p + 1))
        rows.append(idx + [-1] * (budget + C - 1 - len(idx)))
    selected = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    scale = 256**-0.5
    for sel in (None, selected):
        torch.testing.assert_close(run(b, scale, sel, num_splits=2), reference(b, scale, sel), atol=1e-5, rtol=1e-5)


def test_default_num_splits_static():
    dev = torch.device(DEVICE)
    assert default_num_splits(1, 2, 32768, dev) > 32
    assert default_num_splits(4096, 2, 32768, dev) == 1
    assert default_num_splits(1, 2, 100, dev) == 1  # too short to be worth splitting


def test_fp16():
    b = make_batch(4, hkv=2, group=4, D=16, dtype=torch.float16, seed=7)
    scale = 0.25
    selected = random_selection(b["token_pos"], width=24, seed=8)
    for sel in (None, selected):
        expected = run_ref(b, scale, sel)  # fp32 math on the fp16 inputs
        out = run(b, scale, sel, num_splits=2, block_n=16)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(INTERPRET, reason="the Triton interpreter has no bf16 tl.dot")
def test_bf16():
    b = make_batch(16, hkv=2, group=4, D=64, dtype=torch.bfloat16, seed=9)
    scale = 0.125
    for splits in (1, 4):
        torch.testing.assert_close(run(b, scale, num_splits=splits), run_ref(b, scale), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture():
    b = make_batch(16, hkv=2, group=4, D=64, ctx=[200, 31, 90], new=[1, 1, 1], dtype=torch.bfloat16, seed=10)
    scale = 0.125
    selected = random_selection(b["token_pos"], width=64, seed=11)
    for sel in (None, selected):
        out = run(b, scale, sel, num_splits=4)  # warm-up compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(b, scale, sel, num_splits=4)
        b["q"].normal_()
        graph.replay()
        torch.testing.assert_close(out, run_ref(b, scale, sel), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_pairs", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_rows_matches_write_slots(num_pairs, dtype):
    """One launch writing a layer's keys, values and raw indexer keys equals one write_slots per cache: row-strided
    values (slices of a merged projection), shuffled slots, other rows untouched."""
    g = torch.Generator().manual_seed(num_pairs)
    P, page, T = 6, 4, 9
    shapes = [(2, 24), (2, 24), (12,)][:num_pairs]  # [kv heads, head_dim] twice, then [index_head_dim]
    merged = torch.randn(T, 2 * 48 + 12 + 5, generator=g).to(dtype).to(DEVICE)  # a projection's output + 5 spare
    values, col = [], 0
    for shape in shapes:
        width = torch.Size(shape).numel()
        values.append(merged[:, col: col + width].reshape(T, *shape))
        col += width
    assert values[0].stride(0) == merged.shape[1]
    slots = torch.randperm(P * page, generator=g)[:T].to(DEVICE)
    caches = [torch.randn(P, page, *shape, generator=g).to(dtype).to(DEVICE) for shape in shapes]
    expected = [c.clone() for c in caches]
    for c, v in zip(expected, values):
        ref_ops.write_slots(c, v, slots)
    write_rows(list(zip(caches, values)), slots)
    for e, c in zip(expected, caches):
        assert torch.equal(e, c)
