"""PLE ops: hashed n-gram ids (EOS-aware shifted tokens, then multiply-xor hashing into prime-sized head tables),
and the gate of the normalised streams on the n-gram value."""

import math

import torch

from . import compiled_on_gpu


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
    """Step-level dispatch of `shifted_tokens_ref` (vectorised, graph-safe version on GPU)."""
    from . import fast_path

    if not fast_path(meta.input_ids):
        return shifted_tokens_ref(meta.input_ids, meta.query_start_loc_cpu, meta.ngram_context, eos_token_id, n)
    from .ngram_fast import shifted_tokens_batched

    return shifted_tokens_batched(meta.input_ids, meta.token_req, meta.token_local, meta.ngram_context,
                                  eos_token_id, n)
