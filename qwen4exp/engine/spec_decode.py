"""Speculative decoding with the checkpoint's MTP draft layer (`--speculative-config '{"method": "mtp",
"num_speculative_tokens": k}'`, vLLM's flag).

One engine step with speculation:
1. the scheduler gives each decoding request its last sampled token and up to k drafts (scheduler.py), mixed with
   prefill chunks and plain decodes; verified requests run after the decodes (model/metadata.py);
2. the target computes every row once, returning its logits and the multi-stream states the draft layer reads;
3. rejection_sampler.py keeps a prefix of each request's drafts and emits one token after it (greedy: accept while
   equal), so outputs are distributed as without speculation;
4. the host commits the kept tokens through the output processor, token by token, so stop ids, EOS, stop strings,
   max_tokens, logprobs and min_tokens act as they would one token at a time: a stop inside the drafts ends the
   request there;
5. a proposer drafts the next tokens (MTPProposer). Its draft step 0 is queued behind the verification, before the
   host reads it, over every row of the step (prefill chunks included, so the draft layer's cache holds every
   position), each row fed the token after it on the device; the host reads the verification while the device
   drafts, commits, and then takes each request's draft at its last kept row (one wait for the device a step at
   k = 1); each further draft is one row per request, fed the draft before it. Where every request of the step
   samples there greedily inside its graph, the further draft steps are queued behind draft step 0 too, before the
   host reads the verification, their rows moved on the device to the positions it keeps (MTPProposer.draft_ahead).

Rollback. Attention caches (the target's and the draft layer's K/V, QSA raw and compressed keys) are written by
position: a rejected draft's rows are rewritten when its position is computed again, before any query reads them
(a query reads positions up to its own; a QSA block key is recomputed by the step whose row completes the block),
so they need no rollback. The n-gram context is built from committed tokens. The recurrent states (GDN recurrent
and conv state, PLE conv window) are kept once per draft position: a request holds 1 + k state slots, the verify
step stores the state after each row 0 .. n-1 into the request's spare slots (after the last row into its own slot,
as every step does), and the slot of the last kept row becomes the request's state slot.

Why slots rather than recomputation (one checkpoint per request, the kept rows computed again after a rejection):
storing a state is a copy, recomputing is a pass of the whole target over the kept rows, each token through its own
experts. On CPU (small preset, fp32, 200-token contexts, acceptance 0.6 per position) storing costs at most 1.8, 3.6
and 5.3 ms of a 68, 87 and 99 ms verify step at batch 8 for k = 1, 2, 3, while recomputation adds 0.4, 0.9 and 1.3
tokens on average to the next step: +7, +10 and +39 ms (batch 1: storing <= 0.7 ms, recomputing +0.7 to +5 ms).
On a GPU a stored state is a write of the state per GDN layer, draft and request (flash-next-128e: 3 MiB a layer,
~110 MiB a draft over its 36 GDN layers, ~25 us at an H200's bandwidth), a recomputed token a pass through ~10 more
experts per MoE layer; the price of the slots is memory, (1 + k) x the states per sequence (memory.py plans it).

CUDA graphs: with speculation every step returns the multi-stream states, so the runner replays speculative
mixed-layout graphs (cuda_graph.py) for decode and verify steps, and the draft layer's steps replay graphs of
their own (MTPProposer.graphs). The engine's asynchronous scheduling is off (a step's tokens are the ones the
previous step accepted, read by the host): instead the drafts stay on the device (DeviceDrafts) as the next step's
pending tokens, and the host's only wait a step is for the verification, while the device drafts. Where the steps
are uniform (every request verified with k drafts greedily inside the graph, nothing else waiting), the next step is
chained: launched before the host reads the current one, its layout derived on the device (`SpecDecoder.chain`),
so the host's work of a step runs while the device computes the next (the step then costs the larger of the two,
not their sum); a chained step's graph runs its draft step 0 too, and with k >= 2 its further draft steps follow
before the host reads anything (draft_ahead), so that the step after can chain in turn.

A request under a grammar (structured output) decodes without drafts, sampled under its grammar's mask as without
speculation, beside the others' verification: its mask at a draft's row would need its matcher advanced through
the drafts before it and rolled back after a rejection; it keeps the grammar's semantics and costs it only the
speedup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import EngineConfig
from ..model import ModelCache
from .rejection_sampler import RejectionSampler, VerifiedBatch
from .request import Request
from .sampler import SampledBatch, Sampler, SamplerOutput, reads_history
from .scheduler import SchedulerOutput
from .step_builder import RequestChunk, StepBuilder, fill_pending, to_device


@dataclass
class DraftEntry:
    """A request of the step just completed (its kept tokens committed), for the proposer: it wants num_drafts drafts
    after its last token; draft_row: its last kept row among draft step 0's wanted rows (-1: none), stream_row: that
    row among the step's rows."""

    request: Request
    num_drafts: int
    draft_row: int = -1
    stream_row: int = -1


