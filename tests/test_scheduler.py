"""The scheduler on its own: page and slot bookkeeping with integers only (no model, no tensors). Token budgets,
decodes before prefills, chunked prefill, max_num_seqs, preemption of the newest request when pages run out and its
recompute, tokens still on the device (async scheduling), and no page or slot leaked by finishing or aborting."""

import random

from qwen4exp.config import EngineConfig
from qwen4exp.engine.cache import CacheAllocator
from qwen4exp.engine.request import Request, RequestStatus, SamplingParams
from qwen4exp.engine.scheduler import Scheduler

PAGE = 4


def scheduler(num_pages=64, max_num_seqs=4, budget=16, max_model_len=64) -> Scheduler:
    config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          page_size=PAGE, num_pages=num_pages)
    return Scheduler(config, CacheAllocator(num_pages, max_num_seqs + 1, PAGE))


def request(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(3, 3 + prompt_len)), params, arrival_time=arrival, max_tokens=max_tokens)


def run(sched: Scheduler, out, pending: bool = False) -> list[Request]:
    """What the engine does with a scheduled step: the chunks' tokens become computed, and a request whose tokens
    are all computed samples one (read at once, or with `pending` left on the device); a request with max_tokens
    outputs is finished. Returns the finished requests."""
    done = []
    for s in out.scheduled:
        req = s.request
        if req.finished:  # its pending token ended it while this step ran: the engine drops the extra position
            continue
        req.num_computed_tokens += s.num_tokens
        if req.num_computed_tokens == req.num_tokens_with_pending:
            if pending:
                req.num_pending += 1
            else:
                req.output_token_ids.append(7)
        if len(req.output_token_ids) >= req.max_tokens:
            sched.finish(req)
            done.append(req)
    return done


def read_pending(sched: Scheduler, reqs) -> None:
    """The host reads the ids of the tokens in flight (one step later, under async scheduling)."""
    for req in reqs:
        while req.num_pending:
            req.num_pending -= 1
            req.output_token_ids.append(7)
        if len(req.output_token_ids) >= req.max_tokens and not req.finished:
            sched.finish(req)


def check_pages(sched: Scheduler) -> None:
    """Every running request holds pages for its computed tokens and a slot; no id is held twice or is null."""
    alloc = sched.cache
    held_pages = [p for r in sched.running for p in r.pages]
    held_slots = [r.state_slot for r in sched.running]
    assert len(set(held_pages)) == len(held_pages) and 0 not in held_pages
    assert len(set(held_slots)) == len(held_slots) and 0 not in held_slots and None not in held_slots
    assert len(held_pages) + alloc.pages.num_free == alloc.pages.num_usable
    assert len(held_slots) + alloc.slots.num_free == alloc.slots.num_usable
    for r in sched.running:
        assert len(r.pages) >= alloc.pages_needed(r.num_computed_tokens)
    for r in sched.waiting:
        assert r.pages == [] and r.state_slot is None and r.status == RequestStatus.WAITING


def test_chunked_prefill_within_the_token_budget():
    sched = scheduler(budget=16)
    req = request("a", 40, max_tokens=3)
    sched.add(req)
    steps = []
    while sched.has_unfinished():
        out = sched.schedule()
        steps.append([(s.request.request_id, s.num_tokens) for s in out.scheduled])
        for s in out.scheduled:  # pages for the tokens this step computes, no more
            assert len(s.request.pages) == sched.cache.pages_needed(s.request.num_computed_tokens + s.num_tokens)
        run(sched, out)
        check_pages(sched)
    assert steps == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)], [("a", 1)]]
    assert sched.cache.all_free()


def test_a_step_budget_argument_replaces_the_configured_budget_for_that_step():
    sched = scheduler(budget=16)
    sched.add(request("a", 40))
    assert sched.schedule(token_budget=5).num_tokens == 5
    assert sched.config.max_num_batched_tokens == 16


def test_decodes_first_then_running_prefills_then_waiting_in_arrival_order():
    sched = scheduler(budget=64, max_num_seqs=5)
    # admitted in queue order; running requests are then ordered by arrival time within each group
    for rid, prompt_len, arrival in (("decode-2", 3, 2.0), ("decode-1", 3, 1.0), ("prefill", 50, 0.0)):
        sched.add(request(rid, prompt_len, arrival=arrival))
    run(sched, sched.schedule(token_budget=20))  # both short prompts (they sample), 14 tokens of the long one
    for rid, arrival in (("late-1", 3.0), ("late-2", 4.0)):
        sched.add(request(rid, 5, arrival=arrival))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [
        ("decode-1", 1), ("decode-2", 1), ("prefill", 36), ("late-1", 5), ("late-2", 5)]
    assert out.num_tokens == 48


def test_max_num_seqs_bounds_the_running_batch():
    sched = scheduler(budget=64, max_num_seqs=2)
    reqs = [request(str(i), 6, max_tokens=2, arrival=i) for i in range(5)]
    for r in reqs:
        sched.add(r)
    finished = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert len(sched.running) <= 2
        finished += run(sched, out)
        check_pages(sched)
    assert [r.request_id for r in finished] == ["0", "1", "2", "3", "4"]  # admitted in arrival order
    assert sched.cache.all_free()


