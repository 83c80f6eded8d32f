"""CUDA graphs for decode steps (every request brings one token) and for small mixed steps (prefill chunks, with or
without decodes).

Decode: one graph per batch-size bucket, captured once over persistent step-metadata buffers; a step copies its
metadata into the buffers (padding rows point at the null page and null slot 0) and replays the bucket's graph.

Mixed: one graph per token-count bucket (MIXED_GRAPH_TOKENS, up to the step budget) over max_batch + 1 request rows:
the step's requests, then empty rows, then one padding request that owns the bucket's unused tokens (null slot,
null page, no initial state). Their metadata is marked `in_cuda_graph`, so every op takes a path that reads the
per-request layout from the device buffers (GDN runs its recurrent kernel over each request's tokens). A step
qualifies when it fits the largest bucket and wants at most its requests' last rows' logits; larger steps, and
steps that want more rows (prompt logprobs, speculative verification), stay eager.
Every op on these paths is a fast path without host syncs (see ops/).

Images: a graph computes rotary positions as the logical positions plus a per-token offset (zero but in steps with
images), so the steps of a request with images that feed no image token (its decode steps, text chunks after its
images) replay graphs: there M-RoPE's three rows are equal, which is 1-D rotary at the offset position
(StepLayout.text_rope). Steps that feed image tokens run eagerly.

Speculative decoding (`speculative`, k drafts): every step returns its multi-stream states for the draft layer, so
the runner captures mixed-layout graphs only, over token counts (1 + k) x the batch-size buckets (up to the step
budget), each returning the logits of every row and the states; a step of decodes, verified requests (their state
token slots in one more buffer, -1 elsewhere) and small prefill chunks replays the smallest that holds its tokens.
A chained step (`execute_chained`) runs on the buffers of the step before it, advanced on the device
(ops.verified_layout) instead of filled from the host, and replays a graph of its own (`capture_chained`): the step's
graph followed by draft step 0 over its rows, each fed the token the step emits there (its argmax), so the draft layer
runs without a graph boundary, an ids copy or a copy of the states.

The draft layer (`draft=True`, a second runner over the same buckets, sharing the target's memory pool): its steps
are as small as the target's (draft step 0 covers every row of a step, a further draft step one row per request),
so run eagerly they cost more in kernel launches than in compute. Each graph runs `model.draft` on the mixed layout
with the multi-stream states copied into one more buffer, and returns every row's greedy draft and states. A
further draft step launched before the host has read the verification (`execute_draft_shifted`) is laid out by the
host as if no draft were kept and moved on the device to the rows the verification keeps.
"""

from __future__ import annotations

import copy
import logging
import time

import numpy as np
import torch

from ..model import ModelCache, StepMetadata
from ..ops.verified_layout import advance_verified, shift_draft_rows
from .rejection_sampler import greedy_acceptance
from .step_builder import (
    RequestChunk,
    StepBuilder,
    StepLayout,
    fill_pending,
    host_to_device,
    pending_rows,
    to_device,
)

logger = logging.getLogger("qwen4exp")

# Token counts of the mixed-step graphs (those up to the step budget are captured). A step of n tokens replays the
# smallest bucket >= n: the padding tokens cost compute in every layer, and GDN's recurrent loop costs time in
# proportion to the longest request's tokens, so the buckets stop where eager steps stop being host-bound.
MIXED_GRAPH_TOKENS = (64, 128, 256, 512)


def _rows(wanted: np.ndarray, device) -> slice | torch.Tensor:
    """An index of the rows `wanted`: a slice when they are rows 0 .. L-1 (no gather), else a device tensor."""
    if len(wanted) and wanted[-1] == len(wanted) - 1:
        return slice(0, len(wanted))
    return host_to_device(wanted, device)


