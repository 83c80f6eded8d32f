"""One step's layout, built from its scheduled chunks: the one place that derives positions, cache slots, block
tables, state slots, n-gram context and QSA block rows (the forward contract, model/metadata.py).

Eager steps move the layout to the device as StepMetadata (`StepLayout.to_metadata`); the CUDA-graph runner copies
it into its persistent buffers with its padding rules (cuda_graph.py). The layout is built on the host while the
previous step runs on the GPU (asynchronous scheduling), so it is computed with numpy over the whole step: a
decode step of 64 requests with 1k-token contexts has 4k block-table entries, converted once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from ..model import StepMetadata
from ..multimodal import MultiModalState


@dataclass
class RequestChunk:
    """One request's share of a step."""

    token_ids: list[int]  # tokens fed this step
    context_len: int  # tokens of the request already in the caches
    history: list[int]  # committed tokens before token_ids (only the last ngram_size-1 are used)
    pages: list[int]  # page ids covering at least context_len + len(token_ids) tokens
    state_slot: int
    logits_from: int  # first row (within token_ids) whose logits are wanted; len(token_ids) for none
    # tokens still on the device: the chunk's last num_pending tokens are rows pending_row .. pending_row +
    # num_pending - 1 of a tensor of ids (asynchronous scheduling: the previous step's samples, one token; the draft
    # layer's first step: the tokens a verification emits), their entries in token_ids placeholders; -1: none
    pending_row: int = -1
    num_pending: int = 1
    # speculative verification (token_ids: the last sampled token, then drafts): the slots that receive the
    # recurrent states after rows 0 .. len(token_ids)-2 (model/metadata.py); None for any other chunk
    state_token_slots: list[int] | None = None
    # a request with images: its MultiModalState (M-RoPE positions of every logical position), and the image
    # tokens of this chunk as (first row within token_ids, the vision tower's features [rows, H] for them)
    mm: MultiModalState | None = None
    mm_features: list[tuple[int, torch.Tensor]] | None = None