@dataclass
class DraftBatch:
    entries: list[DraftEntry]
    launched: object = None  # what the proposer's `launch` returned for the step


@dataclass
class DeviceDrafts:
    """Drafts left on the device (a proposer's answer the host need not wait for): entry i's are ids[i * width:
    i * width + counts[i]]."""

    ids: torch.Tensor  # [entries * width]
    width: int
    counts: list[int]

    def tolist(self) -> list[list[int]]:
        flat = self.ids.tolist()
        return [flat[i * self.width: i * self.width + n] for i, n in enumerate(self.counts)]


class DeviceIds:
    """One tensor of ids gathered from several on the device, for a step's pending tokens."""

    def __init__(self):
        self.parts, self.size, self.offsets = [], 0, {}

    def offset(self, ids: torch.Tensor) -> int:
        """Where `ids` starts in the gathered tensor."""
        if id(ids) not in self.offsets:
            self.offsets[id(ids)] = self.size
            self.parts.append(ids)
            self.size += ids.numel()
        return self.offsets[id(ids)]

    def tensor(self) -> torch.Tensor | None:
        if len(self.parts) > 1:
            return torch.cat(self.parts)
        return self.parts[0] if self.parts else None


class Proposer:
    """Drafts for the engine. `launch` queues work behind a step's verification, before the host has read it (the
    draft layer's step 0); `propose` gives each entry's drafts once the step's tokens are committed."""

    def launch(self, chunks: list[RequestChunk], streams: torch.Tensor, next_ids: torch.Tensor | None):
        return None

    def draft_ahead(self, launched, rows: list[AheadRow], accepted: torch.Tensor, k: int,
                    shift: torch.Tensor | None = None) -> None:
        """May queue every draft of the next step behind `launched` (see MTPProposer.draft_ahead)."""

    def propose(self, batch: DraftBatch) -> list[list[int]] | DeviceDrafts:
        raise NotImplementedError


@dataclass
class AheadRow:
    """A request of a step whose drafts are made before the host reads it (MTPProposer.draft_ahead): the position of
    its first row that may be its last kept one (a verified request's first row, another's last), that row among
    draft step 0's wanted rows and among the step's rows, and how far its rows may move (the drafts it may keep;
    in a chained step those of the step before too)."""

    request: Request
    position: int
    draft_row: int
    stream_row: int
    max_shift: int


@dataclass
class DraftLaunch:
    """Draft step 0 on the device: the greedy draft at each wanted row and every row's states (a graph's output:
    valid until the draft layer's next replay); `ahead`: every draft of the next step where they were made before
    the host read the verification (MTPProposer.draft_ahead), request i's in row ahead_rows[id(request)]."""

    tokens: torch.Tensor
    streams: torch.Tensor
    ahead: torch.Tensor | None = None
    ahead_rows: dict[int, int] | None = None