def default_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    out = [b for b in sizes if b < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


class StagedBuffers:
    """Device buffers that a step fills from the host in one copy: every buffer is a view into one device arena,
    written on the host into a page-locked copy of it (numpy views), then sent whole. A step's twenty-odd fields
    would otherwise be as many host-to-device copies, each ~10 us of host time on the critical path of a step the
    host cannot prepare ahead (speculative verification). `copies` host copies (at least two) take turns, each
    reused only once the copy that last read it has run, since the host may run a step ahead of the device: as many
    as the sends the host queues behind a step it has not waited for (a chained speculative step's further draft
    steps), so that none of them waits for that step."""

    ALIGN = 16

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device, copies: int = 2):
        device = torch.device(device)
        offsets, size = {}, 0
        for name, (shape, dtype) in specs.items():
            offsets[name] = size
            nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
            size += -(-nbytes // self.ALIGN) * self.ALIGN
        self.size = max(size, self.ALIGN)
        self.arena = torch.zeros(self.size, dtype=torch.uint8, device=device)
        pinned = device.type == "cuda"
        self.hosts = [torch.zeros(self.size, dtype=torch.uint8, pin_memory=pinned) for _ in range(max(copies, 2))]

        def views(buffer, to_numpy):
            out = {}
            for name, (shape, dtype) in specs.items():
                n = int(np.prod(shape, dtype=np.int64))
                t = buffer[offsets[name]:].view(dtype)[:n].view(shape)
                out[name] = t.numpy() if to_numpy else t
            return out

        self.device = views(self.arena, False)
        self.host_views = [views(h, True) for h in self.hosts]
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.hosts)
        self.turn = 0

    def host(self) -> dict[str, np.ndarray]:
        """The host copy to fill for the next `send` (waits, rarely, for the copy that last read it)."""
        event = self.copied[self.turn]
        if event is not None:
            event.synchronize()
        return self.host_views[self.turn]

    def send(self) -> None:
        """Queues the copy of the host copy just filled into the device buffers."""
        host = self.hosts[self.turn]
        self.arena.copy_(host, non_blocking=True)
        if self.arena.is_cuda:
            event = self.copied[self.turn] = torch.cuda.Event()
            event.record()
        self.turn = (self.turn + 1) % len(self.hosts)


