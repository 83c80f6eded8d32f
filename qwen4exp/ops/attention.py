"""Paged KV storage and (sparse) gated-GQA attention: API, dispatch and the torch references (attention_triton.py
holds the kernels; the QSA block keys and selection are in qsa.py).

Cache layout (one attention layer):
    key, value   [num_pages, page_size, kv_heads, head_dim]
    index_key    [num_pages, page_size, index_head_dim]          raw indexer keys, one per token
    block_key    [num_pages, page_size // C, index_head_dim]     compressed key of each complete C-token block
A request's logical token i lives in page block_table[i // page_size], row i % page_size; its block b (tokens
bC .. bC+C-1) lives in the same page as token bC.
"""

import torch

from . import tuning
from ._dispatch import HAS_TRITON, compiled_on_gpu, fast_path

if HAS_TRITON:
    from . import attention_triton


def write_slots(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [P, page, ...]; values: [N, ...]; slot_mapping: [N] flat row ids (page * page_size + row)."""
    cache.view(-1, *cache.shape[2:])[slot_mapping] = values.to(cache.dtype)


def write_slots_many(pairs: list[tuple[torch.Tensor, torch.Tensor]], slot_mapping: torch.Tensor) -> None:
    """write_slots for several (cache, values) pairs sharing one slot mapping (a layer's keys, values and raw
    indexer keys). GPU: one Triton launch instead of one index_put per cache."""
    if HAS_TRITON and fast_path(slot_mapping) and len(pairs) <= 3:
        return attention_triton.write_rows(pairs, slot_mapping)
    for cache, values in pairs:
        write_slots(cache, values, slot_mapping)


@compiled_on_gpu
def gate_output(out, gate):
    """The attention output gated by sigmoid(gate) (one fused kernel on the GPU)."""
    return out * torch.sigmoid(gate)


def logical_slots(block_table_row: torch.Tensor, positions: torch.Tensor, rows_per_page: int) -> torch.Tensor:
    """Flat cache rows of logical indices `positions` for one request (rows_per_page rows per page)."""
    return block_table_row[positions // rows_per_page].long() * rows_per_page + positions % rows_per_page


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


def paged_attention(q, key_cache, value_cache, meta, scale: float, selected=None) -> torch.Tensor:
    """Step-level dispatch of the (sparse) paged attention (see paged_attention_ref for the semantics). GPU: dense
    steps of at least tuning.PREFILL_ATTN_MIN_TOKENS tokens with prefill chunks take the flash-style prefill kernel;
    every other step the per-token split-K kernel."""
    if not (HAS_TRITON and fast_path(q)):
        return paged_attention_ref(q, key_cache, value_cache, meta.block_tables, meta.query_start_loc_cpu,
                                   meta.context_lens_cpu, scale, selected)
    if (selected is None and meta.num_tokens >= tuning.PREFILL_ATTN_MIN_TOKENS
            and meta.num_decode_reqs < meta.num_reqs and not meta.in_cuda_graph):
        # all-decode steps stay on the split-K decode kernel even when large: one query per request is all a prefill
        # tile would hold; steps in CUDA graphs too: the tile table is built on the host
        group = q.shape[1] // key_cache.shape[2]
        cfg = attention_triton.prefill_tile_config(q.shape[-1], group, q.element_size())
        tiles = meta.prefill_q_tiles(attention_triton.prefill_tile_tokens(cfg["block_m"], group))
        return attention_triton.prefill_paged_attention(q, key_cache, value_cache, meta.block_tables, meta.token_pos,
                                                        tiles, scale, **cfg)
    return attention_triton.sparse_paged_attention(q, key_cache, value_cache, meta.block_tables, meta.token_req,
                                                   meta.token_pos, scale, selected, max_context=meta.max_seq_len)