def test_newest_request_is_preempted_when_pages_run_out_and_recomputed():
    # 6 usable pages of 4 tokens: two requests of 10 prompt tokens take 3 pages each, enough up to 12 tokens; at 13
    # tokens the older one needs a fourth page and the newer one gives its pages up
    sched = scheduler(num_pages=7, budget=64, max_num_seqs=2)
    old, new = request("old", 10, max_tokens=8, arrival=0.0), request("new", 10, max_tokens=8, arrival=1.0)
    sched.add(old)
    sched.add(new)
    preempted = recomputed = False
    while sched.has_unfinished():
        out = sched.schedule()
        if out.preempted:
            assert out.preempted == [new] and not preempted
            preempted = True
            assert old.num_computed_tokens == 12 and len(old.pages) == 4
            assert new.status == RequestStatus.WAITING and sched.waiting[0] is new
            assert new.pages == [] and new.state_slot is None and new.num_computed_tokens == 0
            assert new.num_preemptions == 1 and sched.num_preemptions == 1
            assert [s.request for s in out.scheduled] == [old]
            outputs_so_far = len(new.output_token_ids)
        elif preempted and not recomputed and any(s.request is new for s in out.scheduled):
            # readmitted once pages are free: recomputes its prompt and its outputs so far from position 0
            assert old.finished
            (chunk,) = [s for s in out.scheduled if s.request is new]
            assert new.num_computed_tokens == 0 and chunk.num_tokens == 10 + outputs_so_far
            recomputed = True
        run(sched, out)
        check_pages(sched)
    assert preempted and recomputed
    assert len(old.output_token_ids) == len(new.output_token_ids) == 8
    assert sched.cache.all_free()


def test_tokens_in_flight_are_scheduled_and_bounded_by_length():
    """Async scheduling: a request whose sampled token is still on the device is scheduled with it (its chunk ends
    on the pending token); once its pending tokens reach max_tokens it is not scheduled again."""
    sched = scheduler(budget=64)
    req = request("a", 5, max_tokens=2)
    sched.add(req)
    run(sched, sched.schedule(), pending=True)  # prefill; its first token stays on the device
    assert req.num_pending == 1 and req.output_token_ids == []
    out = sched.schedule()
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(req, 1)]  # the pending token, fed from the device
    run(sched, out, pending=True)
    assert req.num_pending == 2 and req.stops_by_length(sched.config.max_model_len)
    assert sched.schedule().scheduled == []  # its second token already reaches max_tokens
    read_pending(sched, [req])
    assert req.finished and sched.cache.all_free()


def test_preempted_request_with_a_token_in_flight_waits_for_it():
    sched = scheduler(num_pages=7, budget=64, max_num_seqs=2)
    old, new = request("old", 10, max_tokens=8, arrival=0.0), request("new", 10, max_tokens=8, arrival=1.0)
    sched.add(old)
    sched.add(new)
    while not (out := sched.schedule()).preempted:
        read_pending(sched, [old, new])  # the previous step's ids arrive while this one runs
        run(sched, out, pending=True)
    assert new.status == RequestStatus.WAITING and new.num_pending == 1  # preempted before its last id was read
    sched.finish(old)  # pages for everyone
    assert sched.schedule().scheduled == [], "recomputing it needs its last token's id"
    read_pending(sched, [new])
    out = sched.schedule()
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(new, new.num_tokens)]


def test_finishing_and_aborting_at_any_time_leak_nothing():
    """Random arrivals, prompt lengths, budgets, async tokens and aborts (of waiting, running and preempted
    requests): the bookkeeping stays consistent every step and every page and slot comes back."""
    for seed in range(20):
        rng = random.Random(seed)
        sched = scheduler(num_pages=rng.randrange(17, 40), max_num_seqs=rng.randrange(1, 6),
                          budget=rng.randrange(1, 40))
        pending = rng.random() < 0.5
        arriving = [request(str(i), rng.randrange(1, 40), max_tokens=rng.randrange(1, 12), arrival=i)
                    for i in range(rng.randrange(5, 15))]
        live, aborted = [], set()
        for step in range(2000):
            if arriving and rng.random() < 0.5:
                live.append(arriving.pop(0))
                sched.add(live[-1])
            if live and rng.random() < 0.05:
                victim = rng.choice(live)
                if not victim.finished:
                    sched.finish(victim)
                    aborted.add(victim.request_id)
            out = sched.schedule()
            assert out.num_tokens <= sched.config.max_num_batched_tokens
            assert len(sched.running) <= sched.config.max_num_seqs
            if pending:  # the previous step's ids arrive while this one runs
                read_pending(sched, live)
            run(sched, out, pending)
            check_pages(sched)
            if not arriving and not sched.has_unfinished():
                break
        assert not arriving and not sched.has_unfinished(), seed
        assert sched.cache.all_free(), seed
        for r in live:
            assert r.finished
            if r.request_id not in aborted:
                assert len(r.output_token_ids) == r.max_tokens, seed


def test_reserve_takes_pages_for_every_request_or_none():
    """Pages reserved ahead of a step (a chained speculative step): each request gets the pages its positions need,
    the new columns reported; when the free pages do not cover them all, nothing is taken and nobody is preempted."""
    sched = scheduler(num_pages=12, budget=64)
    a, b = request("a", 9), request("b", 5)
    for req in (a, b):
        sched.add(req)
    run(sched, sched.schedule())
    held = {r.request_id: list(r.pages) for r in (a, b)}
    assert [len(p) for p in held.values()] == [3, 2]
    taken = sched.reserve([a, b], [13, 8])  # a: 4 pages, b: 2 (no change)
    assert taken == [(0, 3, a.pages[3:])] and a.pages[:3] == held["a"] and b.pages == held["b"]
    check_pages(sched)
    free = sched.cache.pages.num_free
    assert sched.reserve([a, b], [16 + 4 * free, 12]) is None  # one page short
    assert sched.cache.pages.num_free == free and len(a.pages) == 4 and len(b.pages) == 2
    assert sched.running == [a, b] and not sched.waiting
    check_pages(sched)
