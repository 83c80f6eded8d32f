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

from kernel_references import sparse_paged_attention_ref

from qwen4exp.model.metadata import StepMetadata, build_q_tiles
from qwen4exp.ops import attention as ref_ops
from qwen4exp.ops import tuning
from qwen4exp.ops.attention_triton import (
    default_num_splits,
    prefill_paged_attention,
    prefill_tile_config,
    prefill_tile_tokens,
    sparse_paged_attention,
    write_rows,
)
from qwen4exp.ops.qsa import qsa_select_ref

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
    selected = qsa_select_ref(index_q, block_key, b["block_tables"], b["qsl"], b["ctx"], budget, C)
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


# ----- prefill_paged_attention: flash tiles of consecutive tokens of one request -----

# decodes first (as the runner orders them), then prompts from 0 and prompt chunks after a cached prefix
PREFILL_CTX = [33, 0, 12, 0, 40]
PREFILL_NEW = [1, 1, 5, 70, 130]


def step_meta(qsl, ctx, num_decode_reqs=0, device="cpu"):
    """A StepMetadata holding only what the prefill tile table reads."""
    from dataclasses import fields

    meta = StepMetadata(**{f.name: None for f in fields(StepMetadata) if f.name != "derived"})
    meta.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=device)
    meta.query_start_loc_cpu, meta.context_lens_cpu = list(qsl), list(ctx)
    meta.state_slots_cpu = list(range(1, len(ctx) + 1))
    meta.num_decode_reqs = num_decode_reqs
    return meta


def run_prefill(b, scale, block_m, tile_tokens=None, **kw):
    group = b["q"].shape[1] // b["key_cache"].shape[2]
    tiles = build_q_tiles(b["qsl"], b["ctx"], tile_tokens or prefill_tile_tokens(block_m, group))
    return prefill_paged_attention(b["q"], b["key_cache"], b["value_cache"], b["block_tables"], b["token_pos"],
                                   tiles.to(b["q"].device), scale, block_m=block_m, **kw)