class MTPProposer(Proposer):
    """Greedy drafts from the model's MTP layer (model/mtp.py's drafting contract), on the step's cache pages.
    `graphs`: the draft layer's CUDA graphs (cuda_graph.py, `draft=True`), which take every draft step that fits
    them; None: eager."""

    def __init__(self, model, cache: ModelCache, page_size: int, device, graphs=None):
        self.model, self.cache, self.device = model, cache, torch.device(device)
        self.builder = StepBuilder(model.config, page_size)
        # a graph runs MTP layer 0: with several MTP layers, draft steps cycle through them (eagerly)
        self.graphs = graphs if graphs is not None and len(model.mtp.layers) == 1 else None

    def _draft(self, chunks: list[RequestChunk], streams: torch.Tensor, pending: torch.Tensor | None, step: int):
        """One draft step: (the greedy draft of each wanted row, in chunk order; every row's new states)."""
        if self.graphs is not None and step == 0 and self.graphs.can_draft_on_step():
            return self.graphs.execute_draft_on_step(chunks, streams, pending)
        if self.graphs is not None and self.graphs.can_run(chunks):
            return self.graphs.execute_draft(chunks, streams, pending)
        layout = self.builder.build(chunks)
        meta = layout.to_metadata(self.device)
        fill_pending(meta.input_ids, layout.pending, pending)
        hidden, streams = self.model.draft(meta, self.cache, streams, step=step)
        return self.model.compute_logits(hidden[meta.logits_indices]).argmax(-1), streams

    @torch.inference_mode()
    def launch(self, chunks: list[RequestChunk], streams: torch.Tensor, next_ids: torch.Tensor | None) -> DraftLaunch:
        """Draft step 0 over every row of a step: `chunks` are the step's, each row fed the token after it (the
        prompt's, or one the step emits: rows of `next_ids`), `streams` the target's states of those rows."""
        return DraftLaunch(*self._draft(chunks, streams, next_ids, 0))

    @torch.inference_mode()
    def draft_ahead(self, launched: DraftLaunch, rows: list[AheadRow], accepted: torch.Tensor, k: int,
                    shift: torch.Tensor | None = None) -> None:
        """The further draft steps (1 .. k-1) of a step whose every request samples its next token there greedily on
        the device (`accepted`: the drafts each keeps), queued behind draft step 0 before the host reads the
        verification, so that the device drafts while the host reads and commits (else it waits for the host to
        launch each further draft step). Request r's draft j sits at rows[r].position + shift_r + j (shift: the
        drafts it keeps, a_r, unless given: a chained step's rows move by what the step before keeps too), laid out
        by the host for a shift of 0 and moved on the device (CUDAGraphRunner.execute_draft_shifted). Only on the
        draft layer's graphs, where every position a request may reach is in its pages and the graph's context bound
        is the same whatever the requests keep; else nothing is queued and `propose` drafts after the read."""
        g, n = self.graphs, len(rows)
        if g is None or k < 2 or not n:
            return
        page_size = self.builder.page_size
        if any(x.position + x.max_shift + k > len(x.request.pages) * page_size for x in rows):
            return
        chunks = [[RequestChunk([0], x.position + j, [], x.request.pages, x.request.state_slot, 0, pending_row=i)
                   for i, x in enumerate(rows)] for j in range(1, k)]
        low, high = max(x.position for x in rows), max(x.position + x.max_shift for x in rows)
        if not g.can_run(chunks[0]) or any(g.variant(low + j + 1) != g.variant(high + j + 1) for j in range(1, k)):
            return
        a = accepted[:n]
        shift = a if shift is None else shift
        device = a.device
        tokens = launched.tokens[to_device([x.draft_row for x in rows], device, torch.long) + a]
        streams = launched.streams[to_device([x.stream_row for x in rows], device, torch.long) + a]
        out = torch.empty(n, k, dtype=torch.long, device=device)
        out[:, 0] = tokens
        for j in range(1, k):
            tokens, streams = g.execute_draft_shifted(chunks[j - 1], streams, tokens, shift)
            out[:, j] = tokens
        launched.ahead, launched.ahead_rows = out, {id(x.request): i for i, x in enumerate(rows)}

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> DeviceDrafts:
        """Each entry's drafts, on the device: draft step 0's at its last kept row, then one row per request for
        each further draft, fed the draft before it (or those `draft_ahead` made). Nothing here waits for the
        device."""
        entries, first = batch.entries, batch.launched
        active = [i for i, e in enumerate(entries) if e.num_drafts]  # in the order of the rows of `tokens`, `streams`
        counts = [e.num_drafts for e in entries]
        width = max(counts, default=0)
        if not active:
            return DeviceDrafts(torch.zeros(0, dtype=torch.long, device=self.device), 0, counts)
        if first.ahead is not None:
            rows = [first.ahead_rows[id(e.request)] for e in entries]
            ahead = first.ahead if rows == list(range(first.ahead.shape[0])) else first.ahead[
                to_device(rows, self.device, torch.long)]
            return DeviceDrafts(ahead.reshape(-1), ahead.shape[1], counts)
        tokens = first.tokens[to_device([entries[i].draft_row for i in active], self.device, torch.long)]
        if width == 1 and len(active) == len(entries):
            return DeviceDrafts(tokens, 1, counts)
        out = torch.zeros(len(entries), width, dtype=torch.long, device=self.device)
        out[to_device(active, self.device, torch.long), 0] = tokens
        streams = first.streams[to_device([entries[i].stream_row for i in active], self.device, torch.long)]
        for j in range(1, width):
            keep = [r for r, i in enumerate(active) if entries[i].num_drafts > j]
            active = [active[r] for r in keep]
            chunks = []
            for r, i in zip(keep, active):
                req = entries[i].request
                # the row of position (the last kept row) + j, fed draft j
                chunks.append(RequestChunk([0], req.num_computed_tokens - 1 + j, [], req.pages, req.state_slot, 0,
                                           pending_row=r))
            if len(keep) < streams.shape[0]:
                streams = streams[to_device(keep, self.device, torch.long)]
            tokens, streams = self._draft(chunks, streams, tokens, j)
            out[to_device(active, self.device, torch.long), j] = tokens
        return DeviceDrafts(out.view(-1), width, counts)


