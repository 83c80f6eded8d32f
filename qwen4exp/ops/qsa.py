"""QSA (indexed sparse attention) block keys and block selection: API, dispatch and the torch reference.

A request's complete C-token blocks each get one compressed key, computed once when the block's last token arrives
and kept in the cache (`pool_block_keys`). A query at logical position p sees V = (p+1) // C complete blocks, scores
each with sum_h relu(q_h . k_b) / sqrt(Di), keeps the top min(V, budget/C) blocks and its incomplete tail [V*C, p].

`qsa_select_ref` is the reference (a loop over requests and visible-block counts; the CPU path). The GPU takes
`qsa_select_batched`, free of host reads and CUDA-graph capturable:
    index_q       [T, Hi, Di]              indexer queries (normed, rotated)
    block_key     [P, page // C, Di]       compressed key of every complete C-token block (paged)
    block_tables  [R, max_pages] int32     page ids of each request
    token_req     [T] int                  request (block-table row) of each token
    token_pos     [T] int                  logical position of each token
    scores        [T, max_blocks] fp32     -inf for blocks b >= V (qsa_triton.py, or `qsa_block_scores_torch`)
    returns       [T, W] int32             W = budget + C - 1 logical token indices, -1 padded
with the valid entries packed at the front of each row (attention kernels skip all -1 tiles). Ties between equal
scores may resolve differently from the reference; the chosen set is otherwise identical. Shapes depend only on T,
budget, C and the static `max_blocks` (max_model_len // C); large T is processed in token chunks of static size so
the score buffer stays bounded.
"""

import math

import torch

from ._dispatch import HAS_TRITON, compiled_on_gpu, fast_path
from .attention import logical_slots
from .norm import rms_norm
from .rotary import apply_rope

if HAS_TRITON:
    from . import qsa_triton

_MAX_CHUNK_BYTES = 512 << 20


@compiled_on_gpu
def pool_block_keys(token_slots, flat_keys, norm_weight, eps: float, cos, sin):
    """Compressed key of each block: RMSNorm(mean of its C raw keys (fp32 mean, rounded)), rotated at the block's
    first position. token_slots [NB, C] (first: NB is the size that varies); flat_keys [rows, Di]; cos/sin [NB, R].
    Returns [NB, Di]."""
    pooled = flat_keys[token_slots].float().mean(dim=1).to(flat_keys.dtype)
    return apply_rope.eager(rms_norm.eager(pooled, norm_weight, eps), cos, sin)


def qsa_select(index_q, block_key, meta, budget: int, compress_ratio: int) -> torch.Tensor:
    """Step-level dispatch of the block selection (see qsa_select_ref for the semantics)."""
    if not fast_path(index_q):
        return qsa_select_ref(index_q, block_key, meta.block_tables, meta.query_start_loc_cpu, meta.context_lens_cpu,
                              budget, compress_ratio)
    return qsa_select_batched(index_q, block_key, meta.block_tables, meta.token_req, meta.token_pos, budget,
                              compress_ratio, max(1, meta.max_seq_len // compress_ratio))


def qsa_select_ref(
    index_q: torch.Tensor,
    block_key: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    context_lens: list[int],
    budget: int,
    compress_ratio: int,
) -> torch.Tensor:
    """Choose the tokens each query attends to.

    index_q: [T, Hi, Di] (normed, rotated). A query at logical position p sees V = (p+1) // C complete blocks; each
    scores sum_h relu(q_h . k_b) / sqrt(Di); the top min(V, budget/C) blocks and the incomplete tail [V*C, p] are
    kept. Returns [T, budget + C - 1] int32 logical token indices, -1 padded.

    topk runs on each query's own visible row (grouped by V) so that ties resolve exactly as in the reference.
    """
    C = compress_ratio
    width = budget + C - 1
    block_topk = budget // C
    rows_per_page = block_key.shape[1]
    flat_keys = block_key.view(-1, block_key.shape[-1])
    scale = math.sqrt(index_q.shape[-1])
    out = torch.full((index_q.shape[0], width), -1, dtype=torch.int32, device=index_q.device)
    for r in range(len(query_start_loc) - 1):
        s, e = query_start_loc[r], query_start_loc[r + 1]
        if e == s:
            continue
        positions = torch.arange(context_lens[r], context_lens[r] + e - s, device=index_q.device)
        visible = (positions + 1) // C
        max_v = int(visible[-1])
        keys = flat_keys[logical_slots(block_tables[r], torch.arange(max_v, device=index_q.device), rows_per_page)]
        keys = keys.float()
        for v in torch.unique(visible).tolist():
            rows = (visible == v).nonzero().flatten()
            parts = []
            if v > 0:
                scores = (index_q[s + rows].float() @ keys[:v].t()).transpose(-1, -2)  # [n, V, Hi]
                scores = torch.relu(scores).sum(-1) / scale
                top = scores.topk(min(block_topk, v), dim=-1).indices  # [n, k]
                parts.append((top[..., None] * C + torch.arange(C, device=top.device)).flatten(1))
            for i, row in enumerate(rows.tolist()):
                tail = torch.arange(v * C, int(positions[row]) + 1, device=index_q.device)
                sel = torch.cat([parts[0][i], tail]) if parts else tail
                out[s + row, : sel.numel()] = sel.to(torch.int32)
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
    """`qsa_triton.qsa_block_scores_triton` in torch, gathering each token's block keys ([T, max_blocks, Di]: chunk
    T)."""
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


def pack_selection_ref(top: torch.Tensor, token_pos: torch.Tensor, C: int, width: int) -> torch.Tensor:
    """top [n, k] block ids from topk (invisible picks included) -> [n, width] int32 packed token indices: each
    visible pick's C tokens in pick order, then the incomplete block's tokens up to the token's position, then -1."""
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
    max_chunk_bytes: int = _MAX_CHUNK_BYTES,
) -> torch.Tensor:
    """QSA selection for a flat batch of tokens: [T, budget + C - 1] int32 logical indices, -1 padded.

    max_blocks: static bound on visible blocks (>= max context // C). use_triton: score and pack with the Triton
    kernels (default: when index_q is on CUDA and Triton is importable) rather than `qsa_block_scores_torch` and
    `pack_selection_ref`.
    max_chunk_bytes bounds per-chunk temporaries.
    """
    T, hi, di = index_q.shape
    width = budget + C - 1
    k = min(budget // C, max_blocks)
    if T == 0:
        return torch.empty(0, width, dtype=torch.int32, device=index_q.device)
    if k == 0:
        # no complete block can ever be picked: only the tail
        return pack_selection_ref(torch.zeros(T, 0, dtype=torch.long, device=index_q.device), token_pos, C, width)
    if use_triton is None:
        # tl.dot needs a reduction dim of at least 16 (the released models use 128)
        use_triton = HAS_TRITON and index_q.is_cuda and di >= 16
    if use_triton:
        per_token = max_blocks * 4 * 2  # scores + topk's working copy
    else:
        per_token = max_blocks * (di * (block_key.element_size() + 4) + hi * 4 + 4 + 8 * 3)
    chunk = max(1, max_chunk_bytes // max(per_token, 1))
    score_fn = qsa_triton.qsa_block_scores_triton if use_triton else qsa_block_scores_torch
    pack = qsa_triton.pack_selection if use_triton else pack_selection_ref
    parts = []
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        scores = score_fn(index_q[s:e], block_key, block_tables, token_req[s:e], token_pos[s:e], C, max_blocks)
        # unsorted topk: the packing below orders by pick rank, not score
        top = scores.topk(k, dim=-1, sorted=False).indices
        parts.append(pack(top, token_pos[s:e], C, width))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
