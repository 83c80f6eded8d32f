"""Batched, graph-capturable QSA block selection (the fast counterpart of `qwen4exp.ops.attention.qsa_select`).

Shapes:
    index_q       [T, Hi, Di]              indexer queries (normed, rotated)
    block_key     [P, page // C, Di]       compressed key of every complete C-token block (paged)
    block_tables  [R, max_pages] int32     page ids of each request
    token_req     [T] int                  request (block-table row) of each token
    token_pos     [T] int                  logical position of each token
    scores        [T, max_blocks] fp32     sum_h relu(q_h . k_b) / sqrt(Di); -inf for blocks b >= V = (pos+1) // C
    returns       [T, W] int32             W = budget + C - 1 logical token indices, -1 padded

A token keeps its top min(V, budget // C) blocks, expanded to C token indices each, followed by its incomplete
tail [V*C, pos]; the valid entries are packed at the front of the row (attention kernels skip all -1 tiles).
Ties between equal scores may resolve differently from the reference; the chosen set is otherwise identical.

No host reads of tensor values anywhere: the shapes depend only on T, budget, C and the static `max_blocks`
(the caller passes e.g. max_model_len // C), so a decode step can be captured in a CUDA graph. Large T is
processed in token chunks (a Python loop over static sizes) so the score buffer stays bounded.
"""

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below is complete on its own
    triton = None

_DEFAULT_MAX_CHUNK_BYTES = 512 << 20


if triton is not None:
    from .triton_pdl import launch_options, pdl_start

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


def qsa_block_scores_torch(
    index_q: torch.Tensor,
    block_key: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    C: int,
    max_blocks: int,
) -> torch.Tensor:
    """Same as `qsa_block_scores_triton`, gathering each token's block keys ([T, max_blocks, Di]: chunk T)."""
    T, hi, di = index_q.shape
    rpp = block_key.shape[1]
    blocks = torch.arange(max_blocks, device=index_q.device)
    # blocks past the table's capacity are invisible anyway; clamp so the gather stays in bounds
    cols = (blocks // rpp).clamp(max=block_tables.shape[1] - 1)
    pages = block_tables[token_req.long()][:, cols].long()  # [T, max_blocks]
    visible = (token_pos.long() + 1) // C
    mask = blocks[None, :] < visible[:, None]
    # invisible entries may name unwritten pages or table padding: read page 0 there instead
    slots = torch.where(mask, pages, 0) * rpp + blocks % rpp
    keys = block_key.reshape(-1, di)[slots].float()  # [T, max_blocks, Di]
    scores = torch.bmm(index_q.float(), keys.transpose(1, 2))  # [T, Hi, max_blocks]
    scores = torch.relu(scores).sum(1) / math.sqrt(di)
    # where(), not an additive mask: never-written keys can hold nan/inf
    return torch.where(mask, scores, float("-inf"))


def _pack_selection(
    top: torch.Tensor, token_pos: torch.Tensor, C: int, width: int
) -> torch.Tensor:
    """top [n, k] block ids from topk (invisible picks included) -> [n, width] int32 packed token indices."""
    n, k = top.shape
    dev = top.device
    pos = token_pos.long()
    visible = (pos + 1) // C
    keep = top < visible[:, None]  # topk fills with -inf blocks once fewer than k are visible
    rank = torch.cumsum(keep.long(), dim=1) - 1
    offs_c = torch.arange(C, device=dev)
    blk_tok = top[..., None] * C + offs_c  # [n, k, C]
    blk_dst = torch.where(keep[..., None], rank[..., None] * C + offs_c, width)  # column `width` is a discard bin
    n_sel = torch.minimum(visible, torch.full_like(visible, k))
    offs_tail = torch.arange(C - 1, device=dev)
    tail_tok = visible[:, None] * C + offs_tail  # [n, C-1]
    tail_dst = torch.where(tail_tok <= pos[:, None], n_sel[:, None] * C + offs_tail, width)
    out = torch.full((n, width + 1), -1, dtype=torch.long, device=dev)
    out.scatter_(1, torch.cat([blk_dst.flatten(1), tail_dst], 1), torch.cat([blk_tok.flatten(1), tail_tok], 1))
    return out[:, :width].to(torch.int32)


def qsa_select_batched(
    index_q: torch.Tensor,
    block_key: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    budget: int,
    C: int,
    max_blocks: int,
    use_triton: bool | None = None,
    max_chunk_bytes: int = _DEFAULT_MAX_CHUNK_BYTES,
) -> torch.Tensor:
    """QSA selection for a flat batch of tokens: [T, budget + C - 1] int32 logical indices, -1 padded.

    max_blocks: static bound on visible blocks (>= max context // C). use_triton: score with the Triton kernel
    (default: when index_q is on CUDA and Triton is importable). max_chunk_bytes bounds per-chunk temporaries.
    """
    T, hi, di = index_q.shape
    width = budget + C - 1
    k = min(budget // C, max_blocks)
    out = torch.empty(T, width, dtype=torch.int32, device=index_q.device)
    if T == 0:
        return out
    if k == 0:
        # no complete block can ever be picked: only the tail
        return _pack_selection(torch.zeros(T, 0, dtype=torch.long, device=index_q.device), token_pos, C, width)
    if use_triton is None:
        # tl.dot needs a reduction dim of at least 16 (the released models use 128)
        use_triton = triton is not None and index_q.is_cuda and di >= 16
    if use_triton:
        per_token = max_blocks * 4 * 2  # scores + topk's working copy
    else:
        per_token = max_blocks * (di * (block_key.element_size() + 4) + hi * 4 + 4 + 8 * 3)
    chunk = max(1, max_chunk_bytes // max(per_token, 1))
    score_fn = qsa_block_scores_triton if use_triton else qsa_block_scores_torch
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        scores = score_fn(index_q[s:e], block_key, block_tables, token_req[s:e], token_pos[s:e], C, max_blocks)
        # unsorted topk: the packing below orders by pick rank, not score
        top = scores.topk(k, dim=-1, sorted=False).indices
        out[s:e] = _pack_selection(top, token_pos[s:e], C, width)
    return out


__all__ = ["qsa_select_batched", "qsa_block_scores_torch", "qsa_block_scores_triton"]
