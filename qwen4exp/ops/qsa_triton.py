"""QSA block selection in Triton: the scoring and packing steps of `ops.qsa.qsa_select_batched` on the GPU (topk
runs between them in torch).

For every token, the score of every visible complete block of its request, read through the block table in place:
sum_h relu(q_h . k_b) / sqrt(Di), fp32, -inf for invisible blocks (b >= V = (pos + 1) // C). One program scores
BLOCK_T consecutive tokens x BLOCK_B blocks; prefill tokens of one request share every block key, so one
[BLOCK_T * Hi, Di] x [Di, BLOCK_B] dot serves them all. Shapes are static (T, max_blocks): CUDA-graph capturable.

Packing (`pack_selection`): topk's picks into each token's row of logical token indices, one program a token; in
torch (`ops.qsa.pack_selection_ref`) it is some twenty small launches, ~30 us of a decode step per QSA layer.
"""

import math

import torch
import triton
import triton.language as tl

from ._triton_utils import launch_options, pdl_start


@triton.jit(do_not_specialize=["T", "max_blocks", "stride_bt"])
def _qsa_scores_kernel(
    q_ptr, bk_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr,
    T, max_blocks, sqrt_di,
    stride_qt, stride_qh, stride_bkp, stride_bkr, stride_bt, stride_ot,
    HI: tl.constexpr, DI: tl.constexpr, C: tl.constexpr, RPP: tl.constexpr,
    BLOCK_T: tl.constexpr, HI_P: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_B: tl.constexpr,
    DOT_PREC: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    pid_t = tl.program_id(0)
    pid_b = tl.program_id(1)
    # M rows are (token, head) pairs of BLOCK_T consecutive tokens: prefill tokens of one request share every
    # block key, so one [BLOCK_T*HI_P, Di] x [Di, BLOCK_B] dot serves them all
    offs_m = tl.arange(0, BLOCK_T * HI_P)
    m_tok = (pid_t * BLOCK_T + offs_m // HI_P).to(tl.int64)
    m_head = offs_m % HI_P
    offs_d = tl.arange(0, BLOCK_DI)
    d_mask = offs_d < DI
    q = tl.load(q_ptr + m_tok[:, None] * stride_qt + m_head[:, None] * stride_qh + offs_d[None, :],
                mask=((m_tok < T) & (m_head < HI))[:, None] & d_mask[None, :], other=0.0)

    toks = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = toks < T
    req = tl.load(req_ptr + toks, mask=t_mask, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + toks, mask=t_mask, other=-1).to(tl.int64)
    vis = tl.where(t_mask, (pos + 1) // C, 0)
    blocks = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)

    scores = tl.full([BLOCK_T, BLOCK_B], float("-inf"), tl.float32)
    if pid_b * BLOCK_B < tl.max(vis, 0):
        r_lo = tl.min(tl.where(t_mask, req, 2**62), 0)
        r_hi = tl.max(tl.where(t_mask, req, -1), 0)
        # one pass per distinct request in the tile: a single pass for prefill, BLOCK_T passes for decode
        # (where each pass still loads only keys that token needs); gaps in unsorted token_req are skipped
        for r in range(r_lo, r_hi + 1):
            rows = t_mask & (req == r)
            if tl.max(rows.to(tl.int32), 0) > 0:
                b_valid = blocks < tl.max(tl.where(rows, vis, 0), 0)
                page_id = tl.load(bt_ptr + r * stride_bt + blocks // RPP, mask=b_valid, other=0).to(tl.int64)
                k = tl.load(bk_ptr + page_id[:, None] * stride_bkp + (blocks % RPP)[:, None] * stride_bkr
                            + offs_d[None, :], mask=b_valid[:, None] & d_mask[None, :], other=0.0)
                s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), 0.0)
                s = tl.sum(tl.reshape(s, [BLOCK_T, HI_P, BLOCK_B]), 1) / sqrt_di
                scores = tl.where(rows[:, None], s, scores)
        scores = tl.where(blocks[None, :] < vis[:, None], scores, float("-inf"))
    tl.store(out_ptr + toks[:, None] * stride_ot + blocks[None, :], scores,
             mask=t_mask[:, None] & (blocks < max_blocks)[None, :])


def qsa_block_scores_triton(
    index_q: torch.Tensor,
    block_key: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    C: int,
    max_blocks: int,
    block_t: int | None = None,
    block_b: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """[T, max_blocks] fp32 block scores, -inf where invisible. Keys are read through the block table in place."""
    T, hi, di = index_q.shape
    out = torch.empty(T, max_blocks, dtype=torch.float32, device=index_q.device)
    if T == 0 or max_blocks == 0:
        return out
    if index_q.stride(-1) != 1:
        index_q = index_q.contiguous()
    assert block_key.stride(-1) == 1
    hi_p = triton.next_power_of_2(hi)
    if block_t is None:
        # 16 rows is the tensor-core minimum; many tokens per request (prefill) amortise key loads over more rows
        min_t = max(1, 16 // hi_p)
        block_t = max(min_t, 16 if T >= 256 else min_t)
    assert block_t * hi_p >= 16, "tl.dot needs at least 16 rows"
    grid = (triton.cdiv(T, block_t), triton.cdiv(max_blocks, block_b))
    _qsa_scores_kernel[grid](
        index_q, block_key, block_tables, token_req, token_pos, out,
        T, max_blocks, math.sqrt(di),
        index_q.stride(0), index_q.stride(1), block_key.stride(0), block_key.stride(1), block_tables.stride(0),
        out.stride(0),
        HI=hi, DI=di, C=C, RPP=block_key.shape[1],
        BLOCK_T=block_t, HI_P=hi_p, BLOCK_DI=triton.next_power_of_2(di), BLOCK_B=block_b,
        DOT_PREC="ieee" if index_q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, **launch_options(index_q)
    )
    return out


@triton.jit(do_not_specialize=["K", "width"])
def _pack_selection_kernel(
    top_ptr, pos_ptr, out_ptr,
    K, width,
    stride_top, stride_out,
    C: tl.constexpr, BLOCK_K: tl.constexpr, TAIL_P: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr
):
    """One token's row: its kept picks' tokens in pick order, then its tail, then -1 (see `pack_selection`)."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    vis = (pos + 1) // C
    offs_k = tl.arange(0, BLOCK_K)
    top = tl.load(top_ptr + row * stride_top + offs_k, mask=offs_k < K, other=0).to(tl.int64)
    keep = (offs_k < K) & (top < vis)  # topk fills with invisible (-inf) blocks once fewer than K are visible
    kept = tl.sum(keep.to(tl.int32), 0)
    rank = tl.cumsum(keep.to(tl.int32), 0) - 1
    out_row = out_ptr + row * stride_out
    for c in tl.static_range(C):
        tl.store(out_row + rank * C + c, (top * C + c).to(tl.int32), mask=keep)
    n_sel = tl.minimum(vis, K)
    tail_n = pos + 1 - vis * C  # the incomplete block's tokens, fewer than C
    offs_t = tl.arange(0, TAIL_P)
    tl.store(out_row + n_sel * C + offs_t, (vis * C + offs_t).to(tl.int32), mask=offs_t < tail_n)
    # -1 everywhere else: past the tail, and between the kept picks and the tail (empty but with NaN scores,
    # which can leave fewer picks visible than n_sel)
    filled = n_sel * C + tail_n
    for w0 in range(0, width, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        empty = (offs_w >= kept * C) & ((offs_w < n_sel * C) | (offs_w >= filled)) & (offs_w < width)
        tl.store(out_row + offs_w, tl.full([BLOCK_W], -1, tl.int32), mask=empty)


def pack_selection(top: torch.Tensor, token_pos: torch.Tensor, C: int, width: int) -> torch.Tensor:
    """`ops.qsa.pack_selection_ref` in one launch (a program per token): top [n, k] block ids from topk, token_pos
    [n] -> [n, width] int32."""
    n, k = top.shape
    out = torch.empty(n, width, dtype=torch.int32, device=top.device)
    if n == 0:
        return out
    _pack_selection_kernel[(n,)](
        top, token_pos, out, k, width, top.stride(0), out.stride(0),
        C=C, BLOCK_K=triton.next_power_of_2(max(k, 1)), TAIL_P=triton.next_power_of_2(max(C - 1, 1)),
        BLOCK_W=min(1024, triton.next_power_of_2(width)), num_warps=4, **launch_options(top)
    )
    return out
