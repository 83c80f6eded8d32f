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
"""

from __future__ import annotations

import logging
import time

import torch

from ..model import StepMetadata
from .runner import RequestChunk, build_metadata, fill_pending, to_device

logger = logging.getLogger("qwen4exp")

# Token counts of the mixed-step graphs (those up to the step budget are captured). A step of n tokens replays the
# smallest bucket >= n: the padding tokens cost compute in every layer, and GDN's recurrent loop costs time in
# proportion to the longest request's tokens, so the buckets stop where eager steps stop being host-bound.
MIXED_GRAPH_TOKENS = (64, 128, 256, 512)


def default_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    out = [b for b in sizes if b < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


class CUDAGraphRunner:
    def __init__(self, model, cache, max_model_len: int, max_num_seqs: int, device, buckets: list[int] | None = None,
                 max_num_batched_tokens: int = 0):
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.config = model.config
        self.page_size = cache.page_size
        self.max_model_len = max_model_len
        self.buckets = buckets or default_buckets(max_num_seqs)
        B = self.max_batch = self.buckets[-1]
        c = self.config
        C = c.indexer_compress_ratio if c.qsa else 1
        self.C = C
        max_pages = -(-max_model_len // self.page_size)
        z = dict(dtype=torch.long, device=self.device)
        self.buf = dict(
            input_ids=torch.zeros(B, **z), positions=torch.zeros(B, **z), slot_mapping=torch.zeros(B, **z),
            state_slots=torch.zeros(B, **z), context_lens=torch.zeros(B, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(B, max_pages, dtype=torch.int32, device=self.device),
            ngram_context=torch.zeros(B, max(c.ngram_size - 1, 0), **z),
            has_initial=torch.zeros(B, dtype=torch.bool, device=self.device),
            new_block_token_slots=torch.zeros(B, C, **z), new_block_slots=torch.zeros(B, **z),
            new_block_positions=torch.zeros(B, **z),
        )
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=self.device)
        self.arange = torch.arange(B, **z)
        self.zeros = torch.zeros(B, **z)
        # QSA is exactly dense while every context fits budget + C - 1 tokens: a second set of graphs skips the
        # block selection for such steps (max_seq_len is what the model reads to decide, fixed per graph).
        c = self.config
        self.short_len = c.indexer_budget + c.indexer_compress_ratio - 1 if c.qsa else None
        self.variants = [max_model_len] + ([self.short_len] if self.short_len and self.short_len < max_model_len
                                           else [])
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.table_width = 0  # block_tables columns at and past this are zero in every row

        self.mixed_sizes = [t for t in MIXED_GRAPH_TOKENS if t <= max_num_batched_tokens]
        R = self.mixed_reqs = B + 1  # the step's requests, empty rows, and the padding request last
        T = self.mixed_sizes[-1] if self.mixed_sizes else 0
        nb = T // C + R  # a chunk of n tokens completes at most n // C + 1 QSA blocks
        # the padding request's tokens sit at positions 0..T-1, past max_model_len when a bucket is longer than it
        # (steps of several short prompts): its table row (zeros, the null page) must reach them
        mixed_pages = -(-max(max_model_len, T) // self.page_size)
        self.mbuf = dict(
            input_ids=torch.zeros(T, **z), positions=torch.zeros(T, **z), slot_mapping=torch.zeros(T, **z),
            token_req=torch.zeros(T, **z), token_local=torch.zeros(T, **z),
            query_start_loc=torch.zeros(R + 1, dtype=torch.int32, device=self.device),
            context_lens=torch.zeros(R, dtype=torch.int32, device=self.device), state_slots=torch.zeros(R, **z),
            block_tables=torch.zeros(R, mixed_pages, dtype=torch.int32, device=self.device),
            ngram_context=torch.zeros(R, max(c.ngram_size - 1, 0), **z),
            has_initial=torch.zeros(R, dtype=torch.bool, device=self.device), logits_indices=torch.zeros(R, **z),
            new_block_token_slots=torch.zeros(nb, C, **z), new_block_slots=torch.zeros(nb, **z),
            new_block_positions=torch.zeros(nb, **z),
        )
        self.mixed_arange = torch.arange(T, **z)
        self.mixed_table_width = 0

    def _meta(self, n: int, max_seq_len: int) -> StepMetadata:
        b = {k: v[:n] for k, v in self.buf.items()}
        return StepMetadata(
            input_ids=b["input_ids"], positions=b["positions"], query_start_loc=self.query_start_loc[: n + 1],
            context_lens=b["context_lens"], block_tables=b["block_tables"], slot_mapping=b["slot_mapping"],
            state_slots=b["state_slots"], ngram_context=b["ngram_context"], logits_indices=self.arange[:n],
            new_block_token_slots=b["new_block_token_slots"], new_block_slots=b["new_block_slots"],
            new_block_positions=b["new_block_positions"], token_req=self.arange[:n], token_pos=b["positions"],
            token_local=self.zeros[:n], has_initial=b["has_initial"], query_start_loc_cpu=list(range(n + 1)),
            context_lens_cpu=[0] * n, state_slots_cpu=[0] * n, num_decode_reqs=n, max_seq_len=max_seq_len,
            in_cuda_graph=True,
        )

    def _mixed_meta(self, T: int, max_seq_len: int) -> StepMetadata:
        """Metadata over the mixed buffers for a T-token bucket. Its host lists describe the capture's layout (every
        token in the padding request) whatever step replays the graph: the in-graph paths must not read them."""
        b, nb, R = self.mbuf, T // self.C + self.mixed_reqs, self.mixed_reqs
        return StepMetadata(
            input_ids=b["input_ids"][:T], positions=b["positions"][:T], query_start_loc=b["query_start_loc"],
            context_lens=b["context_lens"], block_tables=b["block_tables"], slot_mapping=b["slot_mapping"][:T],
            state_slots=b["state_slots"], ngram_context=b["ngram_context"], logits_indices=b["logits_indices"],
            new_block_token_slots=b["new_block_token_slots"][:nb], new_block_slots=b["new_block_slots"][:nb],
            new_block_positions=b["new_block_positions"][:nb], token_req=b["token_req"][:T],
            token_pos=b["positions"][:T], token_local=b["token_local"][:T], has_initial=b["has_initial"],
            query_start_loc_cpu=[0] * R + [T], context_lens_cpu=[0] * R, state_slots_cpu=[0] * R, num_decode_reqs=0,
            max_seq_len=max_seq_len, in_cuda_graph=True,
        )

    def _capture_one(self, key: tuple, meta: StepMetadata, rows: torch.Tensor | None) -> None:
        tensors = self.cache.tensors

        def run():
            hidden = self.model(meta, tensors)
            return self.model.compute_logits(hidden if rows is None else hidden[rows])

        for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
            run()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = run()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, logits)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for T, max_len in [(T, v) for T in sorted(self.mixed_sizes, reverse=True) for v in self.variants]:
            # largest first so smaller graphs reuse its pool; captured with every token in the padding request
            self.mbuf["query_start_loc"].copy_(torch.tensor([0] * self.mixed_reqs + [T]))
            self._fill_mixed_padding(T, 0)
            meta = self._mixed_meta(T, max_len)
            self._capture_one(("mixed", T, max_len), meta, meta.logits_indices)
        for n, max_len in [(n, v) for n in sorted(self.buckets, reverse=True) for v in self.variants]:
            self._capture_one((n, max_len), self._meta(n, max_len), None)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs (decode batch sizes %s, mixed-step token counts %s, context bounds %s) "
                    "in %.1f s", len(self.graphs), self.buckets, self.mixed_sizes, self.variants,
                    time.perf_counter() - t0)

    def _run(self, key: tuple) -> torch.Tensor:
        """Replays the graph of `key`: (batch size, context bound) for decode, ("mixed", tokens, context bound)."""
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def _variant(self, chunks: list[RequestChunk]) -> int:
        """The context bound of the graph a step replays: the short (dense QSA) one when every request fits it."""
        longest = max(ch.context_len + len(ch.token_ids) for ch in chunks)
        return self.short_len if self.short_len in self.variants and longest <= self.short_len else self.max_model_len

    def can_run(self, chunks: list[RequestChunk]) -> bool:
        if not 0 < len(chunks) <= self.max_batch:
            return False
        if all(len(c.token_ids) == 1 for c in chunks):
            return True
        return (bool(self.mixed_sizes) and sum(len(c.token_ids) for c in chunks) <= self.mixed_sizes[-1]
                and all(c.logits_from >= len(c.token_ids) - 1 for c in chunks))

    @torch.inference_mode()
    def execute(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None) -> torch.Tensor:
        if all(len(c.token_ids) == 1 for c in chunks):
            return self._execute_decode(chunks, pending_ids)
        key, wanted = self.prepare_mixed(chunks, pending_ids)
        logits = self._run(key)
        return logits[to_device(wanted, logits.device)]  # a gather: a copy of the rows

    def _fill_mixed_padding(self, T: int, total: int) -> None:
        """Tokens total..T-1 belong to the padding request (last row), at positions 0, 1, ... of the null page."""
        b, pad = self.mbuf, T - total
        b["token_req"][total:T].fill_(self.mixed_reqs - 1)
        b["token_local"][total:T].copy_(self.mixed_arange[:pad])
        b["positions"][total:T].copy_(self.mixed_arange[:pad])
        for name in ("input_ids", "slot_mapping"):
            b[name][total:T].zero_()

    def prepare_mixed(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None):
        """Fills the mixed buffers for a step (see can_run); returns the key of the graph to replay and the rows of its
        logits (one per request row) that the step wants, in chunk order."""
        n, R = len(chunks), self.mixed_reqs
        total = sum(len(c.token_ids) for c in chunks)
        T = next(t for t in self.mixed_sizes if t >= total)
        m = build_metadata(chunks, self.config, self.page_size, "cpu")
        b, eos = self.mbuf, self.config.eos_token_id if self.config.eos_token_id is not None else 0
        empty = R - n  # empty rows and the padding request: no state, null slot, null page

        def put(name, host):
            b[name][: host.shape[0]].copy_(host.to(b[name].dtype), non_blocking=True)

        for name in ("input_ids", "positions", "slot_mapping", "token_req", "token_local"):
            put(name, getattr(m, name))
        qsl = m.query_start_loc_cpu + [total] * (empty - 1) + [T]
        put("query_start_loc", torch.tensor(qsl))
        put("context_lens", torch.cat([m.context_lens, torch.zeros(empty, dtype=torch.int32)]))
        put("state_slots", torch.cat([m.state_slots, torch.zeros(empty, dtype=torch.long)]))
        put("has_initial", torch.cat([m.has_initial, torch.zeros(empty, dtype=torch.bool)]))
        if b["ngram_context"].shape[1]:
            put("ngram_context", torch.cat([m.ngram_context, torch.full((empty, b["ngram_context"].shape[1]), eos)]))
        put("logits_indices", torch.tensor([q - 1 for q in qsl[1: n + 1]] + [0] * empty))
        nb, nb_real = T // self.C + R, m.new_block_slots.shape[0]
        put("new_block_token_slots", torch.cat([m.new_block_token_slots, torch.zeros(nb - nb_real, self.C,
                                                                                      dtype=torch.long)]))
        put("new_block_slots", torch.cat([m.new_block_slots, torch.zeros(nb - nb_real, dtype=torch.long)]))
        put("new_block_positions", torch.cat([m.new_block_positions, torch.zeros(nb - nb_real, dtype=torch.long)]))
        tables, width = b["block_tables"], m.block_tables.shape[1]
        tables[:n, :width].copy_(m.block_tables, non_blocking=True)
        tables[n:, :width].zero_()
        if width < self.mixed_table_width:
            tables[:, width: self.mixed_table_width].zero_()
        self.mixed_table_width = width
        self._fill_mixed_padding(T, total)
        fill_pending(b["input_ids"], [(qsl[r + 1] - 1, ch.pending_row) for r, ch in enumerate(chunks)], pending_ids)
        wanted = [r for r, ch in enumerate(chunks) if ch.logits_from < len(ch.token_ids)]
        return ("mixed", T, self._variant(chunks)), wanted

    def _execute_decode(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None) -> torch.Tensor:
        n = len(chunks)
        bucket = next(b for b in self.buckets if b >= n)
        ps, C, ctx_n = self.page_size, self.C, self.config.ngram_size - 1
        eos = self.config.eos_token_id if self.config.eos_token_id is not None else 0
        ids, pos, slot_map, slots, ctx_lens, init, ngram = [], [], [], [], [], [], []
        blk_tok, blk_slot, blk_pos = [], [], []
        width = max(len(ch.pages) for ch in chunks)
        pages = []  # block tables as one flat list, each row zero-padded to the batch's widest: one tensor per step
        for ch in chunks:
            p = ch.context_len
            ids.append(ch.token_ids[0])
            pos.append(p)
            slot_map.append(ch.pages[p // ps] * ps + p % ps)
            slots.append(ch.state_slot)
            ctx_lens.append(p)
            init.append(p > 0)
            hist = ch.history[-ctx_n:] if ctx_n else []
            ngram.append([eos] * (ctx_n - len(hist)) + hist)
            pages += ch.pages
            pages += [0] * (width - len(ch.pages))
            if C > 1 and (p + 1) % C == 0:  # this token completes a QSA block
                first = p + 1 - C
                blk_tok.append([ch.pages[j // ps] * ps + j % ps for j in range(first, p + 1)])
                blk_slot.append(ch.pages[first // ps] * (ps // C) + (first % ps) // C)
                blk_pos.append(first)
            else:  # nothing to store: write into the null page
                blk_tok.append([0] * C)
                blk_slot.append(0)
                blk_pos.append(0)
        pad = bucket - n
        host = dict(
            input_ids=ids + [0] * pad, positions=pos + [0] * pad, slot_mapping=slot_map + [0] * pad,
            state_slots=slots + [0] * pad, context_lens=ctx_lens + [0] * pad, has_initial=init + [False] * pad,
            ngram_context=ngram + [[eos] * ctx_n] * pad, new_block_token_slots=blk_tok + [[0] * C] * pad,
            new_block_slots=blk_slot + [0] * pad, new_block_positions=blk_pos + [0] * pad,
        )
        for k, v in host.items():
            self.buf[k][:bucket].copy_(torch.tensor(v, dtype=self.buf[k].dtype).view_as(self.buf[k][:bucket]),
                                       non_blocking=True)
        fill_pending(self.buf["input_ids"], [(r, ch.pending_row) for r, ch in enumerate(chunks)], pending_ids)
        tables = self.buf["block_tables"]
        tables[:n, :width].copy_(torch.tensor(pages, dtype=torch.int32).view(n, width), non_blocking=True)
        if pad:
            tables[n:bucket, :width].zero_()
        if width < self.table_width:
            tables[:, width: self.table_width].zero_()
        self.table_width = width
        logits = self._run((bucket, self._variant(chunks)))
        wanted = [r for r, ch in enumerate(chunks) if ch.logits_from == 0]
        if len(wanted) == n:
            return logits[:n]  # no copy (64 x 248k at batch 64): see ModelRunner.execute
        return logits[to_device(wanted, logits.device)]