class CUDAGraphRunner:
    def __init__(self, model, cache: ModelCache, page_size: int, max_model_len: int, max_num_seqs: int, device,
                 buckets: list[int] | None = None, max_num_batched_tokens: int = 0, speculative: int = 0,
                 draft: bool = False, pool=None, target: CUDAGraphRunner | None = None):
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.config = model.config
        self.page_size = page_size
        self.builder = StepBuilder(self.config, page_size)
        self.max_model_len = max_model_len
        self.buckets = buckets or default_buckets(max_num_seqs)
        B = self.max_batch = self.buckets[-1]
        c = self.config
        C = c.indexer_compress_ratio if c.qsa else 1
        self.C = C
        max_pages = -(-max_model_len // self.page_size)
        z = dict(dtype=torch.long, device=self.device)
        # a decode step's fields, sent in one copy (StagedBuffers), the block tables and rotary offsets apart
        self.stage = StagedBuffers(dict(
            input_ids=((B,), torch.long), positions=((B,), torch.long), slot_mapping=((B,), torch.long),
            state_slots=((B,), torch.long), context_lens=((B,), torch.int32),
            ngram_context=((B, max(c.ngram_size - 1, 0)), torch.long), has_initial=((B,), torch.bool),
            new_block_token_slots=((B, C), torch.long), new_block_slots=((B,), torch.long),
            new_block_positions=((B,), torch.long),
        ), self.device)
        self.buf = dict(self.stage.device, rope_offset=torch.zeros(B, **z),
                        block_tables=torch.zeros(B, max_pages, dtype=torch.int32, device=self.device))
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=self.device)
        self.arange = torch.arange(B, **z)
        self.zeros = torch.zeros(B, **z)
        self.eos = self.builder.eos
        # QSA is exactly dense while every context fits budget + C - 1 tokens: a second set of graphs skips the
        # block selection for such steps (max_seq_len is what the model reads to decide, fixed per graph).
        c = self.config
        self.short_len = c.indexer_budget + c.indexer_compress_ratio - 1 if c.qsa else None
        self.variants = [max_model_len] + ([self.short_len] if self.short_len and self.short_len < max_model_len
                                           else [])
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        self.table_extent = (0, 0)  # rows and columns of buf's block tables that may be non-zero

        self.speculative = speculative
        self.mixed_sizes = [t for t in MIXED_GRAPH_TOKENS if t <= max_num_batched_tokens]
        if speculative:
            self.mixed_sizes = sorted({(1 + speculative) * b for b in self.buckets
                                       if (1 + speculative) * b <= max_num_batched_tokens})
        R = self.mixed_reqs = B + 1  # the step's requests, empty rows, and the padding request last
        T = self.mixed_sizes[-1] if self.mixed_sizes else 0
        nb = T // C + R  # a chunk of n tokens completes at most n // C + 1 QSA blocks
        # the padding request's tokens sit at positions 0..T-1, past max_model_len when a bucket is longer than it
        # (steps of several short prompts): its table row (zeros, the null page) must reach them
        mixed_pages = -(-max(max_model_len, T) // self.page_size)
        i64, i32 = torch.long, torch.int32
        # the per-step fields of a mixed step, sent in one copy (StagedBuffers); the block tables (wide, mostly
        # zeros) and the rotary offsets (zero but in steps with images) are written apart
        specs = dict(
            input_ids=((T,), i64), positions=((T,), i64), slot_mapping=((T,), i64), token_req=((T,), i64),
            token_local=((T,), i64), query_start_loc=((R + 1,), i32), context_lens=((R,), i32),
            state_slots=((R,), i64), ngram_context=((R, max(c.ngram_size - 1, 0)), i64),
            has_initial=((R,), torch.bool), logits_indices=((R,), i64), new_block_token_slots=((nb, C), i64),
            new_block_slots=((nb,), i64), new_block_positions=((nb,), i64),
        )
        self.draft = draft
        self.target = target
        self.drafter: CUDAGraphRunner | None = None  # the draft layer's runner over these buffers
        self.chains = False  # the chained steps' graphs are captured (capture_chained)
        self.kept_layout: torch.Tensor | None = None  # keep_layout's copy of the mixed buffers
        self.chained_out: tuple[torch.Tensor, ...] | None = None  # allocate_chained_results
        self.ids = None
        if target is not None:
            target.drafter = self
            # the draft layer's runner (draft=True) over the target's mixed buffers, with input ids of its own: draft
            # step 0 runs on the layout of the step just replayed (`execute_draft_on_step`), which then costs the host
            # one small copy instead of a second layout (the draft layer reads no recurrent state or n-gram context)
            assert draft and target.mixed_sizes == self.mixed_sizes and target.variants == self.variants
            self.mstage, self.mbuf = target.mstage, dict(target.mbuf)
            self.ids = StagedBuffers(dict(input_ids=((T,), i64)), self.device, copies=2 * speculative)
            self.mbuf["input_ids"] = self.ids.device["input_ids"]
            self.tables = target.tables
        else:
            if speculative and not draft:
                specs["state_token_slots"] = ((T,), i64)
            # the k - 1 further draft steps of a chained step are sent behind it, and the next chained step's behind
            # that, before the host waits for the first
            self.mstage = StagedBuffers(specs, self.device, copies=2 * speculative)
            self.mbuf = dict(self.mstage.device,
                             block_tables=torch.zeros(R, mixed_pages, dtype=torch.int32, device=self.device),
                             rope_offset=torch.zeros(T, **z))
            # the rows and columns of mbuf's block tables that may be non-zero (the rest are zeros)
            self.tables = {"rows": 0, "width": 0}
        self.rope_offsets_set = False  # some rope_offset buffer holds a step's non-zero offsets
        if draft:  # the multi-stream state of each row, the draft layer's input
            self.streams_in = torch.zeros(T, c.hc_count * c.hidden_size, dtype=model.lm_head.weight.dtype,
                                          device=self.device)
        self.mixed_arange = np.arange(T, dtype=np.int64)
        self.last_key = None  # the graph the last step replayed (None: it ran eagerly), see execute_draft_on_step

    def _meta(self, n: int, max_seq_len: int) -> StepMetadata:
        b = {k: v[:n] for k, v in self.buf.items()}
        return StepMetadata(
            input_ids=b["input_ids"], positions=b["positions"], query_start_loc=self.query_start_loc[: n + 1],
            context_lens=b["context_lens"], block_tables=b["block_tables"], slot_mapping=b["slot_mapping"],
            state_slots=b["state_slots"], ngram_context=b["ngram_context"], logits_indices=self.arange[:n],
            new_block_token_slots=b["new_block_token_slots"], new_block_slots=b["new_block_slots"],
            new_block_positions=b["new_block_positions"], token_req=self.arange[:n], token_pos=b["positions"],
            token_local=self.zeros[:n], has_initial=b["has_initial"], num_reqs=n, num_tokens=n, num_decode_reqs=n,
            max_seq_len=max_seq_len, in_cuda_graph=True,
        )

    def _mixed_meta(self, T: int, max_seq_len: int) -> StepMetadata:
        """Metadata over the mixed buffers for a T-token bucket: max_num_seqs + 1 requests, no decodes (whatever
        step replays the graph)."""
        b, nb, R = self.mbuf, T // self.C + self.mixed_reqs, self.mixed_reqs
        return StepMetadata(
            input_ids=b["input_ids"][:T], positions=b["positions"][:T], query_start_loc=b["query_start_loc"],
            context_lens=b["context_lens"], block_tables=b["block_tables"], slot_mapping=b["slot_mapping"][:T],
            state_slots=b["state_slots"], ngram_context=b["ngram_context"], logits_indices=b["logits_indices"],
            new_block_token_slots=b["new_block_token_slots"][:nb], new_block_slots=b["new_block_slots"][:nb],
            new_block_positions=b["new_block_positions"][:nb], token_req=b["token_req"][:T],
            token_pos=b["positions"][:T], token_local=b["token_local"][:T], has_initial=b["has_initial"],
            num_reqs=R, num_tokens=T, num_decode_reqs=0, max_seq_len=max_seq_len, in_cuda_graph=True,
            state_token_slots=b["state_token_slots"][:T] if "state_token_slots" in b and not self.draft else None,
        )

    def forward(self, meta: StepMetadata, rows: torch.Tensor | None, chained: bool = False):
        """What a graph captures: the wanted logits rows (`rows`, None: all); with speculation every row's logits,
        the multi-stream states, every row's argmax and the drafts greedy verification keeps per request
        (rejection_sampler.greedy_acceptance); for a chained step (`chained`) the same but the logits, then the
        draft layer's draft at every row and its states, each row fed its argmax; for the draft layer every row's
        greedy draft and states."""
        if self.draft:  # every row's draft: draft step 0 wants several rows of a verified request
            return self.draft_forward(meta, self.streams_in[: meta.num_tokens])
        if self.speculative:
            hidden, streams = self.model(meta, self.cache, return_streams=True)
            logits = self.model.compute_logits(hidden)
            tokens = logits.argmax(-1)
            accepted = greedy_acceptance(tokens, meta)
            if chained:  # the draft layer's rows: the step's, with its own input ids and no state token slots
                draft_meta = copy.copy(meta)
                draft_meta.input_ids, draft_meta.state_token_slots = tokens, None
                # no logits: nothing reads them, and a graph's outputs keep their memory (T x vocab fp32)
                results = (tokens, accepted, *self.drafter.draft_forward(draft_meta, streams))
                if self.chained_out is not None:
                    results = [out[: x.shape[0]].copy_(x) for out, x in zip(self.chained_out, results)]
                return (streams, *results)
            return logits, streams, tokens, accepted
        hidden = self.model(meta, self.cache)
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    def draft_forward(self, meta: StepMetadata, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft layer over a step's rows (`streams`: their multi-stream states): every row's greedy draft and
        new states."""
        hidden, streams = self.model.draft(meta, self.cache, streams)
        return self.model.compute_logits(hidden).argmax(-1), streams

    def graph_inputs(self, key: tuple) -> tuple[StepMetadata, torch.Tensor | None, torch.Tensor, bool]:
        """The graph of `key` reads: the metadata over the buffers, its wanted rows (None: all), its rotary
        offsets, and whether it is a chained step's."""
        if key[0] in ("mixed", "chained"):
            meta = self._mixed_meta(key[1], key[2])
            return meta, meta.logits_indices, self.mbuf["rope_offset"][: key[1]], key[0] == "chained"
        return self._meta(*key), None, self.buf["rope_offset"][: key[0]], False

    def graph_step(self, meta: StepMetadata, rows: torch.Tensor | None, rope_offset: torch.Tensor,
                   chained: bool = False):
        """What a graph runs: the rotary positions from the buffers (logical + offset), then `forward`."""
        meta = copy.copy(meta)  # not dataclasses.replace, which would read the unset host fields
        meta.positions = meta.token_pos + rope_offset
        return self.forward(meta, rows, chained)

    def _capture_one(self, key: tuple) -> None:
        inputs = self.graph_inputs(key)

        def run():
            return self.graph_step(*inputs)

        for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
            run()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = run()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, logits)

    def _capture_mixed(self, kind: str) -> None:
        for T, max_len in [(T, v) for T in sorted(self.mixed_sizes, reverse=True) for v in self.variants]:
            # largest first so smaller graphs reuse its pool; captured with every token in the padding request
            h = self.mstage.host()
            h["query_start_loc"][:] = [0] * self.mixed_reqs + [T]
            self._fill_mixed_padding(h, T, 0, self.ids.host() if self.ids else h)
            self.mstage.send()
            if self.ids:
                self.ids.send()
            self._capture_one((kind, T, max_len))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self._capture_mixed("mixed")
        for n, max_len in [(n, v) for n in sorted(self.buckets, reverse=True) for v in self.variants
                           if not self.speculative]:
            self._capture_one((n, max_len))
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs%s (decode batch sizes %s, mixed-step token counts %s, context bounds "
                    "%s) in %.1f s", len(self.graphs), " of the draft layer" if self.draft else "", self.buckets,
                    self.mixed_sizes, self.variants, time.perf_counter() - t0)

    def allocate_chained_results(self) -> None:
        """Buffers outside the graph pool for a chained step's results (every row's argmax, the drafts each request
        keeps, every row's draft and draft states), which are read after the draft layer's further draft steps have
        replayed (k >= 2). Graphs that share a pool reuse one another's freed memory: the chained graphs, captured
        after the draft layer's, could keep their outputs where those keep their intermediates."""
        T, R, c = self.mixed_sizes[-1], self.mixed_reqs, self.config
        self.chained_out = tuple(torch.zeros(n, dtype=torch.long, device=self.device) for n in (T, R, T)) + (
            torch.zeros(T, c.hc_count * c.hidden_size, dtype=self.drafter.streams_in.dtype, device=self.device),)

    @torch.inference_mode()
    def capture_chained(self) -> None:
        """The chained steps' graphs (execute_chained), once the draft layer's runner is built over these buffers:
        one a mixed-step graph, the step followed by draft step 0."""
        assert self.drafter is not None, "a chained step's graph holds its draft step 0"
        t0 = time.perf_counter()
        self.allocate_chained_results()
        self._capture_mixed("chained")
        self.chains = True
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs of chained steps (the step and draft step 0) in %.1f s",
                    len(self.mixed_sizes) * len(self.variants), time.perf_counter() - t0)

    def _run(self, key: tuple) -> torch.Tensor:
        """Replays the graph of `key`: (batch size, context bound) for decode, ("mixed" or "chained", tokens, context
        bound)."""
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def variant(self, max_seq_len: int) -> int:
        """The context bound of the graph a step replays: the short (dense QSA) one when every request's length after
        the step (at most `max_seq_len`) fits it."""
        short = self.short_len in self.variants and max_seq_len <= self.short_len
        return self.short_len if short else self.max_model_len

    def can_run(self, chunks: list[RequestChunk], mixed: bool = True) -> bool:
        """Whether a graph takes the step: decodes only, or (`mixed`) a step that fits the largest mixed bucket and
        wants at most each request's last logits row. With speculation: a step that fits the largest bucket, and
        (without `mixed`) holds no prefill chunk."""
        if not 0 < len(chunks) <= self.max_batch:
            return False
        if self.speculative:
            return (bool(self.mixed_sizes) and sum(len(c.token_ids) for c in chunks) <= self.mixed_sizes[-1]
                    and (mixed or all(len(c.token_ids) == 1 or c.state_token_slots is not None for c in chunks)))
        if all(len(c.token_ids) == 1 for c in chunks):
            return True
        return (mixed and bool(self.mixed_sizes) and sum(len(c.token_ids) for c in chunks) <= self.mixed_sizes[-1]
                and all(c.logits_from >= len(c.token_ids) - 1 for c in chunks))

    @torch.inference_mode()
    def execute(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None,
                multimodal: bool = False) -> torch.Tensor | tuple | None:
        """The step's wanted logits rows (ModelRunner.execute); with speculation also every row's multi-stream
        states, in the order of the chunks. multimodal (a chunk has images): None, running nothing, when the step
        is not all text (StepLayout.text_rope)."""
        if self.speculative:
            key, wanted = self.prepare_mixed(chunks, pending_ids)
            logits, streams, tokens, accepted = self._run(key)
            self.last_key = key
            rows = _rows(wanted, logits.device)
            total = sum(len(c.token_ids) for c in chunks)
            return logits[rows], streams[:total], tokens[rows], accepted[: len(chunks)]
        layout = self.builder.build(chunks, multimodal)
        text = layout.text_rope() if multimodal else None
        if multimodal and text is None:
            return None
        if all(len(c.token_ids) == 1 for c in chunks):
            return self._execute_decode(layout, pending_ids, text)
        key, wanted = self.prepare_mixed(chunks, pending_ids, layout, text)
        logits = self._run(key)
        return logits[host_to_device(wanted, logits.device)]  # a gather: a copy of the rows

    @torch.inference_mode()
    def execute_draft(self, chunks: list[RequestChunk], streams: torch.Tensor,
                      pending_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft step (`draft=True`; chunks as MTPProposer builds them, `streams` [T, hc*H] their rows' states):
        (the greedy draft of each wanted row, in chunk order; every row's new states, a view of the graph's output
        valid until its next replay)."""
        if self.target is not None:
            self.target.last_key = None  # the shared buffers hold this step's layout from here
        key, wanted = self.prepare_mixed(chunks, pending_ids)
        return self._run_draft(key, wanted, streams)

    @torch.inference_mode()
    def execute_draft_shifted(self, chunks: list[RequestChunk], streams: torch.Tensor, pending_ids: torch.Tensor,
                              shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`execute_draft` for a step of one row per request whose positions the device knows: `chunks` place the
        rows at the positions they take where shift is 0, and row r moves to its chunk's position + shift[r]
        (ops.verified_layout.shift_draft_rows) before the replay. The caller checks that the context bound of the
        graph does not depend on the shift."""
        if self.target is not None:
            self.target.last_key = None
        key, wanted = self.prepare_mixed(chunks, pending_ids)
        shift_draft_rows(self.mbuf, len(chunks), self.page_size, self.C if self.config.qsa else 0, shift)
        return self._run_draft(key, wanted, streams)

    def _run_draft(self, key: tuple, wanted: np.ndarray, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = streams.shape[0]
        # rows past `total` keep what an earlier step left: the padding request's rows, which no other row reads
        self.streams_in[:total].copy_(streams)
        tokens, streams_out = self._run(key)
        return tokens[_rows(wanted, tokens.device)], streams_out[:total]

    def can_draft_on_step(self) -> bool:
        """Whether draft step 0 (over the rows of the step just launched, as MTPProposer.launch gets them) can run on
        that step's layout: the target replayed a graph for it, whose buffers this runner shares."""
        return self.target is not None and self.target.last_key is not None

    @torch.inference_mode()
    def execute_draft_on_step(self, chunks: list[RequestChunk], streams: torch.Tensor,
                              pending_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`execute_draft` for draft step 0 (see can_draft_on_step): the target's buffers hold the step's layout
        (the same rows, positions, pages and blocks), so only the input ids are written."""
        key, self.target.last_key = self.target.last_key, None  # once: later draft steps rewrite the buffers
        T, h = key[1], self.ids.host()["input_ids"]
        qsl, wanted = [0], []
        for c in chunks:
            total, n = qsl[-1], len(c.token_ids)
            h[total: total + n] = c.token_ids
            wanted.append(self.mixed_arange[total + c.logits_from: total + n])
            qsl.append(total + n)
        total = qsl[-1]
        assert total == streams.shape[0] and total <= T, "draft step 0 covers the rows of the step just replayed"
        h[total:T] = 0  # the padding request's tokens
        self.ids.send()
        fill_pending(self.mbuf["input_ids"], pending_rows(chunks, qsl), pending_ids)
        return self._run_draft(key, np.concatenate(wanted), streams)

    def keep_layout(self) -> None:
        """Keeps a copy (on the device, in stream order) of the layout in the mixed buffers, the step just replayed,
        which the draft layer's further draft steps then overwrite (MTPProposer.draft_ahead): execute_chained
        derives the next step from it."""
        arena = self.mstage.arena
        if self.kept_layout is None:
            self.kept_layout = torch.empty_like(arena)
        self.kept_layout.copy_(arena)

    @torch.inference_mode()
    def execute_chained(self, key: tuple, num_reqs: int, pages: list[tuple[int, int, list[int]]],
                        accepted: torch.Tensor, emitted: torch.Tensor, drafts: torch.Tensor,
                        ahead: torch.Tensor | None = None):
        """The next step of the verified step just run (num_reqs requests of 1 + k rows, in its order), launched
        before the host has read it (SpecDecoder.chain): its layout derived on the device from the step's results
        (ops.verified_layout: `accepted`, `emitted` and for k = 1 `drafts` are views of the graphs' outputs, read
        before the replay overwrites them; for k >= 2 `ahead`, the next step's drafts made ahead, in place of
        `drafts`, and the step's layout from keep_layout), then the chained graph of `key`'s tokens and context
        bound replayed: the step and its draft step 0. pages: (request, first column, page ids) of the pages the
        requests took since, written into their block tables first. Returns (every row's argmax, the drafts each
        request keeps, every row's draft and draft states), views valid until the next replay."""
        if ahead is not None:
            self.mstage.arena.copy_(self.kept_layout)
        tables = self.mbuf["block_tables"]
        for r, first, ids in pages:
            tables[r, first: first + len(ids)].copy_(to_device(ids, self.device, torch.int32))
            self.tables["width"] = max(self.tables["width"], first + len(ids))
        advance_verified(self.mbuf, num_reqs, self.page_size, self.C if self.config.qsa else 0, accepted, emitted,
                         drafts, ahead)
        _, tokens, kept, drafts, draft_streams = self._run(("chained", *key[1:]))
        self.last_key = key
        rows = (1 + self.speculative) * num_reqs
        return tokens[:rows], kept[:num_reqs], drafts[:rows], draft_streams[:rows]

    def _fill_mixed_padding(self, h: dict[str, np.ndarray], T: int, total: int, ids: dict[str, np.ndarray]) -> None:
        """Tokens total..T-1 belong to the padding request (last row), at positions 0, 1, ... of the null page
        (`h`: the host copy of the mixed buffers, `ids` the one holding the input ids)."""
        pad = T - total
        h["token_req"][total:T] = self.mixed_reqs - 1
        h["token_local"][total:T] = self.mixed_arange[:pad]
        h["positions"][total:T] = self.mixed_arange[:pad]
        h["slot_mapping"][total:T] = 0
        ids["input_ids"][total:T] = 0

    @staticmethod
    def _put(buf: torch.Tensor, rows: np.ndarray, pad_rows: int = 0, fill=0) -> None:
        """buf[:len(rows) + pad_rows] = rows, then pad_rows rows of `fill`, in one host-to-device copy."""
        if pad_rows:
            rows = np.concatenate([rows, np.full((pad_rows, *rows.shape[1:]), fill, dtype=rows.dtype)])
        buf[: rows.shape[0]].copy_(torch.from_numpy(rows), non_blocking=True)

    @staticmethod
    def _put_tables(tables: torch.Tensor, layout: StepLayout, extent: tuple[int, int]) -> tuple[int, int]:
        """Copies the step's block tables into rows 0..R-1 of `tables` and zeroes what earlier steps left outside
        them (`extent`: the rows and columns that may be non-zero before); returns the extent now. Only the step's
        widest table travels: zeros past it are kept, not sent."""
        n, width = layout.block_tables.shape
        rows_before, width_before = extent
        tables[:n, :width].copy_(torch.from_numpy(layout.block_tables), non_blocking=True)
        if rows_before > n:
            tables[n:rows_before, :width_before].zero_()
        if width < width_before:
            tables[:n, width:width_before].zero_()
        return n, width

    def prepare_mixed(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None,
                      layout: StepLayout | None = None, text: tuple[np.ndarray, np.ndarray] | None = None):
        """Fills the mixed buffers for a step (see can_run); returns the key of the graph to replay and the rows of its
        logits that the step wants, in chunk order (one per request row; with speculation, every row's logits are
        computed and these are the rows from each chunk's logits_from). `layout`: the chunks' (built here when
        None); `text`: its text_rope() in a step with images."""
        layout = layout or self.builder.build(chunks)
        n, R, total = layout.num_reqs, self.mixed_reqs, layout.num_tokens
        T = next(t for t in self.mixed_sizes if t >= total)
        b, h = self.mbuf, self.mstage.host()
        ids = self.ids.host() if self.ids else h
        empty = R - n  # empty rows and the padding request: no state, null slot, null page

        def put(name, rows, pad_rows=0, fill=0):
            h[name][: len(rows)] = rows
            h[name][len(rows): len(rows) + pad_rows] = fill

        ids["input_ids"][:total] = layout.input_ids
        for name in ("positions", "slot_mapping", "token_req", "token_local"):
            put(name, getattr(layout, name))
        qsl = layout.query_start_loc + [total] * (empty - 1) + [T]
        put("query_start_loc", qsl)
        put("context_lens", layout.context_lens, empty)
        put("state_slots", layout.state_slots, empty)
        put("has_initial", layout.has_initial(), empty)
        if h["ngram_context"].shape[1]:
            put("ngram_context", layout.ngram_context, empty, self.eos)
        # one logits row per request row: each request's last token
        put("logits_indices", np.array(qsl[1: n + 1], dtype=np.int64) - 1, empty)
        nb = T // self.C + R
        pad_blocks = nb - layout.new_block_slots.shape[0]
        for name in ("new_block_token_slots", "new_block_slots"):
            put(name, getattr(layout, name), pad_blocks)
        put("new_block_positions", layout.new_block_positions if text is None else text[1], pad_blocks)
        if "state_token_slots" in h:
            token_slots = layout.state_token_slots
            put("state_token_slots", token_slots if token_slots is not None else np.full(total, -1, np.int64),
                T - total, -1)
        self._fill_mixed_padding(h, T, total, ids)
        self.mstage.send()
        if self.ids:
            self.ids.send()
        self._put_rope_offset(b["rope_offset"], text, T)
        self.tables["rows"], self.tables["width"] = self._put_tables(
            b["block_tables"], layout, (self.tables["rows"], self.tables["width"]))
        fill_pending(b["input_ids"], layout.pending, pending_ids)
        wanted = layout.logits_indices if self.speculative or self.draft else layout.token_req[layout.logits_indices]
        return ("mixed", T, self.variant(layout.max_seq_len)), wanted

    def _put_rope_offset(self, buf: torch.Tensor, text: tuple[np.ndarray, np.ndarray] | None, rows: int) -> None:
        """The rotary offsets of a step with images (text[0], then zeros up to `rows`); in other steps zeros, which
        the buffers keep until a step with images writes them."""
        if text is not None:
            self._put(buf, text[0], rows - len(text[0]))
            self.rope_offsets_set = True
        elif self.rope_offsets_set:
            self.buf["rope_offset"].zero_()
            self.mbuf["rope_offset"].zero_()
            self.rope_offsets_set = False

    def _execute_decode(self, layout: StepLayout, pending_ids: torch.Tensor | None = None,
                        text: tuple[np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
        n = layout.num_reqs
        bucket = next(b for b in self.buckets if b >= n)
        buf, h, pad = self.buf, self.stage.host(), bucket - n

        def put(name, rows, fill=0):
            h[name][: len(rows)] = rows
            h[name][len(rows): len(rows) + pad] = fill

        for name in ("input_ids", "positions", "slot_mapping", "state_slots", "context_lens"):
            put(name, getattr(layout, name))
        put("has_initial", layout.has_initial())
        if h["ngram_context"].shape[1]:
            put("ngram_context", layout.ngram_context, self.eos)
        # one QSA block row per request: the block its token completes, else the null page's
        blocks = layout.new_block_rows
        block_positions = layout.new_block_positions if text is None else text[1]
        for name, rows in (("new_block_token_slots", layout.new_block_token_slots),
                           ("new_block_slots", layout.new_block_slots), ("new_block_positions", block_positions)):
            if rows.shape[0] != bucket:
                h[name][:bucket] = 0
                h[name][blocks] = rows
            else:
                h[name][:bucket] = rows
        self.stage.send()
        self._put_rope_offset(buf["rope_offset"], text, bucket)
        fill_pending(buf["input_ids"], layout.pending, pending_ids)
        self.table_extent = self._put_tables(buf["block_tables"], layout, self.table_extent)
        logits = self._run((bucket, self.variant(layout.max_seq_len)))
        if len(layout.logits_indices) == n:
            return logits[:n]  # no copy (64 x 248k at batch 64): see ModelRunner.execute
        return logits[host_to_device(layout.logits_indices, logits.device)]
