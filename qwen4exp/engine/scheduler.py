"""Continuous batching over a token budget. Pure CPU bookkeeping: it hands out pages and state slots (integers, from
a CacheAllocator) and never touches tensors.

Each step gets `max_num_batched_tokens`. Running requests go first, decodes (one token left to compute) before
chunked prefills, then waiting requests are admitted in arrival order while the budget, `max_num_seqs` and free
pages allow. When a running request needs a page and none is free, the newest running request is preempted: its
pages and slot are freed and it waits at the head of the queue to be recomputed from its tokens.

With k-token speculative decoding a decoding request brings its last sampled token and its drafts (as many as the
budget leaves), holds 1 + k state slots (engine/spec_decode.py) and, when its chunk ends at its last token, pages for
k positions more, which the draft layer writes while drafting after the step.

With prefix caching (`cache.prefix`, engine/prefix_cache.py) a request admitted from the start looks up its prompt's
longest cached prefix that ends at a checkpoint, shares those pages, has the checkpoint's state copied into its slot
before the step (`SchedulerOutput.restores`) and computes only the rest. Its prefill chunks end at the page
boundaries it saves checkpoints at; the step's `saves` copy the state there into a checkpoint slot after the step,
and the pages before the boundary become findable for the requests admitted from the next step on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..config import EngineConfig
from .cache import CacheAllocator
from .prefix_cache import page_keys, salt_key
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
    # prefix caching: state slot copies (source, destination) before the step (checkpoint -> a resuming request's
    # slot) and after it (the slot of a request whose chunk ends at a checkpoint boundary -> the checkpoint)
    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    num_queried_tokens: int = 0  # of the requests admitted with a lookup: their tokens,
    num_hit_tokens: int = 0  # and those found cached

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
        self.prefix = cache.prefix  # None: no prefix caching

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
        at_checkpoint = []  # requests whose chunk ends at their next checkpoint boundary
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
                need = self._needed(req, n, left, req.num_computed_tokens)
            else:
                drafts, n = 0, min(left, budget)
                if req.checkpoint_positions:
                    n = self._to_checkpoint(req, req.num_computed_tokens, n, at_checkpoint)
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
            lookup = self.prefix is not None and req.num_computed_tokens == 0
            hit, restore = self._find_prefix(req) if lookup else ([], None)
            start = req.num_computed_tokens + len(hit) * self.cache.page_size
            left = req.num_tokens - start
            n = min(left, budget)
            ends = []
            if req.checkpoint_positions:
                n = self._to_checkpoint(req, start, n, ends)
            pages = self.cache.pages_needed(self._needed(req, n, left, start)) - len(hit)
            taken = self.prefix.num_evictable(hit) if hit else 0  # found pages nobody holds count as free
            if pages + taken > self.cache.pages.num_free or self.cache.slots.num_free < slots:
                break
            self.waiting.popleft()
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = start
            if hit:
                self.prefix.share(hit)
            req.pages = hit + self.cache.pages.allocate(pages)
            req.state_slot, *req.spare_slots = self.cache.slots.allocate(slots)
            req.num_computed_tokens = start
            if restore is not None:
                out.restores.append((restore, req.state_slot))
            if lookup:
                out.num_queried_tokens += req.num_tokens
                out.num_hit_tokens += start
            at_checkpoint += ends
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        if at_checkpoint:
            self._save_checkpoints(at_checkpoint, out)
        return out

    def _find_prefix(self, req: Request) -> tuple[list[int], int | None]:
        """The pages of req's longest cached prompt prefix that ends at a checkpoint, and that checkpoint's slot
        (None: no such prefix); sets the boundaries where req's prefill saves checkpoints: the prompt's last page
        boundary (its end when the prompt fills its last page, so no extra chunk), and the end of the cached pages it
        matched where no checkpoint ends them (a prefix computed before by another prompt). It resumes only before its
        last token, whose logits it needs. A request with prompt logprobs computes its whole prompt (as in vLLM), and
        saves its checkpoints."""
        ps = self.cache.page_size
        if req.page_keys is None:
            n = req.num_prompt_tokens // ps
            # image tokens share one id: a page holding (part of) an image is named by the image's content too
            extra = (None if req.mm is None else
                     ["".join(req.mm.extra_keys(i * ps, (i + 1) * ps)).encode() for i in range(n)])
            req.page_keys = page_keys(req.prompt_token_ids, ps, n, extra, salt_key(req.cache_salt))
        keys = req.page_keys
        usable = keys[:(req.num_prompt_tokens - 1) // ps]
        matched, resumable = (0, 0) if req.params.prompt_logprobs is not None else self.prefix.lookup(usable)
        boundaries = {len(keys), matched} if matched > resumable else {len(keys)}
        req.checkpoint_positions = sorted(b * ps for b in boundaries if b > resumable)
        if not resumable:
            return [], None
        return self.prefix.pages_of(keys[:resumable]), self.prefix.checkpoint_of(keys[resumable - 1])

    @staticmethod
    def _to_checkpoint(req: Request, start: int, n: int, ends: list[Request]) -> int:
        """n, or fewer tokens so that the chunk from `start` ends at req's next checkpoint boundary when it would
        pass it (then req joins `ends`)."""
        stop = req.checkpoint_positions[0] - start
        if n >= stop:
            ends.append(req)
            return stop
        return n

    def _save_checkpoints(self, reqs: list[Request], out: SchedulerOutput) -> None:
        """The checkpoints of the scheduled requests whose chunk ends at a checkpoint boundary: their pages up to
        it become findable and their state after the step is copied to a checkpoint slot (`out.saves`)."""
        ps, saves = self.cache.page_size, {}
        for req in reqs:
            if req.status != RequestStatus.RUNNING:  # preempted after it was scheduled
                continue
            n = req.checkpoint_positions.pop(0) // ps
            slot = self.prefix.save(req.page_keys[:n], req.pages[:n])
            if slot is not None:
                saves[slot] = req.state_slot  # a slot taken twice in one step keeps the later state
        out.saves = [(src, dst) for dst, src in saves.items()]

    def _needed(self, req: Request, n: int, left: int, start: int) -> int:
        """Positions req's pages must cover to compute n more of its `left` uncomputed tokens from `start`: with
        speculative decoding, k more (within max_model_len) where the chunk reaches its last token, for drafting
        after it."""
        end = start + n
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

    def reserve(self, reqs: list[Request], num_tokens: list[int]) -> list[tuple[int, int, list[int]]] | None:
        """Pages for reqs[i] to cover num_tokens[i] positions, without preempting anyone (a step launched before the
        one before it is read, engine/spec_decode.py); None, taking nothing, when too few are free. Returns (index
        in reqs, first new column of its pages, the new page ids) for each request that took pages."""
        needs = [max(0, self.cache.pages_needed(n) - len(r.pages)) for r, n in zip(reqs, num_tokens)]
        if sum(needs) > self.cache.pages.num_free:
            return None
        taken = []
        for i, (req, need) in enumerate(zip(reqs, needs)):
            if need:
                pages = self.cache.pages.allocate(need)
                taken.append((i, len(req.pages), pages))
                req.pages += pages
        return taken

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