@pytest.mark.parametrize("tile_tokens", [1, 4, 5, 16, 64, 200])
def test_prefill_q_tiles_cover_each_row_once(tile_tokens):
    qsl = [0, 1, 2, 7, 77, 207, 207, 210]  # two decodes, then chunks of 5, 70, 130, 0 and 3 tokens
    ctx = [33, 9, 12, 0, 40, 6, 100]
    meta = step_meta(qsl, ctx, num_decode_reqs=2)
    tiles = meta.prefill_q_tiles(tile_tokens)
    assert tiles.dtype == torch.int32 and tiles.shape[1] == 3
    assert meta.prefill_q_tiles(tile_tokens) is tiles  # built once per step, shared by every layer
    seen = torch.zeros(qsl[-1], dtype=torch.int32)
    last_positions = []
    for req, first, rows in tiles.tolist():
        assert 1 <= rows <= tile_tokens
        assert qsl[req] <= first and first + rows <= qsl[req + 1]  # inside one request
        seen[first: first + rows] += 1
        last_positions.append(ctx[req] + first + rows - 1 - qsl[req])
    assert (seen == 1).all()
    assert last_positions == sorted(last_positions, reverse=True)  # longest tiles launch first
    expected_tiles = sum(-(-(e - s) // tile_tokens) for s, e in zip(qsl, qsl[1:]))
    assert tiles.shape[0] == expected_tiles


# block_m rows are (token, query head) pairs: 16 rows at group 3 are tiles of 5 tokens (15 rows + 1 padding row), so
# the 70- and 130-token requests split into many tiles with a partial last one, at every offset against the pages
@pytest.mark.parametrize("page,group,D,block_m,block_n", [
    (8, 1, 32, 16, 16),
    (16, 3, 32, 16, 32),
    (8, 3, 64, 32, 16),
    (16, 1, 64, 64, 16),
    (8, 3, 48, 16, 16),  # head_dim not a power of two: masked lanes
])
def test_prefill_matches_paged_attention(page, group, D, block_m, block_n):
    b = make_batch(page, hkv=2, group=group, D=D, ctx=PREFILL_CTX, new=PREFILL_NEW, seed=20 + D + group)
    scale = D**-0.5
    expected = reference(b, scale)
    out = run_prefill(b, scale, block_m, block_n=block_n)
    assert torch.isfinite(out).all()  # nothing read from unowned pages or unwritten rows (they hold nan)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_table_coarser_than_tile_and_unordered():
    # a table of 40-token tiles for a kernel holding 5 tokens per tile: served 5 at a time, still exact; the tile
    # order does not matter either
    b = make_batch(16, hkv=2, group=3, D=32, ctx=PREFILL_CTX, new=PREFILL_NEW, seed=30)
    scale = 0.2
    expected = reference(b, scale)
    torch.testing.assert_close(run_prefill(b, scale, 16, tile_tokens=40, block_n=16), expected, atol=1e-5,
                               rtol=1e-5)
    tiles = build_q_tiles(b["qsl"], b["ctx"], 5).flip(0).contiguous().to(DEVICE)
    out = prefill_paged_attention(b["q"], b["key_cache"], b["value_cache"], b["block_tables"], b["token_pos"],
                                  tiles, scale, block_m=16, block_n=16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_model_head_layout_strided_q():
    # Hq=24 over Hkv=2 at D=256 with the default tiles (128 rows: 10 tokens x 12 heads), q a slice of [q | gate]
    b = make_batch(16, hkv=2, group=12, D=256, ctx=[52, 0, 30], new=[1, 12, 9], seed=31)
    packed = torch.randn(b["q"].shape[0], 24, 512, device=DEVICE)
    packed[..., :256] = b["q"]
    b["q"] = packed[..., :256]
    cfg = prefill_tile_config(256, 12, elem_bytes=4)  # fp32 inputs
    assert prefill_tile_tokens(cfg["block_m"], 12) == 10
    scale = 256**-0.5
    torch.testing.assert_close(run_prefill(b, scale, cfg["block_m"], block_n=cfg["block_n"]), reference(b, scale),
                               atol=1e-5, rtol=1e-5)


def test_prefill_fp16():
    b = make_batch(8, hkv=2, group=3, D=32, ctx=PREFILL_CTX, new=PREFILL_NEW, dtype=torch.float16, seed=32)
    scale = 32**-0.5
    out = run_prefill(b, scale, 16, block_n=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, run_ref(b, scale), atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(INTERPRET, reason="the Triton interpreter has no bf16 tl.dot")
@pytest.mark.parametrize("group,D", [(3, 64), (12, 256)])
def test_prefill_bf16(group, D):
    b = make_batch(16, hkv=2, group=group, D=D, ctx=PREFILL_CTX, new=PREFILL_NEW, dtype=torch.bfloat16, seed=33)
    scale = D**-0.5
    expected = run_ref(b, scale)  # fp32 math on the bf16 inputs
    for block_m, block_n in ((None, None), (32, 16), (128, 64)):
        out = run_prefill(b, scale, block_m or prefill_tile_config(D, group)["block_m"], block_n=block_n)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        # the current decode path rounds differently but must agree as closely
        torch.testing.assert_close(out.float(), run(b, scale).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_dispatch(monkeypatch):
    b = make_batch(16, hkv=2, group=4, D=64, ctx=PREFILL_CTX, new=PREFILL_NEW, dtype=torch.bfloat16, seed=34)
    meta = step_meta(b["qsl"], b["ctx"], num_decode_reqs=2, device=DEVICE)
    meta.block_tables, meta.token_req, meta.token_pos = b["block_tables"], b["token_req"], b["token_pos"]
    scale = 0.125
    calls = []
    from qwen4exp.ops import attention_triton

    real = attention_triton.prefill_paged_attention
    monkeypatch.setattr(attention_triton, "prefill_paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(tuning, "PREFILL_ATTN_MIN_TOKENS", meta.num_tokens + 1)
    default = ref_ops.paged_attention(b["q"], b["key_cache"], b["value_cache"], meta, scale)
    assert not calls  # a step below the threshold keeps the per-token kernel
    monkeypatch.setattr(tuning, "PREFILL_ATTN_MIN_TOKENS", 64)
    out = ref_ops.paged_attention(b["q"], b["key_cache"], b["value_cache"], meta, scale)
    assert calls
    torch.testing.assert_close(out.float(), default.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, run_ref(b, scale), atol=2e-2, rtol=2e-2)
