"""Paged KV storage, QSA block selection and (sparse) gated-GQA attention: torch references.

Cache layout (one attention layer):
    key, value   [num_pages, page_size, kv_heads, head_dim]
    index_key    [num_pages, page_size, index_head_dim]          raw indexer keys, one per token
    block_key    [num_pages, page_size // C, index_head_dim]     compressed key of each complete C-token block
A request's logical token i lives in page block_table[i // page_size], row i % page_size; its block b (tokens
bC .. bC+C-1) lives in the same page as token bC.
"""

import math

import torch

from . import compiled_on_gpu
from .norm import rms_norm
from .rotary import apply_rope

# Dense (selected is None) GPU steps with at least this many tokens, some of them prefill, run the flash-style prefill
# kernel (triton_attention.prefill_paged_attention) instead of the per-token sparse_paged_attention. H200, flash-next
# widths (bench/decode_kernels.py --parts prefill_attn): 4.3x faster at 8 x 1024 new tokens, 6.1x at 1 x 8192.
PREFILL_KERNEL_MIN_TOKENS: int | None = 512


@compiled_on_gpu
def pool_block_keys(token_slots, flat_keys, norm_weight, eps: float, cos, sin):
    """Compressed key of each block: RMSNorm(mean of its C raw keys (fp32 mean, rounded)), rotated at the block's
    first position. token_slots [NB, C] (first: NB is the size that varies); flat_keys [rows, Di]; cos/sin [NB, R].
    Returns [NB, Di]."""
    pooled = flat_keys[token_slots].float().mean(dim=1).to(flat_keys.dtype)
    return apply_rope.eager(rms_norm.eager(pooled, norm_weight, eps), cos, sin)


def write_slots(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [P, page, ...]; values: [N, ...]; slot_mapping: [N] flat row ids (page * page_size + row)."""
    cache.view(-1, *cache.shape[2:])[slot_mapping] = values.to(cache.dtype)


def write_slots_many(pairs: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor) -> None:
    """write_slots for several (cache, values) pairs sharing one slot mapping (a layer's keys, values and raw
    indexer keys). GPU: one Triton launch instead of one index_put per cache."""
    from . import fast_path

    if fast_path(slot_mapping) and len(pairs) <= 3:
        from .triton_attention import write_rows

        return write_rows(pairs, slot_mapping)
    for cache, values in pairs:
        write_slots(cache, values, slot_mapping)


@compiled_on_gpu
def gate_output(out, gate):
    """The attention output gated by sigmoid(gate) (one fused kernel on the GPU)."""
    return out * torch.sigmoid(gate)


def logical_slots(block_table_row: torch.Tensor, positions: torch.Tensor, rows_per_page: int) -> torch.Tensor:
    """Flat cache rows of logical indices `positions` for one request (rows_per_page rows per page)."""
    return block_table_row[positions // rows_per_page].long() * rows_per_page + positions % rows_per_page


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


def paged_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    context_lens: list[int],
    scale: float,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of the new queries over each request's cached keys (new keys already written).

    q: [T, Hq, D]; caches [P, page, Hkv, D]; selected: optional [T, W] logical indices from `qsa_select` that restrict
    what each query sees (dense causal when None). Softmax in fp32. Returns [T, Hq, D] in q's dtype.
    """
    page = key_cache.shape[1]
    hq, hkv = q.shape[1], key_cache.shape[2]
    out = torch.empty_like(q)
    flat_k = key_cache.view(-1, hkv, key_cache.shape[-1])
    flat_v = value_cache.view(-1, hkv, value_cache.shape[-1])
    for r in range(len(query_start_loc) - 1):
        s, e = query_start_loc[r], query_start_loc[r + 1]
        if e == s:
            continue
        total = context_lens[r] + e - s
        slots = logical_slots(block_tables[r], torch.arange(total, device=q.device), page)
        k = flat_k[slots].repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = flat_v[slots].repeat_interleave(hq // hkv, dim=1)
        qpos = torch.arange(context_lens[r], total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= qpos[:, None]  # [n, L]
        if selected is not None:
            sel = selected[s:e].long()
            chosen = torch.zeros(e - s, total + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(1, torch.where(sel >= 0, sel, total), True)
            mask &= chosen[:, :total]
        scores = torch.einsum("nhd,lhd->hnl", q[s:e], k).float() * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out[s:e] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out


def qsa_select(index_q, block_key, meta, budget: int, compress_ratio: int) -> torch.Tensor:
    """Step-level dispatch of the block selection (see qsa_select_ref for the semantics)."""
    from . import fast_path

    if not fast_path(index_q):
        return qsa_select_ref(index_q, block_key, meta.block_tables, meta.query_start_loc_cpu, meta.context_lens_cpu,
                              budget, compress_ratio)
    from .qsa_fast import qsa_select_batched

    return qsa_select_batched(index_q, block_key, meta.block_tables, meta.token_req, meta.token_pos, budget,
                              compress_ratio, max(1, meta.max_seq_len // compress_ratio))


def paged_attention(q, key_cache, value_cache, meta, scale: float, selected=None) -> torch.Tensor:
    """Step-level dispatch of the (sparse) paged attention (see paged_attention_ref for the semantics)."""
    from . import fast_path

    if not fast_path(q):
        return paged_attention_ref(q, key_cache, value_cache, meta.block_tables, meta.query_start_loc_cpu,
                                   meta.context_lens_cpu, scale, selected)
    if (selected is None and PREFILL_KERNEL_MIN_TOKENS is not None and meta.num_tokens >= PREFILL_KERNEL_MIN_TOKENS
            and meta.num_decode_reqs < meta.num_reqs and not meta.in_cuda_graph):
        # all-decode steps stay on the split-K decode kernel even when large: one query per request is all a prefill
        # tile would hold; steps in CUDA graphs too: the tile table is built on the host
        from .triton_attention import prefill_paged_attention, prefill_tile_config, prefill_tile_tokens

        group = q.shape[1] // key_cache.shape[2]
        cfg = prefill_tile_config(q.shape[-1], group, q.element_size())
        tiles = meta.prefill_q_tiles(prefill_tile_tokens(cfg["block_m"], group))
        return prefill_paged_attention(q, key_cache, value_cache, meta.block_tables, meta.token_pos, tiles, scale,
                                       **cfg)
    from .triton_attention import sparse_paged_attention

    return sparse_paged_attention(q, key_cache, value_cache, meta.block_tables, meta.token_req, meta.token_pos,
                                  scale, selected, max_context=meta.max_seq_len)
