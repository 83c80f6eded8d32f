"""Torch definitions of the kernels' own contracts, vectorised over a batch and shaped like the kernels' arguments.

The ops' references (qwen4exp/ops/X.py) define the model's numerics per request; these define what one kernel
computes for its padded batch (state slots, padding rows, pair layouts), so a kernel test can
compare element by element with the same arguments.
"""

import torch
import torch.nn.functional as F

from qwen4exp.ops.gated_delta import recurrent_gated_delta_rule_ref


def sparse_paged_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_pos: torch.Tensor,
    scale: float,
    selected: torch.Tensor | None = None,
    max_chunk_elems: int = 1 << 26,
) -> torch.Tensor:
    """Vectorised torch definition of `attention_triton.sparse_paged_attention` (fp32 throughout), chunked over tokens.

    Dense mode gathers the block table's full capacity (max_pages * page keys) per token, masked causally.
    """
    T, hq, D = q.shape
    _, page, hkv, _ = key_cache.shape
    group = hq // hkv
    out = torch.empty_like(q)
    if T == 0:
        return out
    flat_k = key_cache.reshape(-1, hkv, D)
    flat_v = value_cache.reshape(-1, hkv, D)
    L = selected.shape[1] if selected is not None else block_tables.shape[1] * page
    chunk = max(1, max_chunk_elems // max(1, L * hkv * D))
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        req = token_req[s:e].long()
        if selected is None:
            kpos = torch.arange(L, device=q.device).expand(e - s, L)
            valid = kpos <= token_pos[s:e, None].long()
        else:
            kpos = selected[s:e].long()
            valid = kpos >= 0
        kpos = kpos.clamp(min=0)
        # masked positions may hit block-table padding: point them at page 0 instead of reading garbage ids
        pages = torch.where(valid, block_tables[req[:, None], kpos // page].long(), 0)
        slots = pages * page + kpos % page
        # zero masked keys/values: unwritten rows may hold nan, and 0 * nan would leak through the softmax
        keep = valid[:, :, None, None]
        k = torch.where(keep, flat_k[slots].float(), 0.0)  # [n, L, Hkv, D]
        v = torch.where(keep, flat_v[slots].float(), 0.0)
        qg = q[s:e].float().view(e - s, hkv, group, D)
        scores = torch.einsum("nkgd,nlkd->nkgl", qg, k) * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("nkgl,nlkd->nkgd", probs, v).reshape(e - s, hq, D).to(q.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dilation: int = 1,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Torch definition of `conv_triton.causal_conv1d_update` (x [B, C], one token a request), vectorised over the
    batch."""
    prev = conv_state[state_slots]
    prev = torch.where(has_initial_state.bool()[:, None, None], prev, torch.zeros_like(prev))
    history = torch.cat([prev, x[:, :, None].to(conv_state.dtype)], dim=-1)  # [B, C, L + 1]
    y = F.conv1d(history.float(), weight.float()[:, None, :], groups=x.shape[1], dilation=dilation)  # [B, C, 1]
    if activation is not None:
        y = F.silu(y)
    conv_state[state_slots] = history[:, :, 1:]
    return y[:, :, 0].to(x.dtype)


def fused_recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_tokens_per_req: int = 1,
) -> torch.Tensor:
    """Torch definition of `gated_delta_triton.fused_recurrent_gated_delta_rule` for B requests of L =
    num_tokens_per_req consecutive tokens each, vectorised over the batch.

    The batch is folded into the head axis (request b, value head h -> head b*Hv + h, whose q/k head b*Hk + h//r is
    exactly what the grouped-head rule of recurrent_gated_delta_rule_ref picks), so that reference runs unchanged.
    """
    total, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    L, B = num_tokens_per_req, state_slots.shape[0]

    def fold(x):  # [B*L, H, ...] -> [L, B*H, ...]
        return x.reshape(B, L, *x.shape[1:]).transpose(0, 1).flatten(1, 2)

    q, k, v, g, beta = (fold(x) for x in (q, k, v, g, beta))
    init = ssm_state[state_slots]
    state = torch.where(has_initial_state.bool()[:, None, None, None], init, torch.zeros_like(init))
    state = state.reshape(B * hv, dk, dv)
    outs = []
    for t in range(L):
        o, state = recurrent_gated_delta_rule_ref(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(o[0])
    ssm_state[state_slots] = state.reshape(B, hv, dk, dv)
    out = torch.stack(outs).reshape(L, B, hv, dv).transpose(0, 1).reshape(total, hv, dv)
    return out.to(v.dtype)


def sum_pairs_ref(y, top_k: int, rows=None, weights=None, shared=None) -> torch.Tensor:
    """Torch definition of `moe_triton.sum_pairs`."""
    num_tokens = rows.shape[0] if rows is not None else y.shape[0] // top_k
    rows = rows if rows is not None else torch.arange(num_tokens * top_k, device=y.device).view(num_tokens, top_k)
    v = y[rows.long()].float()
    if weights is not None:
        v = v * weights.float()[..., None]
    out = v.sum(dim=1)
    if shared is not None:
        out = out + torch.sigmoid(shared[1].float()) * shared[0].float()
    return out.to(y.dtype)


def sort_pairs_ref(topk_ids: torch.Tensor, num_experts: int):
    """The N*k (token, slot) pairs of topk_ids [N, k] in expert order, ties in pair order (stable). Returns
    order [N*k] int64 (the pair at each sorted position), offs [E] int32 (the end of each expert's run: the grouped
    GEMM's offsets) and rows [N*k] int64 (each pair's sorted position, the inverse of order)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    # scatter_add instead of bincount: bincount's output size depends on the data, so it syncs on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=flat.device)
    return order, offs, rows
