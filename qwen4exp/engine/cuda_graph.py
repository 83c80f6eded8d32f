"""CUDA graphs for decode steps (every request brings one token).

One graph per batch-size bucket, captured once over persistent step-metadata buffers; a step copies its metadata
into the buffers (padding rows point at the null page and null slot 0) and replays the bucket's graph. Prefill and
mixed steps stay eager. Every op on this path is a fast path without host syncs (see ops/).
"""

from __future__ import annotations

import logging
import time

import torch

from ..model import StepMetadata
from .runner import RequestChunk, fill_pending, to_device

logger = logging.getLogger("qwen4exp")


def default_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    out = [b for b in sizes if b < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


class CUDAGraphRunner:
    def __init__(self, model, cache, max_model_len: int, max_num_seqs: int, device, buckets: list[int] | None = None):
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
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.table_width = 0  # block_tables columns at and past this are zero in every row

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
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        tensors = self.cache.tensors
        for n, max_len in [(n, v) for n in sorted(self.buckets, reverse=True) for v in self.variants]:
            meta = self._meta(n, max_len)  # largest first so smaller graphs reuse its pool
            for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                self.model.compute_logits(self.model(meta, tensors))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model.compute_logits(self.model(meta, tensors))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[n, max_len] = (graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s, context bounds %s) in %.1f s", len(self.graphs),
                    self.buckets, self.variants, time.perf_counter() - t0)

    def _run(self, bucket: int, max_len: int) -> torch.Tensor:
        graph, logits = self.graphs[bucket, max_len]
        graph.replay()
        return logits

    def can_run(self, chunks: list[RequestChunk]) -> bool:
        return 0 < len(chunks) <= self.max_batch and all(len(c.token_ids) == 1 for c in chunks)

    @torch.inference_mode()
    def execute(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None) -> torch.Tensor:
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
        longest = max(ch.context_len + 1 for ch in chunks)
        max_len = (self.short_len if self.short_len in self.variants and longest <= self.short_len
                   else self.max_model_len)
        logits = self._run(bucket, max_len)
        wanted = [r for r, ch in enumerate(chunks) if ch.logits_from == 0]
        if len(wanted) == n:
            return logits[:n].clone()
        return logits[to_device(wanted, logits.device)].clone()
