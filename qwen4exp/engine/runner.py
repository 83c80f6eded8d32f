"""Model runner: turns one step's scheduled chunks into `StepMetadata`, runs the model, returns logits rows.

Nothing here decides what runs; the scheduler does. Nothing here knows layer internals; the model does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model import Qwen4ExpForCausalLM, StepMetadata
from .cache import CacheManager


@dataclass
class RequestChunk:
    """One request's share of a step."""

    token_ids: list[int]  # tokens fed this step
    context_len: int  # tokens of the request already in the caches
    history: list[int]  # committed tokens before token_ids (only the last ngram_size-1 are used)
    pages: list[int]  # page ids covering at least context_len + len(token_ids) tokens
    state_slot: int
    logits_from: int  # first row (within token_ids) whose logits are wanted; len(token_ids) for none
    # async scheduling: the row of the previous step's sampled ids (still on the device) that holds this chunk's
    # last token, whose entry in token_ids is then a placeholder; -1 when token_ids is complete
    pending_row: int = -1


def to_device(values, device, dtype=None) -> torch.Tensor:
    """torch.tensor(values, device=device) without its stream synchronisation (a blocking host-to-device copy waits
    for the GPU to finish everything queued, which would stall asynchronous scheduling)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def build_metadata(
    chunks: list[RequestChunk], config: ModelConfig, page_size: int, device, max_seq_len: int | None = None
) -> StepMetadata:
    """Chunks must come decodes first (one-token requests), as the fast paths expect. Per-token and per-block
    fields are computed with one tensor op per request, not per token: an 8k-token prefill has 2048 QSA blocks."""
    qsl, ctx, slots, lengths, input_ids, logits_rows, ngram_ctx = [0], [], [], [], [], [], []
    pos_parts, slot_parts, blk_tok, blk_slot, blk_pos = [], [], [], [], []
    n_ctx = max(config.ngram_size - 1, 0)
    eos = config.eos_token_id if config.eos_token_id is not None else 0
    C = config.indexer_compress_ratio if config.qsa else None
    in_block = torch.arange(C or 1)
    max_pages = max((len(c.pages) for c in chunks), default=1) or 1
    block_tables = torch.zeros(len(chunks), max_pages, dtype=torch.int32)
    for r, ch in enumerate(chunks):
        n = len(ch.token_ids)
        start = qsl[-1]
        qsl.append(start + n)
        ctx.append(ch.context_len)
        slots.append(ch.state_slot)
        lengths.append(n)
        input_ids += ch.token_ids
        logits_rows += range(start + ch.logits_from, start + n)
        hist = ch.history[-n_ctx:] if n_ctx else []
        ngram_ctx.append([eos] * (n_ctx - len(hist)) + hist)
        pages = torch.tensor(ch.pages, dtype=torch.long)
        block_tables[r, : len(ch.pages)] = pages
        pos = torch.arange(ch.context_len, ch.context_len + n)
        pos_parts.append(pos)
        slot_parts.append(pages[pos // page_size] * page_size + pos % page_size)
        if C:  # blocks completed by this chunk: each block's token rows, its block-key row and first position
            firsts = torch.arange(ch.context_len // C, (ch.context_len + n) // C) * C
            toks = firsts[:, None] + in_block
            blk_tok.append(pages[toks // page_size] * page_size + toks % page_size)
            blk_slot.append(pages[firsts // page_size] * (page_size // C) + (firsts % page_size) // C)
            blk_pos.append(firsts)

    def t(x, dtype=torch.long):
        return to_device(x, device, dtype)

    def cat(parts, *shape):
        return (torch.cat(parts) if parts else torch.zeros(0, *shape, dtype=torch.long)).to(device, non_blocking=True)

    positions = torch.cat(pos_parts) if pos_parts else torch.zeros(0, dtype=torch.long)
    token_req = torch.tensor([r for r, n in enumerate(lengths) for _ in range(n)], dtype=torch.long)
    token_local = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    num_decode = 0
    while num_decode < len(chunks) and len(chunks[num_decode].token_ids) == 1:
        num_decode += 1
    positions_t = positions.to(device, non_blocking=True)

    return StepMetadata(
        input_ids=t(input_ids),
        positions=positions_t,
        query_start_loc=t(qsl, torch.int32),
        context_lens=t(ctx, torch.int32),
        block_tables=block_tables.to(device, non_blocking=True),
        slot_mapping=cat(slot_parts),
        state_slots=t(slots),
        ngram_context=t(ngram_ctx).reshape(len(chunks), n_ctx),
        logits_indices=t(logits_rows),
        new_block_token_slots=cat(blk_tok, C or 1).reshape(-1, C or 1),
        new_block_slots=cat(blk_slot),
        new_block_positions=cat(blk_pos),
        token_req=token_req.to(device, non_blocking=True),
        token_pos=positions_t,
        token_local=token_local.to(device, non_blocking=True),
        has_initial=t([c > 0 for c in ctx], torch.bool),
        query_start_loc_cpu=qsl,
        context_lens_cpu=ctx,
        state_slots_cpu=slots,
        num_decode_reqs=num_decode,
        max_seq_len=max_seq_len or max((c + len(ch.token_ids) for c, ch in zip(ctx, chunks)), default=1),
    )


def fill_pending(input_ids: torch.Tensor, rows: list[tuple[int, int]], pending_ids: torch.Tensor | None) -> None:
    """input_ids[dst] = pending_ids[src] for every (dst, src) with src >= 0, without reading the ids on the host."""
    pairs = [(d, s) for d, s in rows if s >= 0]
    if not pairs:
        return
    if all(d == i and s == i for i, (d, s) in enumerate(pairs)):  # the usual decode step: same requests, same order
        input_ids[: len(pairs)].copy_(pending_ids[: len(pairs)])
        return
    dst, src = zip(*pairs)
    index = to_device([dst, src], input_ids.device, torch.long)
    input_ids[index[0]] = pending_ids[index[1]]


class ModelRunner:
    def __init__(self, model: Qwen4ExpForCausalLM, cache: CacheManager, device, graphs=None):
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.config = model.config
        self.graphs = graphs  # CUDAGraphRunner for decode steps, or None (eager)

    @torch.inference_mode()
    def execute(self, chunks: list[RequestChunk], pending_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Runs one step; returns the logits (fp32) of the wanted rows, in the order of `chunks`. `pending_ids`:
        the previous step's sampled ids on the device, for chunks with a `pending_row`. After a CUDA-graph decode step
        the logits are a view of the graph's output, valid until the next step is launched: work reading them must
        be queued before (the sampler's is) or take a copy. (The engine keeps logits past a step only for prompt
        logprobs, whose steps never run as graphs: graphs want each request's last row only.)"""
        if self.graphs is not None and self.graphs.can_run(chunks):
            return self.graphs.execute(chunks, pending_ids)
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)  # decodes first
        ordered = [chunks[i] for i in order]
        meta = build_metadata(ordered, self.config, self.cache.page_size, self.device)
        last_rows = [q - 1 for q in meta.query_start_loc_cpu[1:]]
        fill_pending(meta.input_ids, [(last_rows[j], c.pending_row) for j, c in enumerate(ordered)], pending_ids)
        hidden = self.model(meta, self.cache.tensors)
        logits = self.model.compute_logits(hidden[meta.logits_indices])
        if order == sorted(order):
            return logits
        # rows come grouped per chunk in execution order; put the groups back in the caller's order
        sizes = [len(c.token_ids) - c.logits_from for c in ordered]
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        where = {i: j for j, i in enumerate(order)}
        index = [r for i in range(len(chunks)) for r in range(starts[where[i]], starts[where[i]] + sizes[where[i]])]
        return logits[to_device(index, logits.device)]