def to_device(values, device, dtype=None) -> torch.Tensor:
    """torch.tensor(values, device=device) without its stream synchronisation (a blocking host-to-device copy waits
    for the GPU to finish everything queued, which would stall asynchronous scheduling)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def host_to_device(array: np.ndarray, device) -> torch.Tensor:
    """A numpy array on `device`, without a stream synchronisation (see to_device)."""
    return torch.from_numpy(array).to(device, non_blocking=True)


def fill_pending(input_ids: torch.Tensor, pending: list[tuple[int, int]], pending_ids: torch.Tensor | None) -> None:
    """input_ids[row] = pending_ids[src] for every (row, src) in `pending`, without reading the ids on the host."""
    if not pending:
        return
    if all(d == i and s == i for i, (d, s) in enumerate(pending)):  # the usual decode step: same requests, same order
        input_ids[: len(pending)].copy_(pending_ids[: len(pending)])
        return
    index = to_device(list(zip(*pending)), input_ids.device, torch.long)
    input_ids[index[0]] = pending_ids[index[1]]


def pending_rows(chunks: list[RequestChunk], query_start_loc: list[int]) -> list[tuple[int, int]]:
    """(token row, row of the ids on the device) of each pending token: a chunk's last num_pending tokens, read
    from its pending_row on (see fill_pending)."""
    return [(query_start_loc[r + 1] - c.num_pending + i, c.pending_row + i) for r, c in enumerate(chunks)
            if c.pending_row >= 0 for i in range(c.num_pending)]


@dataclass
class StepLayout:
    """One step on the host, requests in the order of the chunks. Request r owns token rows
    query_start_loc[r] : query_start_loc[r+1]. Arrays are int64 unless noted."""

    query_start_loc: list[int]  # [R+1]
    context_lens: list[int]  # [R] tokens already in the caches
    state_slots: list[int]  # [R]
    num_decode_reqs: int  # leading one-token requests
    max_seq_len: int  # the longest request's length after this step
    input_ids: np.ndarray  # [T]; a pending token's entry is a placeholder 0 (see `pending`)
    positions: np.ndarray  # [T] logical position of each token
    slot_mapping: np.ndarray  # [T] flat cache row of each token
    token_req: np.ndarray  # [T] request of each token
    token_local: np.ndarray  # [T] index of each token among its request's new tokens
    block_tables: np.ndarray  # [R, W] int32 pages of each request, zero padded; W = the most pages (at least 1)
    ngram_context: np.ndarray  # [R, ngram_size-1] committed tokens before each request's first new token, EOS padded
    # QSA blocks completed in this step, in token order:
    new_block_rows: np.ndarray  # [NB] token row of each block's last token (the token that completes it)
    new_block_token_slots: np.ndarray  # [NB, C] flat cache rows of the block's tokens
    new_block_slots: np.ndarray  # [NB] flat block-key row
    new_block_positions: np.ndarray  # [NB] position of the block's first token
    logits_indices: np.ndarray  # [L] token rows whose logits are wanted, in request order
    pending: list[tuple[int, int]]  # (token row, row of the ids on the device) of each pending token
    # speculative verification: requests num_decode_reqs .. + num_verify_reqs - 1 are verified ones, and
    # state_token_slots [T] the slot of each row's state (-1: none); None without them
    num_verify_reqs: int = 0
    state_token_slots: np.ndarray | None = None
    # steps with a request with images: the rotary positions [3, T] and block positions [3, NB] (M-RoPE), and the
    # image token rows [K] with their features [K, H]; None in other steps (rotary positions = logical positions)
    rope_positions: np.ndarray | None = None
    rope_block_positions: np.ndarray | None = None
    mm_rows: np.ndarray | None = None
    mm_features: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def has_initial(self) -> np.ndarray:
        """[R] bool: the request has cached state."""
        return np.asarray(self.context_lens) > 0

    def text_rope(self) -> tuple[np.ndarray, np.ndarray] | None:
        """A step with images (rope_positions set) whose tokens and completed blocks are all text, where M-RoPE's
        t, h and w rows are equal and it is 1-D rotary at that position: (each token's rotary offset from its
        logical position [T], the blocks' rotary positions [NB]), which a CUDA graph's 1-D buffers take. None when
        the step feeds image tokens or some rotary position has distinct rows."""
        rope, block = self.rope_positions, self.rope_block_positions
        if self.mm_rows is not None or (rope != rope[:1]).any() or (block != block[:1]).any():
            return None
        return rope[0] - self.positions, block[0]

    def to_metadata(self, device) -> StepMetadata:
        """The layout on `device` as an eager step's metadata (host copies included)."""
        def dev(array):
            return host_to_device(array, device)

        positions = dev(self.positions)
        rope = positions if self.rope_positions is None else dev(self.rope_positions)
        return StepMetadata(
            input_ids=dev(self.input_ids),
            positions=rope,
            query_start_loc=dev(np.asarray(self.query_start_loc, dtype=np.int32)),
            context_lens=dev(np.asarray(self.context_lens, dtype=np.int32)),
            block_tables=dev(self.block_tables),
            slot_mapping=dev(self.slot_mapping),
            state_slots=dev(np.asarray(self.state_slots, dtype=np.int64)),
            ngram_context=dev(self.ngram_context),
            logits_indices=dev(self.logits_indices),
            new_block_token_slots=dev(self.new_block_token_slots),
            new_block_slots=dev(self.new_block_slots),
            new_block_positions=dev(self.new_block_positions if self.rope_block_positions is None
                                    else self.rope_block_positions),
            token_req=dev(self.token_req),
            token_pos=positions,
            token_local=dev(self.token_local),
            has_initial=dev(self.has_initial()),
            num_reqs=self.num_reqs,
            num_tokens=self.num_tokens,
            num_decode_reqs=self.num_decode_reqs,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=self.query_start_loc,
            context_lens_cpu=self.context_lens,
            state_slots_cpu=self.state_slots,
            num_verify_reqs=self.num_verify_reqs,
            state_token_slots=None if self.state_token_slots is None else dev(self.state_token_slots),
            state_token_slots_cpu=None if self.state_token_slots is None else self.state_token_slots.tolist(),
            mm_rows=None if self.mm_rows is None else dev(self.mm_rows),
            mm_features=None if self.mm_features is None else self.mm_features.to(device, non_blocking=True),
        )


class StepBuilder:
    """Builds StepLayouts for one model and page size."""

    def __init__(self, config: ModelConfig, page_size: int):
        self.page_size = page_size
        self.C = config.indexer_compress_ratio if config.qsa else 0
        # a QSA block never straddles a page, so a block's rows follow from its last token's row alone
        assert not self.C or page_size % self.C == 0, "page_size must be a multiple of indexer_compress_ratio"
        self.n_ctx = max(config.ngram_size - 1, 0)
        self.eos = config.eos_token_id if config.eos_token_id is not None else 0

    def build(self, chunks: list[RequestChunk], multimodal: bool = False) -> StepLayout:
        """multimodal: some chunk has images (RequestChunk.mm), which its caller knows from building the chunks."""
        ps, C, n_ctx = self.page_size, self.C, self.n_ctx
        R = len(chunks)
        lengths = [len(c.token_ids) for c in chunks]
        ctx = [c.context_len for c in chunks]
        qsl = [0, *itertools.accumulate(lengths)]
        T = qsl[-1]
        num_decode = next((r for r, n in enumerate(lengths) if n != 1), R)

        # block tables: one conversion of the step's page ids, each row zero padded to the widest
        width = max(max((len(c.pages) for c in chunks), default=1), 1)
        zeros = [0] * width
        flat = []
        for c in chunks:
            flat += c.pages
            flat += zeros[len(c.pages):]
        tables = np.fromiter(flat, dtype=np.int32, count=R * width).reshape(R, width)

        if num_decode == R:  # decodes only: one token per request
            token_req = np.arange(R)
            token_local = np.zeros(R, dtype=np.int64)
            positions = np.array(ctx, dtype=np.int64)
            input_ids = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=R)
        else:
            token_req = np.repeat(np.arange(R), lengths)
            starts = np.array(qsl[:-1], dtype=np.int64)
            token_local = np.arange(T) - starts[token_req]
            positions = np.array(ctx, dtype=np.int64)[token_req] + token_local
            input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                                    count=T)
        slot_mapping = tables[token_req, positions // ps].astype(np.int64) * ps + positions % ps

        if C:  # a token at position p completes a block when p + 1 is a multiple of C
            rows = np.flatnonzero((positions + 1) % C == 0)
            first_slots = slot_mapping[rows] - (C - 1)
            block_token_slots = first_slots[:, None] + np.arange(C)
            block_slots = first_slots // C
            block_positions = positions[rows] - (C - 1)
        else:
            rows = block_slots = block_positions = np.zeros(0, dtype=np.int64)
            block_token_slots = np.zeros((0, 1), dtype=np.int64)

        context = []
        if n_ctx:
            pad = [self.eos] * n_ctx
            for c in chunks:
                hist = c.history[-n_ctx:]
                context += pad[len(hist):]
                context += hist
        ngram = np.array(context, dtype=np.int64).reshape(R, n_ctx)

        if all(c.logits_from == n - 1 for c, n in zip(chunks, lengths)):  # each request's last row
            logits = np.array(qsl[1:], dtype=np.int64) - 1
        else:
            logits = np.fromiter(itertools.chain.from_iterable(
                range(qsl[r] + c.logits_from, qsl[r + 1]) for r, c in enumerate(chunks)), dtype=np.int64)

        # verified requests: right after the decodes (the runner orders them so)
        num_verify, token_slots = 0, None
        while num_decode + num_verify < R and chunks[num_decode + num_verify].state_token_slots is not None:
            num_verify += 1
        if num_verify:
            assert not any(c.state_token_slots is not None for c in chunks[num_decode + num_verify:]), \
                "verified requests must follow the decodes"
            token_slots = np.full(T, -1, dtype=np.int64)
            for r in range(num_decode, num_decode + num_verify):
                ts = chunks[r].state_token_slots
                assert len(ts) == lengths[r] - 1
                token_slots[qsl[r]: qsl[r] + len(ts)] = ts

        layout = StepLayout(
            query_start_loc=qsl,
            context_lens=ctx,
            state_slots=[c.state_slot for c in chunks],
            num_decode_reqs=num_decode,
            max_seq_len=max((c + n for c, n in zip(ctx, lengths)), default=1),
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            token_req=token_req,
            token_local=token_local,
            block_tables=tables,
            ngram_context=ngram,
            new_block_rows=rows,
            new_block_token_slots=block_token_slots,
            new_block_slots=block_slots,
            new_block_positions=block_positions,
            logits_indices=logits,
            pending=pending_rows(chunks, qsl),
            num_verify_reqs=num_verify,
            state_token_slots=token_slots,
        )
        if multimodal:
            self._add_multimodal(layout, chunks)
        return layout

    @staticmethod
    def _add_multimodal(layout: StepLayout, chunks: list[RequestChunk]) -> None:
        """M-RoPE positions of the step's tokens and completed blocks, and its image tokens' features."""
        rope = np.broadcast_to(layout.positions, (3, layout.num_tokens)).copy()
        block_rope = np.broadcast_to(layout.new_block_positions, (3, len(layout.new_block_positions))).copy()
        block_req = layout.token_req[layout.new_block_rows]
        rows, features = [], []
        for r, c in enumerate(chunks):
            if c.mm is None:
                continue
            start, end = layout.query_start_loc[r], layout.query_start_loc[r + 1]
            rope[:, start:end] = c.mm.rope_positions(layout.positions[start:end])
            mine = block_req == r
            if mine.any():
                block_rope[:, mine] = c.mm.rope_positions(layout.new_block_positions[mine])
            for first, f in c.mm_features or ():
                rows.append(np.arange(start + first, start + first + f.shape[0]))
                features.append(f)
        layout.rope_positions, layout.rope_block_positions = rope, block_rope
        if features:
            layout.mm_rows = np.concatenate(rows)
            layout.mm_features = torch.cat(features)
