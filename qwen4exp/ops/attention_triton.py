"""Paged (sparse) GQA attention in Triton: one flat batch of query tokens over the paged KV cache.

Shapes:
    q             [T, Hq, D]               query tokens of all requests, any order
    key_cache     [P, page, Hkv, D]        value_cache likewise (layout of `qwen4exp.ops.attention`)
    block_tables  [R, max_pages] int32     page ids of each request
    token_req     [T] int                  request (block-table row) of each token
    token_pos     [T] int                  logical position of each token in its request (its own K/V already cached)
    selected      [T, W] int32 or None     logical positions each token attends to (-1 padded, any order), e.g. from
                                           QSA selection; None means dense causal over positions 0..token_pos
    out           [T, Hq, D]               q's dtype

Work decomposition: one program per (token, kv head, split). The Hq/Hkv query heads sharing a kv head form the M
dimension of the tile matmuls (padded to 16, the tensor-core minimum), so each gathered K/V tile is loaded once per
group rather than once per query head. Key tiles of BLOCK_N logical positions are gathered through the block table
and folded into an fp32 online softmax. With num_splits > 1 every split writes its partial (m, l, acc) to a
workspace and a second kernel merges them: decode at long context has only T * Hkv programs, far too few to fill
the GPU, so the key range is cut into num_splits pieces instead.

Everything is a pure function of tensor shapes (no host reads of tensor values), so a decode step is CUDA-graph
capturable once the caller fixes T and num_splits.

`prefill_paged_attention` is the dense causal alternative for prefill steps (see its section below): one program per
(tile of consecutive tokens of one request, kv head), so a K/V tile read through the block table serves every query
of the tile instead of one. Its tile table comes from the host once per step (StepMetadata.prefill_q_tiles).
"""

import torch
import triton
import triton.language as tl

from ._triton_utils import launch_options, pdl_start

_LOG2E = 1.4426950408889634
_TARGET_PROGRAMS_PER_SM = 2
_DEFAULT_SM_COUNT = 132  # H200; only used when no CUDA device can be asked (interpreter runs)
_MIN_KEYS_PER_SPLIT = 256
# Integer arguments that change from step to step (the selection width, the block table's width = the step's widest
# request). Triton would otherwise compile a variant per divisibility-by-16 of each, in the middle of serving.
_STEP_SIZED = ["W", "stride_bt", "stride_sel"]


@triton.jit
def _softmax_accumulate(s, m_i, m_safe, l_i, acc, v_head_ptr, page_id, row, stride_vp, stride_vr, offs_d, kv_mask,
                        DOT_PREC: tl.constexpr):
    """Online-softmax step shared by the decode and prefill tiles: rescales the running sum and accumulator from the
    old row max m_i to m_safe (the new max, anchored at 0 for rows that have seen no key) and adds this key tile's
    p @ V. s holds the tile's scores in the log2 domain. The V addresses are formed here, after the softmax, as the
    kernels measured on the H200 formed them (formed earlier, they changed the generated code)."""
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head_ptr + page_id[:, None] * stride_vp + row[:, None] * stride_vr + offs_d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return l_i, acc


