"""Sampling with vLLM's semantics.

Order per row: a structured-output request's grammar mask first sets the ids its grammar forbids to -inf, in the
logits as they come (vLLM applies the grammar bitmask before its sampler, so logprobs see it: a forbidden id has
logprob -inf); logprobs are taken from these logits (vLLM's default `raw_logprobs`); then the tokens a request may
not sample are masked (outside allowed_token_ids, bad words), then logit_bias and min_tokens masking, repetition /
frequency / presence penalties; greedy rows take the argmax; the rest are divided by the temperature, filtered by
min_p, top_k and top_p, and sampled with the exponential race argmax(p / q), q ~ Exp(1). A request with a seed
draws q from its own generator, so its tokens do not depend on what else is in the batch. A row whose masks
together allow nothing samples an arbitrary id; a grammar's matcher rejects it and ends the sequence (see
output_processor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request, SamplingParams
from .step_builder import to_device
from .structured_output import GrammarMask


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each sampled token
    ranks: list[int]  # 1-based rank of the sampled token under the raw distribution
    topk_ids: list[list[int]]  # per row, the k most likely ids (k = the request's logprobs), else []
    topk_logprobs: list[list[float]]


def apply_penalties(logits: torch.Tensor, requests: list[Request], stop_ids: list[list[int]]) -> torch.Tensor:
    """vLLM's logits processors in its order, in place: logit_bias; min_tokens (the request's stop ids masked while
    it has fewer output tokens); the repetition penalty over prompt and output ids (positive logits divided by it,
    the others multiplied); frequency and presence penalties over output ids. Each is one batched operation over
    the rows that use it, its ids brought to the device in one copy (not a few launches and a synchronising copy
    per row)."""
    vocab, dev = logits.shape[-1], logits.device
    bias, banned, repeat, penal = [], [], [], []
    seen, seen_lens, outputs, output_lens = [], [], [], []  # ids (in range: prompts are checked on admission)
    for i, req in enumerate(requests):
        p = req.params
        bias += [(i, t, v) for t, v in (p.logit_bias or {}).items() if 0 <= t < vocab]
        if len(req.output_token_ids) < p.min_tokens:
            banned += [(i, t) for t in stop_ids[i] if 0 <= t < vocab]  # ids past the vocabulary are never sampled
        if p.repetition_penalty != 1.0:
            seen += req.prompt_token_ids
            seen += req.output_token_ids
            seen_lens.append(len(req.prompt_token_ids) + len(req.output_token_ids))
            repeat.append((i, p.repetition_penalty))
        if (p.frequency_penalty or p.presence_penalty) and req.output_token_ids:
            outputs += req.output_token_ids
            output_lens.append(len(req.output_token_ids))
            penal.append((i, p.frequency_penalty, p.presence_penalty))
    if bias:
        rows, ids, values = zip(*bias)
        index = to_device([rows, ids], dev, torch.long)
        logits.index_put_((index[0], index[1]), to_device(values, dev, logits.dtype), accumulate=True)
    if banned:
        index = to_device(list(zip(*banned)), dev, torch.long)
        logits[index[0], index[1]] = float("-inf")
    if repeat:
        rows, factor = zip(*repeat)
        rows, factor = to_device(rows, dev, torch.long), to_device(factor, dev, logits.dtype)[:, None]
        mask = torch.zeros(len(repeat), vocab, dtype=torch.bool, device=dev)
        mask[_rows_of(seen_lens, dev), to_device(seen, dev, torch.long)] = True
        picked = logits[rows]
        logits[rows] = torch.where(mask, torch.where(picked > 0, picked / factor, picked * factor), picked)
    if penal:
        rows, frequency, presence = zip(*penal)
        rows = to_device(rows, dev, torch.long)
        counts = torch.zeros(len(penal), vocab, dtype=logits.dtype, device=dev)
        counts.index_put_((_rows_of(output_lens, dev), to_device(outputs, dev, torch.long)),
                          torch.ones(len(outputs), dtype=logits.dtype, device=dev), accumulate=True)
        frequency = to_device(frequency, dev, logits.dtype)[:, None]
        presence = to_device(presence, dev, logits.dtype)[:, None]
        logits[rows] -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def _rows_of(lengths: list[int], device) -> torch.Tensor:
    """Row r repeated lengths[r] times, for the ids laid out row after row (the output size given, so no wait for
    the device)."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), to_device(lengths, device, torch.long),
                                   output_size=sum(lengths))


def reads_history(p) -> bool:
    """Whether sampling this request depends on its previous ids (min_tokens, penalties, multi-token bad words)."""
    return bool(p.min_tokens or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
                or (p.bad_words_token_ids and any(len(w) > 1 for w in p.bad_words_token_ids)))


