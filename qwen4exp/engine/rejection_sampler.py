"""Verification of speculative drafts: which drafted tokens a step keeps, and the token after them, such that the
output is distributed exactly as sampling without speculation.

A verified request brings its last sampled token and n drafts d_1..d_n; the target's logits rows 0..n give, at row j,
the distribution p_j of the token after d_j (row 0: after the sampled token). p_j is the distribution the sampler
would sample from there (engine/sampler.py: bans, logit_bias, min_tokens, penalties, temperature, min_p, top_k,
top_p), with d_1..d_j counted as generated. The drafts are greedy (the draft layer's argmax, as vLLM drafts), so
the draft distribution q_j is one-hot at d_{j+1}, and the standard rejection sampler reads:

    for j = 0 .. n-1:  accept d_{j+1} with probability min(1, p_j(d) / q_j(d)) (here p_j(d));
                       on rejection emit a token from normalized max(0, p_j - q_j) and stop;
    all accepted:      emit a bonus token from p_n.

Each emitted token is then distributed as p_j, so the sequence is distributed as the target's (Leviathan et al.,
2023). A greedy request accepts while the draft equals the argmax and emits the argmax: the tokens decoding would
give. Random numbers come from the request's generator when it has a seed (uniforms for its draft rows, then one
exponential race per row, in row order), else from the engine's: a seeded request's tokens do not depend on its
batch. Logprobs are those of the raw logits at each emitted token's row, as without speculation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .. import ops
from .request import Request, SamplingParams
from .sampler import SampledBatch, Sampler, SamplerOutput, _adjusts_logits, _filter, apply_penalties, reads_history
from .step_builder import to_device


@dataclass
class RowView:
    """A request as sampling sees it at one verified row: the drafts before the row count as generated (penalties,
    min_tokens and bad words read them); its id and index keep its generator and token mask."""

    request_id: str
    index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """The probability of keeping a draft: min(1, p/q) of the target's (p) and the drafter's (q) probability of it."""
    return torch.clamp(p_draft / q_draft, max=1.0)


@dataclass
class VerifiedBatch:
    """One step's verification, still on the device. rows: a SampledBatch over every verified row (row j's token:
    d_{j+1} where accepted, else the emitted one); num_accepted [R]: accepted drafts per request."""

    rows: SampledBatch
    num_accepted: torch.Tensor
    num_rows: list[int]  # rows per request (1 + its drafts)
    _host: torch.Tensor | None = None
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> VerifiedBatch:
        """As SampledBatch.start_copy."""
        self.rows.start_copy()
        if not self.num_accepted.is_cuda:
            self._host = self.num_accepted.clone()
            return self
        self._host = torch.empty(self.num_accepted.shape, dtype=self.num_accepted.dtype, pin_memory=True)
        self._host.copy_(self.num_accepted, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()
        return self

    def to_host(self) -> tuple[SamplerOutput, list[int]]:
        """(the rows' samples, accepted drafts per request)."""
        out = self.rows.to_host()
        if self._ready is not None:
            self._ready.synchronize()
        return out, self._host.tolist()


def greedy_acceptance(tokens: torch.Tensor, meta, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy verification on the device, fixed shapes (it runs inside the speculative CUDA graphs): the drafts each
    request of the step keeps if it decodes greedily from the raw logits, [R] long (`ops.acceptance`). tokens: the
    argmax of the rows `rows` of the step (None: all T rows), which hold every row of a verified request."""
    if meta.state_token_slots is None:
        return torch.zeros(meta.num_reqs, dtype=torch.long, device=tokens.device)
    return ops.acceptance.greedy_acceptance(tokens, meta.state_token_slots, meta.input_ids, meta.token_local,
                                            meta.token_req, meta.num_reqs, rows)


class RejectionSampler:
    """Verifies drafts with `sampler`'s logit processing, generators and token masks."""

    @staticmethod
    def greedy_only(requests: list[Request]) -> bool:
        """Whether `greedy_acceptance` verifies these requests: greedy from the raw logits, without logprobs."""
        return all(r.params.greedy and not _adjusts_logits(r.params) and r.params.logprobs is None for r in requests)

    @staticmethod
    def verify_greedy(tokens: torch.Tensor, num_accepted: torch.Tensor, num_rows: list[int]) -> VerifiedBatch:
        """`verify` for `greedy_only` requests from the step's own greedy verification (inside its graph): tokens
        [N] the argmax of each request's rows (the emitted token, equal to the draft where accepted) and
        num_accepted [R] from `greedy_acceptance`."""
        return VerifiedBatch(SampledBatch(tokens, None, None, None, [None] * sum(num_rows)), num_accepted,
                             num_rows).start_copy()

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._layouts: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def verify(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
               stop_ids: list[list[int]], draft_ids: torch.Tensor | None = None) -> VerifiedBatch:
        """logits: [N, V] raw fp32 logits, request i owning the next 1 + len(drafts[i]) rows (its last token's, then
        each draft's). A request without drafts samples one token, as the sampler would. draft_ids: each row's draft
        on the device (-1: none), where the drafts' values are not on the host (`drafts` then only count them; no
        request may adjust its logits from its history, see `reads_history`)."""
        device = logits.device
        num_rows = [1 + len(d) for d in drafts]
        starts = list(itertools.accumulate(num_rows, initial=0))[:-1]
        row_params = [req.params for req, m in zip(requests, num_rows) for _ in range(m)]
        n = len(row_params)
        raw = logits
        if any(_adjusts_logits(req.params) for req in requests):
            history = any(reads_history(req.params) for req in requests)
            assert draft_ids is None or not history, "rows reading the drafts as history need their values on the host"
            # rows as sampling sees them (the drafts before a row count as generated): built only here, a copy of
            # the output so far per row where some request reads it (penalties, min_tokens, multi-token bad words);
            # logit_bias and token masks do not depend on it
            views = [RowView(req.request_id, req.index, req.params, req.prompt_token_ids,
                             req.output_token_ids + ds[:j] if history else req.output_token_ids)
                     for req, ds in zip(requests, drafts) for j in range(len(ds) + 1)]
            logits = logits.to(torch.float32, copy=True)
            self.sampler.apply_bans(logits, views)
            logits = apply_penalties(logits, views, [stops for stops, m in zip(stop_ids, num_rows) for _ in range(m)])
        draft = draft_ids if draft_ids is not None else to_device([t for ds in drafts for t in (*ds, -1)], device,
                                                                  torch.long)
        has_draft = draft >= 0
        safe_draft = draft.clamp_min(0)
        tokens = logits.argmax(-1)  # greedy rows: the argmax is both the check and the emitted token
        accept = has_draft & (tokens == draft)
        sampled = [i for i, p in enumerate(row_params) if not p.greedy]
        if sampled:
            rows = sampled if len(sampled) < n else None
            index = to_device(sampled, device, torch.long) if rows is not None else None
            picked = logits if rows is None else logits[index]
            p = torch.softmax(_filter(picked.float(), [row_params[i] for i in sampled]), dim=-1)
            d, has = (safe_draft, has_draft) if rows is None else (safe_draft[index], has_draft[index])
            u, e = self._random(requests, drafts, starts, sampled, p.shape)
            # greedy drafts: q is one-hot at the draft, so q(d) = 1 and max(0, p - q) is p without d; the last row
            # has no draft (q = 0): the bonus token, from p
            p_draft = p.gather(1, d[:, None])[:, 0]
            accepted = has & (u < acceptance_probability(p_draft, torch.ones_like(p_draft)))
            p.scatter_(1, d[:, None], torch.where(has, 0.0, p_draft)[:, None])  # rows without a draft: unchanged
            # the exponential race argmax(w / E), E ~ Exp(1), samples from w normalized
            emitted = p.div_(e).argmax(-1)
            if rows is None:
                accept, tokens = accepted, emitted
            else:
                accept = accept.clone()
                accept[index], tokens[index] = accepted, emitted
        # accepted drafts per request: the leading run of accepted rows
        grid, local, row_req = self._layout(tuple(num_rows), device)
        padded = torch.cat([accept, accept.new_zeros(1)])[grid]
        num_accepted = padded.long().cumprod(-1).sum(-1)
        out = torch.where(local < num_accepted[row_req], draft, tokens)
        ks = [p.logprobs for p in row_params]
        if all(k is None for k in ks):
            batch = SampledBatch(out, None, None, None, ks)
        else:
            raw_logprobs = torch.log_softmax(raw.float(), dim=-1)
            chosen = raw_logprobs.gather(1, out[:, None])[:, 0]
            ranks = (raw_logprobs > chosen[:, None]).sum(-1) + 1
            max_k = max(k or 0 for k in ks)
            top = raw_logprobs.topk(min(max_k, raw.shape[-1]), dim=-1) if max_k else None
            batch = SampledBatch(out, chosen, ranks, top, ks)
        return VerifiedBatch(batch, num_accepted, num_rows).start_copy()

    def _layout(self, num_rows: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For requests of num_rows rows each: each request's rows padded to the widest with row n (past the last),
        each row's index within its request, and its request; kept per shape (a decode batch repeats its shape)."""
        key = (num_rows, str(device))
        if key not in self._layouts:
            if len(self._layouts) >= 64:
                self._layouts.clear()
            n, width = sum(num_rows), max(num_rows)
            starts = itertools.accumulate(num_rows, initial=0)
            grid = [[s + j if j < m else n for j in range(width)] for s, m in zip(starts, num_rows)]
            self._layouts[key] = (to_device(grid, device, torch.long),
                                  to_device([j for m in num_rows for j in range(m)], device, torch.long),
                                  to_device([i for i, m in enumerate(num_rows) for _ in range(m)], device, torch.long))
        return self._layouts[key]

    def _random(self, requests, drafts, starts, sampled: list[int], shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniforms for the draft rows and exponentials [len(sampled), V] for every row of `sampled` (positions in
        the step's rows): a seeded request's from its own generator, its uniforms first, then its rows in order."""
        device = self.sampler.device
        u = torch.empty(shape[0], device=device)
        e = torch.empty(shape, device=device)
        where = {row: i for i, row in enumerate(sampled)}
        shared = []
        for req, ds, start in zip(requests, drafts, starts):
            if start not in where:  # a greedy request
                continue
            first, m = where[start], len(ds) + 1
            if req.params.seed is None:
                shared.append((first, m))
                continue
            g = self.sampler.generator_for(req)
            if ds:
                u[first: first + m - 1] = torch.rand(m - 1, generator=g, device=device)
            u[first + m - 1] = 0.0
            for i in range(first, first + m):
                e[i].exponential_(generator=g)
        if shared:
            g = self.sampler.generator
            if len(shared) == len(requests) and sum(m for _, m in shared) == shape[0]:
                u.uniform_(generator=g)
                e.exponential_(generator=g)
            else:
                index = to_device([i for first, m in shared for i in range(first, first + m)], device, torch.long)
                u[index] = torch.rand(index.numel(), generator=g, device=device)
                e[index] = torch.empty(index.numel(), shape[1], device=device).exponential_(generator=g)
        return u, e