@triton.jit
def _attn_tile(
    q, m_i, l_i, acc, kpos, valid, req_row_ptr, k_head_ptr, v_head_ptr,
    stride_kp, stride_kr, stride_vp, stride_vr, qk_scale, offs_d, d_mask,
    PAGE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    page_id = tl.load(req_row_ptr + kpos // PAGE, mask=valid, other=0).to(tl.int64)
    row = (kpos % PAGE).to(tl.int64)
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_head_ptr + page_id[:, None] * stride_kp + row[:, None] * stride_kr + offs_d[None, :],
                mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [G, N], log2 domain
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no key yet keeps m = -inf; anchoring it at 0 avoids (-inf) - (-inf) = nan
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i, acc = _softmax_accumulate(s, m_i, m_safe, l_i, acc, v_head_ptr, page_id, row, stride_vp, stride_vr, offs_d,
                                   kv_mask, DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_STEP_SIZED)
def _sparse_paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, pos_ptr, sel_ptr,
    out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    qk_scale, W,
    stride_qt, stride_qh,
    stride_kp, stride_kr, stride_kh,
    stride_vp, stride_vr, stride_vh,
    stride_bt, stride_sel,
    stride_ot, stride_oh,
    HQ: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SEL: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    req = tl.load(req_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    if HAS_SEL:
        length = W + 0 * pos  # W entries to scan, typed like pos for the split arithmetic below
    else:
        length = pos + 1
    # splits share a token's key range evenly, in whole tiles, so a split's work tracks that token's context
    tiles_per_split = tl.cdiv(tl.cdiv(length, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, length)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    req_row_ptr = bt_ptr + req * stride_bt
    k_head_ptr = k_ptr + kvh * stride_kh
    v_head_ptr = v_ptr + kvh * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        if HAS_SEL:
            kpos = tl.load(sel_ptr + t * stride_sel + offs, mask=offs < end, other=-1).to(tl.int64)
            valid = kpos >= 0
            # selections are -1 padded up to W: short contexts would otherwise pay for a full W-wide scan
            if tl.max(valid.to(tl.int32), 0) > 0:
                m_i, l_i, acc = _attn_tile(
                    q, m_i, l_i, acc, kpos, valid, req_row_ptr, k_head_ptr, v_head_ptr,
                    stride_kp, stride_kr, stride_vp, stride_vr, qk_scale, offs_d, d_mask, PAGE, DOT_PREC,
                )
        else:
            m_i, l_i, acc = _attn_tile(
                q, m_i, l_i, acc, offs, offs < end, req_row_ptr, k_head_ptr, v_head_ptr,
                stride_kp, stride_kr, stride_vp, stride_vr, qk_scale, offs_d, d_mask, PAGE, DOT_PREC,
            )

    if NUM_SPLITS == 1:
        # l == 0 only for a query that sees nothing (not produced by valid metadata); emit 0 rather than nan
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        ws_row = (t * HQ + heads) * NUM_SPLITS + split  # workspace [T, Hq, S(, D)]
        tl.store(ws_m_ptr + ws_row, m_i, mask=g_mask)
        tl.store(ws_l_ptr + ws_row, l_i, mask=g_mask)
        tl.store(ws_acc_ptr + ws_row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_splits_kernel(
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr, stride_ot, stride_oh,
    HQ: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, TILE_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * HQ + h) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.load(ws_m_ptr + base + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros([1], tl.float32)
    o = tl.zeros([BLOCK_D], tl.float32)
    # TILE_S splits per iteration: one split at a time is a chain of ~130 dependent loads at long context (10 us
    # per call at batch 1), while a [S, D] fp32 tile of every split would not fit in registers for D = 256
    for s0 in range(0, NUM_SPLITS, TILE_S):
        offs_t = s0 + tl.arange(0, TILE_S)
        t_mask = offs_t < NUM_SPLITS
        w = tl.exp2(tl.load(ws_m_ptr + base + offs_t, mask=t_mask, other=float("-inf")) - m_max)  # empty: weight 0
        l_tot += tl.sum(w * tl.load(ws_l_ptr + base + offs_t, mask=t_mask, other=0.0), 0)
        acc = tl.load(ws_acc_ptr + (base + offs_t)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        o += tl.sum(w[:, None] * acc, 0)
    o = o / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


_sm_count_cache: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count_cache:
        _sm_count_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count_cache[idx]


def default_num_splits(num_tokens: int, num_kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Splits so that T * Hkv * splits covers the SMs a couple of times, keeping >= 256 keys per split.

    Depends only on static sizes (max_keys: W, or the block table's capacity for dense), so the value a decode
    graph is captured with stays valid for every replay.
    """
    programs = num_tokens * num_kv_heads
    want = triton.cdiv(_TARGET_PROGRAMS_PER_SM * _sm_count(device), max(programs, 1))
    return max(1, min(want, triton.cdiv(max_keys, _MIN_KEYS_PER_SPLIT)))


def sparse_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    scale: float,
    selected: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_context: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """GQA attention of each token over its request's paged cache: the `selected` positions, or dense causal.

    num_splits: key-range splits per (token, kv head); None picks `default_num_splits` from static sizes. A CUDA
    graph must be captured and replayed with the same value (it is a pure function of the shapes, so None is fine).
    max_context: a bound on every token's context (e.g. the step's max_seq_len, fixed per decode graph); dense
    attention then sizes its splits for it, rounded up to a power of two, instead of the block table's capacity.
    block_n / num_warps / num_stages: tuning overrides. Softmax and accumulation in fp32; returns q's dtype.
    """
    T, hq, D = q.shape
    _, page, hkv, _ = key_cache.shape
    assert hq % hkv == 0, (hq, hkv)
    assert value_cache.shape == key_cache.shape
    group = hq // hkv
    out = torch.empty_like(q)
    if T == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    has_sel = selected is not None
    if has_sel:
        assert selected.shape[0] == T and selected.stride(-1) == 1
        W = selected.shape[1]
        max_keys = W
        sel_arg, stride_sel = selected, selected.stride(0)
    else:
        W = 0
        max_keys = block_tables.shape[1] * page
        if max_context is not None:  # a power of two: few distinct split counts, hence few kernel variants
            max_keys = min(max_keys, triton.next_power_of_2(max_context))
        sel_arg, stride_sel = token_pos, 0  # never read: HAS_SEL is a constexpr

    block_d = triton.next_power_of_2(D)
    block_g = max(16, triton.next_power_of_2(group))
    if block_n is None:
        # D = 256: K+V tiles of 32 rows are 32 KB in bf16, so two pipeline stages still leave room for several
        # programs per SM, which a gather-bound decode needs more than bigger tiles
        block_n = 64 if block_d <= 128 else 32
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 2
    if num_splits is None:
        num_splits = default_num_splits(T, hkv, max_keys, q.device)
    num_splits = max(1, int(num_splits))

    if num_splits > 1:
        ws_m = torch.empty(T, hq, num_splits, dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(T, hq, num_splits, D, dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = ws_acc = out  # unused placeholders

    # fp32 caches would otherwise run the dots in tf32 on tensor cores and drift from the fp32 reference
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _sparse_paged_attn_kernel[(T, hkv, num_splits)](
        q, key_cache, value_cache, block_tables, token_req, token_pos, sel_arg,
        out, ws_m, ws_l, ws_acc,
        float(scale) * _LOG2E, W,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), stride_sel,
        out.stride(0), out.stride(1),
        HQ=hq, GROUP=group, HEAD_DIM=D, PAGE=page,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, HAS_SEL=has_sel, DOT_PREC=dot_prec,
        num_warps=num_warps, num_stages=num_stages, **launch_options(q)
    )
    if num_splits > 1:
        _merge_splits_kernel[(T, hq)](
            ws_m, ws_l, ws_acc, out, out.stride(0), out.stride(1),
            HQ=hq, HEAD_DIM=D, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), TILE_S=min(16, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d,
            num_warps=4, **launch_options(ws_m)
        )
    return out


# ----- prefill: flash-attention tiles of consecutive query tokens of one request -----
#
# Work decomposition: one program per (query tile, kv head). A tile is up to TILE_T consecutive tokens of one request,
# and the M rows of its matmuls are the (token, query head) pairs of that kv head's group, token-major
# (row = token * GROUP + head), so BLOCK_M = TILE_T * GROUP rounded up to a power of two. Against one program per
# (tile, query head) with BLOCK_M tokens, every gathered K/V row still feeds BLOCK_M query rows (the same arithmetic
# intensity), but:
#   - a tile spans GROUP times fewer positions, so its causal diagonal (the masked, partly wasted key tiles) and the
#     padding of a request's last tile shrink by the same factor;
#   - a one-token request (a decode riding in a prefill step) fills GROUP rows instead of 1, and its keys are read
#     once per kv head rather than once per query head, so mixed steps need no second kernel for their decodes.

_PREFILL_STEP_SIZED = ["stride_bt"]  # the block table's width is the step's widest request (see _STEP_SIZED)


@triton.jit
def _flash_tile(
    q, m_i, l_i, acc, kpos, qpos, hi, req_row_ptr, k_head_ptr, v_head_ptr,
    stride_kp, stride_kr, stride_vp, stride_vr, qk_scale, offs_d, d_mask,
    PAGE: tl.constexpr, DOT_PREC: tl.constexpr, CAUSAL: tl.constexpr,
):
    if CAUSAL:
        kv_valid = kpos <= hi
        page_id = tl.load(req_row_ptr + kpos // PAGE, mask=kv_valid, other=0).to(tl.int64)
        kv_mask = kv_valid[:, None] & d_mask[None, :]
    else:
        # every key of the tile precedes every query of the tile: no position masks at all
        page_id = tl.load(req_row_ptr + kpos // PAGE).to(tl.int64)
        kv_mask = d_mask[None, :]
    row = (kpos % PAGE).to(tl.int64)
    k = tl.load(k_head_ptr + page_id[:, None] * stride_kp + row[:, None] * stride_kr + offs_d[None, :],
                mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N], log2 domain
    if CAUSAL:
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # padding rows (qpos = -1) see no key at all; anchoring them at 0 avoids (-inf) - (-inf) = nan
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    l_i, acc = _softmax_accumulate(s, m_i, m_safe, l_i, acc, v_head_ptr, page_id, row, stride_vp, stride_vr, offs_d,
                                   kv_mask, DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_PREFILL_STEP_SIZED)
def _prefill_paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, tiles_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_kr, stride_kh,
    stride_vp, stride_vr, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TILE_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    tile = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    req = tl.load(tiles_ptr + tile * 3).to(tl.int64)
    first = tl.load(tiles_ptr + tile * 3 + 1).to(tl.int64)
    count = tl.load(tiles_ptr + tile * 3 + 2)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    d_mask = offs_d < HEAD_DIM
    req_row_ptr = bt_ptr + req * stride_bt
    k_head_ptr = k_ptr + kvh * stride_kh
    v_head_ptr = v_ptr + kvh * stride_vh

    # A tile table built for more tokens than TILE_T is still served, TILE_T tokens at a time: a table/tile-size
    # mismatch then costs speed, never rows. With a matching table this loop runs once.
    for t0 in range(0, count, TILE_T):
        row_valid = (tok < TILE_T) & (t0 + tok < count)
        rows = first + t0 + tok
        # padding rows get position -1, which the causal mask hides every key from
        qpos = tl.load(pos_ptr + rows, mask=row_valid, other=-1).to(tl.int32)
        lo = tl.min(tl.where(row_valid, qpos, 2147483647), 0)
        hi = tl.max(qpos, 0)
        q_mask = row_valid[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=q_mask, other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # key tiles wholly at or before the tile's first query need no mask; only the diagonal ones after them do
        full_end = (lo + 1) // BLOCK_N * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _flash_tile(
                q, m_i, l_i, acc, n0 + offs_n, qpos, hi, req_row_ptr, k_head_ptr, v_head_ptr,
                stride_kp, stride_kr, stride_vp, stride_vr, qk_scale, offs_d, d_mask, PAGE, DOT_PREC, False,
            )
        for n0 in range(full_end, hi + 1, BLOCK_N):
            m_i, l_i, acc = _flash_tile(
                q, m_i, l_i, acc, n0 + offs_n, qpos, hi, req_row_ptr, k_head_ptr, v_head_ptr,
                stride_kp, stride_kr, stride_vp, stride_vr, qk_scale, offs_d, d_mask, PAGE, DOT_PREC, True,
            )
        # every stored row sees at least its own key (l > 0); only unstored padding rows can have l = 0, and the
        # guard keeps them from computing 0 / 0
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_tile_config(head_dim: int, group: int, elem_bytes: int = 2) -> dict:
    """Default tiles of `prefill_paged_attention`: the fastest of a tile sweep on an H200 (bf16, D = 256, 12 query heads
    per kv head): 128 rows (10 tokens x 12 heads) x 64 keys, 8 warps, 2 stages won at 8 x 1024 new tokens (372 us
    against 423-841 us for the other tiles), 1 x 8192 and 4 x 1024 after 3072 cached. Every stage's K and V tiles sit in
    shared memory (227 KB per SM), so wider elements (fp32 at D = 256) take half the keys per step."""
    cfg = dict(block_m=128, block_n=64, num_warps=8, num_stages=2)
    while triton.next_power_of_2(head_dim) * cfg["block_n"] * elem_bytes * 2 * cfg["num_stages"] > 160 * 1024:
        cfg["block_n"] //= 2
    cfg["block_m"] = max(cfg["block_m"], triton.next_power_of_2(group))
    return cfg


def prefill_tile_tokens(block_m: int, group: int) -> int:
    """Tokens per tile when the M rows are (token, query head) pairs: what `build_q_tiles` should be given."""
    assert block_m >= group, (block_m, group)
    return block_m // group


def prefill_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_pos: torch.Tensor,
    q_tiles: torch.Tensor,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Dense causal GQA attention of every token over its request's paged cache, flash-attention style: the same
    result as `sparse_paged_attention(..., selected=None)`, computed per tile of consecutive tokens of one request.

    q_tiles: int32 [num_tiles, 3] (request, first token row, rows) on q's device, from `StepMetadata.prefill_q_tiles` /
    `model.metadata.build_q_tiles` with tile_tokens = `prefill_tile_tokens(block_m, Hq // Hkv)`; it must cover every
    row of q exactly once with runs of consecutive rows of one request, at consecutive positions (as token_pos has
    them). A table built with more tokens per tile is still correct, only slower.
    block_m: matmul rows per program, (token, query head) pairs; block_m // group tokens per tile. block_n: keys
    per inner step. None takes `prefill_tile_config`. Softmax and accumulation in fp32; returns q's dtype.
    """
    T, hq, D = q.shape
    _, page, hkv, _ = key_cache.shape
    assert hq % hkv == 0, (hq, hkv)
    assert value_cache.shape == key_cache.shape
    assert q_tiles.dim() == 2 and q_tiles.shape[1] == 3 and q_tiles.is_contiguous()
    group = hq // hkv
    out = torch.empty_like(q)
    if T == 0 or q_tiles.shape[0] == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
    cfg = prefill_tile_config(D, group, q.element_size())
    block_m = cfg["block_m"] if block_m is None else block_m
    block_n = cfg["block_n"] if block_n is None else block_n
    if num_warps is None:  # the default's 8 warps are for its 128-row tiles; smaller tiles get 4
        num_warps = cfg["num_warps"] if block_m >= cfg["block_m"] else 4
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    tile_t = prefill_tile_tokens(block_m, group)
    assert block_m >= 16 and block_n >= 16, "tl.dot needs at least 16 rows and 16 keys"
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"  # as in sparse_paged_attention
    _prefill_paged_attn_kernel[(q_tiles.shape[0], hkv)](
        q, key_cache, value_cache, block_tables, token_pos, q_tiles, out,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=D, PAGE=page, TILE_T=tile_t,
        BLOCK_M=triton.next_power_of_2(block_m), BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n,
        DOT_PREC=dot_prec, num_warps=num_warps, num_stages=num_stages, **launch_options(q)
    )
    return out


# ----- cache writes: up to three caches rows in one launch -----

@triton.jit
def _write_rows_kernel(slots_ptr, src0, dst0, src_stride0, src1, dst1, src_stride1, src2, dst2, src_stride2,
                       N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
                       B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    o = tl.arange(0, B0)
    tl.store(dst0 + slot * N0 + o, tl.load(src0 + t * src_stride0 + o, mask=o < N0).to(dst0.dtype.element_ty),
             mask=o < N0)
    if N1 > 0:
        o = tl.arange(0, B1)
        tl.store(dst1 + slot * N1 + o, tl.load(src1 + t * src_stride1 + o, mask=o < N1).to(dst1.dtype.element_ty),
                 mask=o < N1)
    if N2 > 0:
        o = tl.arange(0, B2)
        tl.store(dst2 + slot * N2 + o, tl.load(src2 + t * src_stride2 + o, mask=o < N2).to(dst2.dtype.element_ty),
                 mask=o < N2)


def write_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor) -> None:
    """`ops.attention.write_slots_many` for up to three (cache [P, page, ...], values [N, ...]) pairs: row
    slot_mapping[t] of each cache, viewed as [P * page, row], gets values[t] (cast to the cache's dtype). Caches
    must be contiguous; each value row's elements must be contiguous (rows may be strided)."""
    assert 1 <= len(pairs) <= 3
    n = slot_mapping.shape[0]
    args, widths = [], []
    for cache, values in pairs:
        width = cache[0, 0].numel()
        rows = values.reshape(n, width)  # a view for row-strided values with contiguous rows
        assert cache.is_contiguous() and rows.stride(1) == 1, "write_rows needs contiguous caches and value rows"
        args += [rows, cache, rows.stride(0)]
        widths.append(width)
    while len(widths) < 3:  # absent pairs: never read or written (N = 0 removes their code)
        args += [pairs[0][1], pairs[0][0], 0]
        widths.append(0)
    if n == 0:
        return
    _write_rows_kernel[(n,)](slot_mapping, *args, N0=widths[0], N1=widths[1], N2=widths[2],
                             B0=triton.next_power_of_2(widths[0]), B1=triton.next_power_of_2(max(widths[1], 1)),
                             B2=triton.next_power_of_2(max(widths[2], 1)), num_warps=1, **launch_options(slot_mapping))