def _has_mask(p) -> bool:
    """Whether the request has tokens it may never sample (outside allowed_token_ids, one-token bad words)."""
    return p.allowed_token_ids is not None or bool(p.bad_words_token_ids and any(len(w) == 1
                                                                                  for w in p.bad_words_token_ids))


def _adjusts_logits(p) -> bool:
    """Whether the sampler may change this request's row (else the raw logits are used without a copy)."""
    return bool(p.logit_bias) or p.allowed_token_ids is not None or bool(p.bad_words_token_ids) or reads_history(p)


def banned_next(req: Request) -> list[int]:
    """The last tokens of the request's multi-token bad words whose other tokens are its last generated ones."""
    out, n = req.output_token_ids, len(req.output_token_ids)
    return [w[-1] for w in req.params.bad_words_token_ids or ()
            if 1 < len(w) <= n + 1 and out[n - len(w) + 1:] == w[:-1]]


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p on non-greedy rows (masked entries become -inf)."""
    temps = to_device([p.temperature for p in params], logits.device, logits.dtype)
    logits = logits / temps[:, None]
    # the branches test the host-side parameters: a test on a device tensor would wait for the GPU
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], logits.device, logits.dtype)
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    top_k = [p.top_k for p in params]
    if any(top_k) or any(p.top_p < 1 for p in params):
        top_p = to_device([p.top_p for p in params], logits.device, logits.dtype)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = to_device([min(k, vocab) if k > 0 else vocab for k in top_k], logits.device)
        pos = torch.arange(vocab, device=logits.device)[None, :]
        drop = pos >= k[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop |= (before >= top_p[:, None]) & (pos > 0)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


class Sampler:
    def __init__(self, device, seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        self.masks: dict[str, torch.Tensor] = {}

    def generator_for(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        g = self.request_generators.get(req.request_id)
        if g is None:
            seed = req.params.seed + req.index  # n > 1 children get distinct streams, as in vLLM
            g = self.request_generators[req.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return g

    def release(self, req: Request) -> None:
        self.request_generators.pop(req.request_id, None)
        self.masks.pop(req.request_id, None)

    def mask_for(self, req: Request, vocab: int) -> torch.Tensor:
        """[vocab] bool, True at the ids the request may never sample; built on the device once per request."""
        mask = self.masks.get(req.request_id)
        if mask is None:
            p = req.params
            allowed = p.allowed_token_ids
            mask = torch.full((vocab,), allowed is not None, dtype=torch.bool, device=self.device)
            if allowed is not None:
                mask[to_device(allowed, self.device, torch.long)] = False
            singles = [w[0] for w in p.bad_words_token_ids or () if len(w) == 1]
            if singles:
                mask[to_device(singles, self.device, torch.long)] = True
            self.masks[req.request_id] = mask
        return mask

    def apply_bans(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """-inf, in place, at the ids each row may not sample now: its mask (mask_for) and the last tokens of the bad
        words its last tokens started. One masked fill and one scatter for the batch; no host reads."""
        rows = [i for i, r in enumerate(requests) if _has_mask(r.params)]
        if rows:
            masks = torch.stack([self.mask_for(requests[i], logits.shape[-1]) for i in rows])
            if len(rows) == len(requests):
                logits.masked_fill_(masks, float("-inf"))
            else:
                index = to_device(rows, logits.device, torch.long)
                logits[index] = logits[index].masked_fill(masks, float("-inf"))
        pairs = [(i, t) for i, r in enumerate(requests) if r.params.bad_words_token_ids for t in banned_next(r)]
        if pairs:
            index = to_device(list(zip(*pairs)), logits.device, torch.long)
            logits[index[0], index[1]] = float("-inf")

    def __call__(self, logits: torch.Tensor, requests: list[Request], stop_ids: list[list[int]]) -> SamplerOutput:
        """logits: [B, V] raw logits (fp32 from the model; a narrower dtype is widened to fp32 for everything but
        the argmax of greedy rows), one row per request that samples this step."""
        return self.sample(logits, requests, stop_ids).to_host()

    def sample(self, logits: torch.Tensor, requests: list[Request], stop_ids: list[list[int]],
               grammar_mask: GrammarMask | None = None) -> "SampledBatch":
        """Like __call__ but leaves the results on the device (no host sync), so the next step can be launched
        before they are read; the sampled ids can feed that step directly (`SampledBatch.token_ids`).
        `grammar_mask` (structured output) is applied to `logits` in place."""
        if grammar_mask is not None:
            grammar_mask.apply(logits)
        raw_logits = logits
        if any(_adjusts_logits(r.params) for r in requests):
            logits = logits.to(torch.float32, copy=True)
            self.apply_bans(logits, requests)
            logits = apply_penalties(logits, requests, stop_ids)
        sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        # widening is exact and order-preserving, so greedy rows take the argmax of the logits as they come
        if not sampled_rows:
            tokens = logits.argmax(-1)
        else:
            # a batch without greedy rows needs neither that vocab-wide argmax nor a gather of its rows
            every_row = len(sampled_rows) == len(requests)
            rows = None if every_row else to_device(sampled_rows, logits.device)
            picked = logits if every_row else logits[rows]
            probs = torch.softmax(_filter(picked.float(), [requests[i].params for i in sampled_rows]), dim=-1)
            q = torch.empty_like(probs)
            # unseeded rows share the engine's generator: one launch for all of them, not one per row (64 launches
            # per step at batch 64); seeded rows draw from their own generator so their tokens ignore the batch
            shared = [j for j, i in enumerate(sampled_rows) if requests[i].params.seed is None]
            if len(shared) == len(sampled_rows):
                q.exponential_(generator=self.generator)
            elif shared:
                q[to_device(shared, q.device)] = torch.empty(len(shared), q.shape[1], dtype=q.dtype,
                                                             device=q.device).exponential_(generator=self.generator)
            for j, i in enumerate(sampled_rows):
                if requests[i].params.seed is not None:
                    q[j].exponential_(generator=self.generator_for(requests[i]))
            drawn = probs.div_(q).argmax(-1)
            if every_row:
                tokens = drawn
            else:
                tokens = logits.argmax(-1)
                tokens[rows] = drawn
        ks = [r.params.logprobs for r in requests]
        if all(k is None for k in ks):  # nobody reads logprobs or ranks: skip the vocab-wide passes
            return SampledBatch(tokens, None, None, None, ks).start_copy()
        raw_logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        ranks = (raw_logprobs > chosen[:, None]).sum(-1) + 1
        max_k = max(k or 0 for k in ks)
        top = raw_logprobs.topk(min(max_k, logits.shape[-1]), dim=-1) if max_k else None
        return SampledBatch(tokens, chosen, ranks, top, ks).start_copy()


@dataclass
class SampledBatch:
    """One step's samples, still on the device. Rows follow the requests passed to `Sampler.sample`."""

    token_ids: torch.Tensor  # [B] long
    chosen: torch.Tensor | None  # raw logprob of each sampled token (None when no row asked for logprobs)
    ranks: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None  # (values, ids) of the largest k any row asked for
    ks: list[int | None]  # each row's `logprobs`
    _host: list | None = None  # host copies of the tensors above (on the GPU pinned, in flight until `_ready`)
    _ready: torch.cuda.Event | None = None

    def _tensors(self) -> list[torch.Tensor | None]:
        top = self.top if self.top is not None else (None, None)
        return [self.token_ids, self.chosen, self.ranks, *top]

    def start_copy(self) -> "SampledBatch":
        """Starts copying the samples to the host as they are now: the tensors may be a graph's outputs, which a
        step launched before the host reads these overwrites. On the GPU into pinned host memory behind an event (a
        plain `.tolist()` would wait for the whole stream, including that next step, so the device would idle
        during every step's host work); on the CPU a copy."""
        tensors = self._tensors()
        if not self.token_ids.is_cuda:
            self._host = [None if t is None else t.clone() for t in tensors]
            return self
        self._host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(self._host, tensors):
            if t is not None:
                h.copy_(t, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()
        return self

    def to_host(self) -> SamplerOutput:
        if self._ready is not None:
            self._ready.synchronize()
        token_ids, chosen, ranks, top_vals, top_ids = self._host
        tokens = token_ids.tolist()
        n = len(tokens)
        if chosen is None:
            return SamplerOutput(tokens, [0.0] * n, [0] * n, [[] for _ in range(n)], [[] for _ in range(n)])
        topk_ids, topk_lps = [[] for _ in range(n)], [[] for _ in range(n)]
        if top_vals is not None:
            vals, ids = top_vals.tolist(), top_ids.tolist()
            for i, k in enumerate(self.ks):
                topk_ids[i], topk_lps[i] = ids[i][: k or 0], vals[i][: k or 0]
        return SamplerOutput(tokens, chosen.tolist(), ranks.tolist(), topk_ids, topk_lps)


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int):
    """Raw logprobs of `next_tokens` under each row, their ranks, and the top-k. Returns python lists."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(next_tokens, device=lp.device)
    chosen = lp.gather(1, tgt[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    if k:
        vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    else:
        vals = ids = [[] for _ in next_tokens]
    return chosen.tolist(), ranks.tolist(), ids, vals
