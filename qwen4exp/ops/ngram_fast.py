"""EOS-aware shifted tokens for PLE n-grams from device tensors only (no host lists), CUDA-graph capturable.

Same result as qwen4exp.ops.ngram.shifted_tokens: for every new token t ([T] input_ids) and shift s < n, column s of
the [T, n] int64 result is the token s steps back in its request's history [ngram_context[r, :n-1], new tokens], or
EOS when an EOS lies in [t-s, t-1]. Each request's new tokens must be contiguous and in order in the flat batch, so
that a token s steps back among the new ones sits s rows earlier; padding rows only need a valid token_req.
"""

import torch


def shifted_tokens_batched(
    input_ids: torch.Tensor,
    token_req: torch.Tensor,
    token_local: torch.Tensor,
    ngram_context: torch.Tensor,
    eos_token_id: int,
    n: int,
) -> torch.Tensor:
    """input_ids [T]; token_req [T] request index of each token; token_local [T] index of the token among its
    request's new tokens; ngram_context [R, >= n-1] oldest first. Returns [T, n] int64."""
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
