"""Vectorised shifted tokens against the per-request reference."""

import pytest
import torch

from qwen4exp.ops.ngram import shifted_tokens_batched
from qwen4exp.ops.ngram import shifted_tokens_ref as shifted_tokens

EOS = 2


def _random_batch(gen, num_reqs, n, vocab, max_len):
    lens = torch.randint(0, max_len + 1, (num_reqs,), generator=gen)
    lens[0] = max(int(lens[0]), 1)
    query_start_loc = [0] + torch.cumsum(lens, 0).tolist()
    total = query_start_loc[-1]
    # a tiny vocabulary makes EOS (and EOS runs) frequent
    input_ids = torch.randint(0, vocab, (total,), generator=gen)
    context = torch.randint(0, vocab, (num_reqs, n - 1), generator=gen)
    short = torch.rand(num_reqs, generator=gen) < 0.3  # requests with fewer than n-1 committed tokens: EOS padded
    keep = torch.randint(0, n, (num_reqs,), generator=gen)
    pad = short[:, None] & (torch.arange(n - 1)[None, :] < (n - 1 - keep)[:, None])
    context = torch.where(pad, torch.full_like(context, EOS), context)
    token_req = torch.repeat_interleave(torch.arange(num_reqs), lens)
    token_local = torch.arange(total) - torch.tensor(query_start_loc[:-1])[token_req]
    return input_ids, query_start_loc, context, token_req, token_local


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("seed", range(5))
def test_matches_reference(n, seed):
    gen = torch.Generator().manual_seed(seed * 10 + n)
    for vocab in (4, 6, 50):
        input_ids, qsl, context, token_req, token_local = _random_batch(gen, num_reqs=7, n=n, vocab=vocab, max_len=9)
        ref = shifted_tokens(input_ids, qsl, context, EOS, n)
        fast = shifted_tokens_batched(input_ids, token_req, token_local, context, EOS, n)
        assert fast.dtype == torch.int64
        assert torch.equal(fast, ref)


def test_single_token_decode_and_wide_context():
    """Decode (one token per request) and a context wider than n-1 (only its first n-1 columns are used)."""
    gen = torch.Generator().manual_seed(7)
    n, num_reqs = 3, 6
    input_ids = torch.tensor([5, EOS, 7, 3, EOS, 9])
    context = torch.randint(0, 5, (num_reqs, 4), generator=gen)
    context[1, 1] = EOS
    qsl = list(range(num_reqs + 1))
    ref = shifted_tokens(input_ids, qsl, context, EOS, n)
    fast = shifted_tokens_batched(input_ids, torch.arange(num_reqs), torch.zeros(num_reqs, dtype=torch.long),
                                  context, EOS, n)
    assert torch.equal(fast, ref)
