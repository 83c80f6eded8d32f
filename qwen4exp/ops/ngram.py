"""PLE ops: hashed n-gram ids (EOS-aware shifted tokens, then multiply-xor hashing into prime-sized head tables),
and the gate of the normalised streams on the n-gram value. Pure torch: on the GPU the shifted tokens come from
device tensors only (`shifted_tokens_batched`, CUDA-graph capturable) and the gate is compiled."""

import math

import torch

from ._dispatch import compiled_on_gpu, fast_path


@compiled_on_gpu
def ple_gate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, hidden: int) -> torch.Tensor:
    """Each stream's signed-sqrt gate on the shared value: query, key [T, hc*H] (the normalised streams and keys),
    value [T, H] -> [T, hc*H]. Compiled on the GPU: eagerly it is ten elementwise launches over [T, hc, H]."""
    query = query.unflatten(-1, (-1, hidden))
    gate = (key.unflatten(-1, (-1, hidden)) * query).sum(-1, keepdim=True) / math.sqrt(hidden)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    return (torch.sigmoid(gate) * value[:, None, :]).flatten(1)


def shifted_tokens_ref(
    input_ids: torch.Tensor, query_start_loc: list[int], ngram_context: torch.Tensor, eos_token_id: int, n: int
) -> torch.Tensor:
    """Token t-s for every new token t and shift s < n, restarting after each EOS.

    input_ids: [T]; ngram_context: [R, n-1] the n-1 committed tokens before each request's first new token, oldest
    first (EOS where the request has fewer). Column s of the result is the token s steps back, or EOS when an EOS
    lies in [t-s, t-1] (the token after an EOS starts a new document). Returns [T, n] int64.
    """
    ctx_len = n - 1
    pieces, real, offset = [], [], 0
    for r in range(len(query_start_loc) - 1):
        s, e = query_start_loc[r], query_start_loc[r + 1]
        pieces += [ngram_context[r, :ctx_len].long(), input_ids[s:e].long()]
        real.append(torch.arange(offset + ctx_len, offset + ctx_len + e - s, device=input_ids.device))
        offset += ctx_len + e - s
    history = torch.cat(pieces)  # each request's context followed by its new tokens
    idx = torch.cat(real)  # positions of the new tokens inside `history`
    pos = torch.arange(history.numel(), device=history.device)
    last_eos = torch.cummax(torch.where(history == eos_token_id, pos, -1), 0).values
    last_eos_before = torch.cat([last_eos.new_full((1,), -1), last_eos[:-1]])[idx]
    cols = [history[idx]]
    for shift in range(1, n):
        src = idx - shift
        cols.append(torch.where(last_eos_before < src, history[src], history.new_full((), eos_token_id)))
    return torch.stack(cols, dim=1)


def ngram_ids(
    tokens: torch.Tensor,
    multipliers: torch.Tensor,
    head_sizes: torch.Tensor,
    head_offsets: torch.Tensor,
    heads_per_ngram: int,
) -> torch.Tensor:
    """tokens: [T, n] from `shifted_tokens`; multipliers: [n] int64; head_sizes/offsets: [(n-1)*heads_per_ngram].

    For order k = 2..n, mix = xor_{s<k} tokens[:, s] * multipliers[s] (int64, wrapping); head h of that order gets
    (mix mod size_h) + offset_h. Returns [T, (n-1)*heads_per_ngram] int64 row ids into the layer's table.
    """
    mixed = tokens[:, 0] * multipliers[0]
    blocks = []
    for order in range(2, tokens.shape[1] + 1):
        mixed = torch.bitwise_xor(mixed, tokens[:, order - 1] * multipliers[order - 1])
        sl = slice((order - 2) * heads_per_ngram, (order - 1) * heads_per_ngram)
        blocks.append(torch.remainder(mixed[:, None], head_sizes[sl]) + head_offsets[sl])
    return torch.cat(blocks, dim=1)


def shifted_tokens(meta, eos_token_id: int, n: int) -> torch.Tensor:
    """Step-level dispatch of `shifted_tokens_ref`: on the GPU the vectorised, graph-safe `shifted_tokens_batched`."""
    if not fast_path(meta.input_ids):
        return shifted_tokens_ref(meta.input_ids, meta.query_start_loc_cpu, meta.ngram_context, eos_token_id, n)
    return shifted_tokens_batched(meta.input_ids, meta.token_req, meta.token_local, meta.ngram_context,
                                  eos_token_id, n)


def shifted_tokens_batched(
    input_ids: torch.Tensor,
    token_req: torch.Tensor,
    token_local: torch.Tensor,
    ngram_context: torch.Tensor,
    eos_token_id: int,
    n: int,
) -> torch.Tensor:
    """`shifted_tokens_ref` from device tensors only (no host lists): input_ids [T]; token_req [T] request index of
    each token; token_local [T] index of the token among its request's new tokens; ngram_context [R, >= n-1] oldest
    first. Returns [T, n] int64. Each request's new tokens must be contiguous and in order in the flat batch, so that
    a token s steps back among the new ones sits s rows earlier; padding rows only need a valid token_req."""
    ids = input_ids.long()
    if n == 1:
        return ids[:, None]
    ctx_len = n - 1
    shifts = torch.arange(n, device=ids.device)
    back = token_local.long()[:, None] - shifts  # index among the new tokens of token t-s; negative: in the context
    rows = (torch.arange(ids.numel(), device=ids.device)[:, None] - shifts).clamp_min(0)
    ctx_col = (back + ctx_len).clamp(0, ctx_len - 1)
    from_ctx = ngram_context[:, :ctx_len].long()[token_req.long()[:, None], ctx_col]
    history = torch.where(back >= 0, ids[rows], from_ctx)  # [T, n]: tokens t, t-1, .., t-n+1
    # Column s is cut off by an EOS anywhere among tokens t-1 .. t-s (shifts 1..s).
    eos_seen = (history[:, 1:] == eos_token_id).cummax(dim=1).values
    cut = torch.where(eos_seen, torch.full_like(history[:, 1:], eos_token_id), history[:, 1:])
    return torch.cat([ids[:, None], cut], dim=1)
