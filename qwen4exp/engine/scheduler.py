"""Continuous batching over a token budget. Pure CPU bookkeeping: it hands out pages and state slots (integers, from
a CacheAllocator) and never touches tensors.

Each step gets `max_num_batched_tokens`. Running requests go first, decodes (one token left to compute) before
chunked prefills, then waiting requests are admitted in arrival order while the budget, `max_num_seqs` and free
pages allow. When a running request needs a page and none is free, the newest running request is preempted: its
pages and slot are freed and it waits at the head of the queue to be recomputed from its tokens.

With k-token speculative decoding a decoding request brings its last sampled token and its drafts (as many as the
budget leaves), holds 1 + k state slots (engine/spec_decode.py) and, when its chunk ends at its last token, pages for
k positions more, which the draft layer writes while drafting after the step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..config import EngineConfig
from .cache import CacheAllocator
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    num_draft_tokens: int = 0  # of them, drafts verified after the request's last token (speculative decoding)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheAllocator):
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_spec = config.num_speculative_tokens

    def add(self, request: Request) -> None:
        request.queued_time = time.monotonic()
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, token_budget: int | None = None) -> SchedulerOutput:
        """The next step's requests and token counts; `token_budget` replaces max_num_batched_tokens for it."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens if token_budget is None else token_budget
        # decodes first, then running prefills, each group in arrival order
        queue = sorted(self.running,
                       key=lambda r: (r.num_tokens_with_pending - r.num_computed_tokens > 1, r.arrival_time))
        for req in queue:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted while making room for an earlier one
                continue
            if req.num_pending and req.stops_by_length(self.config.max_model_len):
                continue  # finishes once its pending token is read
            left = req.num_tokens_with_pending - req.num_computed_tokens
            if self.num_spec:
                drafts = min(len(req.draft_token_ids), budget - 1) if left == 1 else 0
                n = min(left + drafts, budget)
                need = self._needed(req, n, left)
            else:
                drafts, n = 0, min(left, budget)
                need = req.num_computed_tokens + n
            if not self._grow(req, need, out):
                continue
            out.scheduled.append(ScheduledRequest(req, n, drafts))
            budget -= n
        slots = 1 + self.num_spec
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if req.num_pending:  # preempted with a token in flight: recompute once its id is known
                break
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget)
            pages = self.cache.pages_needed(self._needed(req, n, left))
            if pages > self.cache.pages.num_free or self.cache.slots.num_free < slots:
                break
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            req.pages = self.cache.pages.allocate(pages)
            req.state_slot, *req.spare_slots = self.cache.slots.allocate(slots)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def _needed(self, req: Request, n: int, left: int) -> int:
        """Positions req's pages must cover to compute n more of its `left` uncomputed tokens: with speculative
        decoding, k more (within max_model_len) where the chunk reaches its last token, for drafting after it."""
        end = req.num_computed_tokens + n
        if self.num_spec and n >= left:
            return max(end, min(end + self.num_spec, self.config.max_model_len))
        return end

    def _grow(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make req hold pages for num_tokens, preempting the newest running requests if needed."""
        need = self.cache.pages_needed(num_tokens) - len(req.pages)
        while need > self.cache.pages.num_free:
            victim = max(self.running, key=lambda r: r.arrival_time)
            self._preempt(victim, out)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.cache.pages.allocate(need)
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        out.preempted.append(req)
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.cache.pages.free(req.pages)
        req.pages = []
        if req.state_slot is not None:
            self.cache.slots.free([req.state_slot, *req.spare_slots])
            req.state_slot, req.spare_slots = None, []

    def finish(self, req: Request) -> None:
        """Free everything a finished or aborted request holds."""
        if req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