@dataclass
class SpecStep:
    """A launched step with speculation: its spans (request, start, end, first logits position) for the output
    processor, the logits rows kept for prompt logprobs, the requests verified (or sampling without drafts) with
    their drafts, the verification on the device, the draft step queued behind it, and the requests sampled under a
    grammar."""

    spans: list[tuple[Request, int, int, int]]
    logits: torch.Tensor | None
    sample_reqs: list[Request]
    drafts: list[list[int]]
    verified: VerifiedBatch | None
    rows: list[int]  # each span's first row in the step
    draft_rows: list[int]  # each span's first row among draft step 0's wanted rows (-1: none)
    launched: object  # the proposer's draft step 0
    constrained: list[Request] = field(default_factory=list)  # sampled under a grammar's mask, one token each
    constrained_sampled: SampledBatch | None = None
    # a step the next one can be chained to (SpecDecoder.chain): the graph it replayed and its results on the device
    # (every row's argmax, the drafts each request keeps); None otherwise
    chain_key: tuple | None = None
    results: tuple[torch.Tensor, torch.Tensor] | None = None
    chained: bool = False  # the next step was launched before this one was read, with the drafts it made


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters of one step: verified requests with drafts, their drafts, the accepted ones,
    and the accepted ones per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1


class SpecDecoder:
    """The engine's speculative decoding: launches a step's verification and draft step 0, and completes it
    (commit, state slots, drafts). `proposer`: a Proposer (default: MTPProposer)."""

    def __init__(self, config: EngineConfig, model, cache: ModelCache, page_size: int, device, sampler: Sampler,
                 draft_graphs=None):
        self.k = config.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self.page_size = page_size
        self.rejection = RejectionSampler(sampler)
        self.proposer = MTPProposer(model, cache, page_size, device, draft_graphs)
        self.chained_steps = 0  # steps launched by `chain`: the benchmarks' share of steps that overlapped the host

    def launch(self, engine, sched: SchedulerOutput, mixed_graphs: bool = True) -> SpecStep:
        """Runs the target over the step's chunks and verifies the drafts, without waiting for either."""
        n_ctx = engine.model_config.ngram_size - 1
        # decodes, then verified requests, then prefill chunks: the runner's order, so the states' rows follow ours
        scheduled = sorted(sched.scheduled, key=lambda s: s.num_tokens != 1)
        self._read_drafts_for_adjusted_rows(scheduled)
        chunks, spans, rows, row = [], [], [], 0
        device_ids = DeviceIds()  # the drafts left on the device
        for s in scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_tokens
            drafts = req.draft_token_ids[: s.num_draft_tokens]
            first = start if drafts else engine._logits_from(req, start, end)
            pending_row = -1
            if drafts and req.drafts_on_device is not None:
                ids, offset = req.drafts_on_device
                pending_row = device_ids.offset(ids) + offset
            chunks.append(RequestChunk(
                token_ids=req.token_ids(start, end - len(drafts)) + drafts,
                context_len=start,
                history=req.token_ids(max(0, start - n_ctx), start),
                pages=req.pages,
                state_slot=req.state_slot,
                logits_from=first - start,
                pending_row=pending_row,
                num_pending=len(drafts) if pending_row >= 0 else 1,
                state_token_slots=req.spare_slots[: len(drafts)] if drafts else None,
            ))
            spans.append((req, start, end, first))
            rows.append(row)
            row += s.num_tokens
        pending_ids = device_ids.tensor()
        logits, streams, argmax, greedy_accepted = engine.runner.execute(chunks, pending_ids, mixed_graphs,
                                                                          return_streams=True)
        logit_rows, sample_reqs, sample_drafts, keep_logits, row = [], [], [], False, 0
        constrained_rows, constrained, sample_chunks = [], [], []
        for i, ((req, start, end, first), chunk) in enumerate(zip(spans, chunks)):
            keep_logits |= req.prompt_logprobs is not None and first < req.num_prompt_tokens - 1
            verified = chunk.state_token_slots is not None
            if req.grammar is not None and end == req.num_tokens:
                constrained_rows.append(row + end - first - 1)
                constrained.append(req)
            elif verified or end == req.num_tokens:
                n = end - start if verified else 1
                logit_rows += range(row + end - first - n, row + end - first)
                sample_reqs.append(req)
                sample_drafts.append(chunk.token_ids[1:] if verified else [])
                sample_chunks.append(i)
            req.num_computed_tokens = start if verified else end  # a verified request's is set once verified
            row += end - first
        verified = constrained_sampled = None
        all_rows = logit_rows == list(range(logits.shape[0]))
        in_graph = bool(sample_reqs) and self.rejection.greedy_only(sample_reqs)
        if in_graph:  # verified inside the step (its graph)
            tokens = argmax if all_rows else argmax[to_device(logit_rows, argmax.device)]
            accepted = (greedy_accepted[: len(sample_chunks)] if sample_chunks == list(range(len(sample_chunks)))
                        else greedy_accepted[to_device(sample_chunks, argmax.device)])
            verified = self.rejection.verify_greedy(tokens, accepted, [1 + len(d) for d in sample_drafts])
        elif sample_reqs:
            logits_s = logits if all_rows else logits[to_device(logit_rows, logits.device)]
            draft_ids = None
            if pending_ids is not None:  # each verified row's draft, gathered where the drafts are (-1: none)
                index = []
                for req, drafts in zip(sample_reqs, sample_drafts):
                    if drafts:
                        ids, offset = req.drafts_on_device
                        first_row = device_ids.offset(ids) + offset
                        index += range(first_row, first_row + len(drafts))
                    index.append(-1)
                index = to_device(index, logits.device, torch.long)
                draft_ids = torch.where(index >= 0, pending_ids[index.clamp_min(0)], -1)
            verified = self.rejection.verify(logits_s, sample_reqs, sample_drafts,
                                             [engine._stop_ids(r) for r in sample_reqs], draft_ids)
        if constrained:
            constrained_sampled = engine._sample(logits[to_device(constrained_rows, logits.device)], constrained,
                                                 list(range(len(constrained))))
        for req in sample_reqs + constrained:
            req.num_pending += 1
        # the next step can be chained to this one when every request is verified with k drafts from raw logits,
        # greedily (inside the graph), the draft layer runs on the step's graph buffers, the chained steps' graphs
        # are captured, and for k >= 2 the next step's drafts are made before the read (draft_ahead)
        graphs, drafter = engine.runner.graphs, getattr(self.proposer, "graphs", None)
        chain_key = None
        if (graphs is not None and graphs.chains and graphs.last_key is not None
                and drafter is not None and drafter.can_draft_on_step() and in_graph and not constrained
                and not keep_logits and len(sample_reqs) == len(spans) and all_rows
                and all(len(d) == self.k for d in sample_drafts)):
            chain_key = graphs.last_key
        launched, draft_rows = self._launch_draft(spans, chunks, streams, verified, constrained_sampled)
        if self.k > 1 and in_graph and not constrained and len(sample_reqs) == len(spans) and all_rows:
            if chain_key is not None:
                graphs.keep_layout()  # before the further draft steps overwrite it
            ahead = []
            for (req, start, end, _), row, draft_row, drafts in zip(spans, rows, draft_rows, sample_drafts):
                position = start if drafts else end - 1  # every request samples here, from this row on
                ahead.append(AheadRow(req, position, draft_row, row + position - start, len(drafts)))
            self.proposer.draft_ahead(launched, ahead, accepted, self.k)
        if self.k > 1 and getattr(launched, "ahead", None) is None:
            chain_key = None
        return SpecStep(spans, logits if keep_logits else None, sample_reqs, sample_drafts, verified, rows,
                        draft_rows, launched, constrained, constrained_sampled, chain_key,
                        (argmax, greedy_accepted) if chain_key else None)

    def chain(self, engine, step: SpecStep) -> SpecStep | None:
        """Launches the step after `step` before the host reads `step` (None, launching nothing, where it cannot):
        the host's work of a step (reading the verification, committing, scheduling, filling the graph's buffers)
        then overlaps the device's work of the next, instead of the device waiting for it. Each request's next
        step depends on how many of its drafts `step` keeps, which only the device knows yet: the next layout is
        derived there (CUDAGraphRunner.execute_chained), so a chain needs steps as the graphs replay them alike
        every time: the same requests, each verified with k drafts, greedily from raw logits (`chain_key`), nothing
        else waiting, no request within reach of max_model_len, and free pages for the positions the next step may
        reach. A request that finishes in `step` (a stop, or max_tokens) has run the chained step in vain (its tokens
        are dropped, as asynchronous scheduling drops a stopped request's extra token)."""
        if step.chain_key is None or engine.scheduler.waiting:
            return None
        reqs = step.sample_reqs
        if len(engine.scheduler.running) != len(reqs) or any(r.finished for r in reqs):
            return None
        k1 = 1 + self.k
        # the next step's rows sit at most 2(1 + k) positions past this step's first, and drafting writes k more;
        # the step after it gets k drafts whatever this step keeps (tokens past max_tokens are dropped as they are
        # committed: a request that reaches it in `step` runs the chained step in vain, as one that stops)
        reach, shortest, longest = [], 0, 0
        for r in reqs:
            if r.num_computed_tokens + 2 * k1 + self.k > self.max_model_len:
                return None
            shortest = max(shortest, r.num_computed_tokens + 1 + k1)
            longest = max(longest, r.num_computed_tokens + 2 * k1)
            reach.append(r.num_computed_tokens + 2 * k1 + self.k)
        # the graph's context bound as the host would choose it, whatever this step keeps
        graphs = engine.runner.graphs
        variant = graphs.variant(longest)
        if graphs.variant(shortest) != variant:
            return None
        pages = engine.scheduler.reserve(reqs, reach)
        if pages is None:
            return None
        key = (*step.chain_key[:2], variant)
        emitted, accepted = step.results
        before = accepted[: len(reqs)].clone() if self.k > 1 else None  # the replay overwrites it
        emitted, accepted, *drafted = graphs.execute_chained(key, len(reqs), pages, accepted, emitted,
                                                             step.launched.tokens, step.launched.ahead)
        launched = DraftLaunch(*drafted)
        verified = self.rejection.verify_greedy(emitted, accepted, [k1] * len(reqs))
        for r in reqs:
            r.num_pending += 1
        step.chained = True
        self.chained_steps += 1
        rows = [i * k1 for i in range(len(reqs))]
        if self.k > 1:  # the next step's drafts, before the host reads either step: so that it can chain in turn
            graphs.keep_layout()
            # request i's rows start at its position + 1 if `step` keeps no draft, and move by what both steps keep
            self.proposer.draft_ahead(launched, [AheadRow(r, r.num_computed_tokens + 1, row, row, 2 * self.k)
                                                 for r, row in zip(reqs, rows)], accepted, self.k,
                                      shift=before + accepted[: len(reqs)])
        return SpecStep(None, None, reqs, [[0] * self.k for _ in reqs], verified, rows, rows, launched,
                        chain_key=key if self.k == 1 or launched.ahead is not None else None,
                        results=(emitted, accepted))

    @staticmethod
    def _read_drafts_for_adjusted_rows(scheduled) -> None:
        """Drafts left on the device are read (waiting for it) when a request of the step adjusts its logits from its
        history (the rejection sampler's rows then see the drafts before them as generated: penalties, min_tokens,
        multi-token bad words; `reads_history`) or when a step would mix them with drafts on the host (a proposer that
        answered both ways)."""
        drafted = [s.request for s in scheduled if s.num_draft_tokens]
        on_device = [r for r in drafted if r.drafts_on_device is not None]
        if not on_device or (len(on_device) == len(drafted)
                             and not any(reads_history(s.request.params) for s in scheduled)):
            return
        for req in on_device:
            ids, offset = req.drafts_on_device
            req.draft_token_ids = ids[offset: offset + len(req.draft_token_ids)].tolist()
            req.drafts_on_device = None

    def _launch_draft(self, spans, chunks: list[RequestChunk], streams: torch.Tensor, verified: VerifiedBatch | None,
                      constrained_sampled: SampledBatch | None) -> tuple[object, list[int]]:
        """Queues draft step 0 over every row of the step, before the host reads the verification: row t is fed the
        token at t + 1, the prompt's or the one this step emits there (the verification's row, on the device); a
        verified request's draft is wanted at each of its rows, since the kept one is not known yet. Rows past a
        rejection write the draft layer's cache at positions that the next step computes again before any query
        reads them (as the target's rejected rows do). Returns (the proposer's launch, each span's first wanted
        row)."""
        parts = [x.token_ids for x in (verified.rows if verified else None, constrained_sampled) if x is not None]
        next_ids = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None
        draft_chunks, draft_rows, wanted, emitted, constrained = [], [], 0, 0, 0
        num_verified = verified.rows.token_ids.shape[0] if verified is not None else 0
        for (req, start, end, first), chunk in zip(spans, chunks):
            n = end - start
            if chunk.state_token_slots is not None:  # verified: every row's token comes from the verification
                token_ids, pending, num_pending, logits_from = [0] * n, emitted, n, 0
                emitted += n
            elif end == req.num_tokens:  # the last row's token is sampled by this step
                if req.grammar is not None:  # sampled under its grammar: no drafts
                    pending, logits_from = num_verified + constrained, n
                    constrained += 1
                else:
                    pending, logits_from = emitted, n - 1
                    emitted += 1
                token_ids, num_pending = req.token_ids(start + 1, end) + [0], 1
            else:  # a prompt chunk before the prompt's end: every next token is known
                token_ids, pending, num_pending, logits_from = req.token_ids(start + 1, end + 1), -1, 1, n
            draft_chunks.append(RequestChunk(token_ids, start, [], req.pages, req.state_slot, logits_from,
                                             pending_row=pending, num_pending=num_pending))
            draft_rows.append(wanted if logits_from < n else -1)
            wanted += n - logits_from
        return self.proposer.launch(draft_chunks, streams, next_ids), draft_rows

    def complete(self, engine, step: SpecStep) -> list:
        """Reads the verification (waiting for the device; draft step 0 runs meanwhile), commits the kept tokens,
        moves each verified request to the state slot of its last kept row, records the counters, frees finished
        sequences and drafts the next tokens of the others. Returns the step's RequestOutputs."""
        kept: dict[int, int] = {}  # id(request) -> rows kept by a verified request (1 + accepted drafts)
        commit_reqs, commit_rows = [], []
        stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * self.k)
        samples = None
        if step.spans is None:  # a chained step: its requests' positions are known once the step before is read
            step.spans = [(r, r.num_computed_tokens, r.num_computed_tokens + 1 + len(d), r.num_computed_tokens)
                          for r, d in zip(step.sample_reqs, step.drafts)]
        if step.verified is not None:
            rows_out, num_accepted = step.verified.to_host()
            row = 0
            for req, drafts, a in zip(step.sample_reqs, step.drafts, num_accepted):
                req.num_pending -= 1
                if req.finished:  # finished (or aborted) after a chained step was launched: its rows are dropped
                    row += len(drafts) + 1
                    continue
                commit_reqs += [req] * (a + 1)
                commit_rows += range(row, row + a + 1)
                row += len(drafts) + 1
                if drafts:
                    kept[id(req)] = a + 1
                    stats.observe(len(drafts), a)
                    req.num_computed_tokens += a + 1
                    if a < len(drafts):  # the state after the last kept row is in the spare slot of that row
                        req.state_slot, req.spare_slots[a] = req.spare_slots[a], req.state_slot
            samples = _select(rows_out, commit_rows)
        if step.constrained:
            for req in step.constrained:
                req.num_pending -= 1
            commit_reqs += step.constrained
            samples = _concat(samples, step.constrained_sampled.to_host())
        if stats.num_drafts:
            engine.metrics.record_spec_decode(stats)
        outputs, finished = engine.output_processor.process(step.spans, step.logits, commit_reqs, samples)
        for req in finished:
            engine._free(req)
        if step.chained:  # the next step is on the device already, with the drafts it made for each request
            return outputs
        sampled = {id(r) for r in step.sample_reqs}  # a grammar's request gets no drafts
        entries = []
        for (req, start, end, first), row, draft_row in zip(step.spans, step.rows, step.draft_rows):
            if req.finished:
                continue
            wants = self._num_drafts(req) if id(req) in sampled else 0
            last = kept.get(id(req), end - start) - 1  # the span's last kept row
            entries.append(DraftEntry(req, wants, draft_row + last if id(req) in kept else draft_row, row + last))
        drafts = self.proposer.propose(DraftBatch(entries, step.launched))
        if isinstance(drafts, DeviceDrafts):
            for i, (e, n) in enumerate(zip(entries, drafts.counts)):
                e.request.draft_token_ids = [0] * n
                e.request.drafts_on_device = (drafts.ids, i * drafts.width) if n else None
        else:
            for e, d in zip(entries, drafts):
                e.request.draft_token_ids = d[: e.num_drafts]
                e.request.drafts_on_device = None
        return outputs

    def _num_drafts(self, req: Request) -> int:
        """Drafts for a request's next step: k, less where its output would pass max_tokens or max_model_len, or
        its pages would not hold the positions the draft layer writes while drafting."""
        if req.finished:
            return 0
        n = req.num_tokens
        capacity = len(req.pages) * self.page_size
        return max(0, min(self.k, req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - n - 1,
                          capacity - n + 1))


def _concat(a: SamplerOutput | None, b: SamplerOutput) -> SamplerOutput:
    if a is None:
        return b
    return SamplerOutput(a.token_ids + b.token_ids, a.logprobs + b.logprobs, a.ranks + b.ranks,
                         a.topk_ids + b.topk_ids, a.topk_logprobs + b.topk_logprobs)


def _select(out: SamplerOutput, rows: list[int]) -> SamplerOutput:
    return SamplerOutput([out.token_ids[r] for r in rows], [out.logprobs[r] for r in rows],
                         [out.ranks[r] for r in rows], [out.topk_ids[r] for r in rows],
                         [out.topk_logprobs[r] for r in rows])
