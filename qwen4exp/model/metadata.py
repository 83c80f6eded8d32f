"""The forward contract: one flat batch of new tokens from several requests, and the step metadata describing it.

Built once per step from the scheduled chunks (engine/step_builder.py); layers read it and never look at requests or
the scheduler.
Request r owns token rows query_start_loc[r] : query_start_loc[r+1]; its first new token sits at logical position
context_lens[r] (the number of its tokens already in the caches).

Speculative verification: a verified request brings its last sampled token and the drafts after it. Its recurrent
states (GDN conv and recurrent state, PLE conv window) are stored after every row, each into its own slot
(`state_token_slots`), so the engine can continue from the state after the last accepted row; the state after its
last row goes to its state slot, as for every request. Its attention caches need nothing: rows of rejected drafts
are rewritten when their positions are computed again.
"""

from dataclasses import dataclass, field

import torch


def build_q_tiles(query_start_loc: list[int], context_lens: list[int], tile_tokens: int) -> torch.Tensor:
    """Host tile table for `prefill_paged_attention`: int32 [num_tiles, 3] = (request, first flat token row, rows)
    for every `tile_tokens`-token piece of every request (one-token requests included), so the tiles cover every
    row of the step exactly once and none straddles two requests.

    Ordered by the tile's last logical position, longest first: a tile's cost grows with the keys it reads, and
    launching the longest ones first keeps one late long tile from running alone at the end of the grid. The
    order only affects speed (context_lens may be anything for correctness).
    """
    assert tile_tokens >= 1
    qsl = torch.tensor(query_start_loc, dtype=torch.long)
    ctx = torch.tensor(context_lens, dtype=torch.long)
    n = qsl[1:] - qsl[:-1]
    per_req = (n + tile_tokens - 1) // tile_tokens
    req = torch.repeat_interleave(torch.arange(n.numel()), per_req)
    starts = torch.cumsum(per_req, 0) - per_req  # each request's first tile in the list
    local = (torch.arange(req.numel()) - starts[req]) * tile_tokens  # first token's index within its request
    first = qsl[req] + local
    rows = torch.clamp(n[req] - local, max=tile_tokens)
    last_pos = ctx[req] + local + rows - 1
    order = torch.argsort(-last_pos, stable=True)
    return torch.stack([req, first, rows], 1)[order].to(torch.int32).contiguous()


class HostFieldUnset(RuntimeError):
    """A host copy of the step layout was read in a CUDA-graph step, which does not fill them."""


class _HostCopy:
    """A StepMetadata field holding a host copy of per-request layout. Eager steps set it; CUDA-graph steps leave it
    unset (None): a graph replays the layout of whatever step fills its device buffers, so a host value would
    describe the capture instead, and an op reading it would silently compute the wrong thing. Reading it unset
    raises HostFieldUnset naming the field."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.key = name, "_" + name

    def __get__(self, meta, owner=None):
        if meta is None:
            return None  # the dataclass default: unset
        value = meta.__dict__.get(self.key)
        if value is None:
            raise _unset(self.name)
        return value

    def __set__(self, meta, value) -> None:
        meta.__dict__[self.key] = value


def _unset(name: str) -> HostFieldUnset:
    return HostFieldUnset(
        f"StepMetadata.{name} is not set in a CUDA-graph step: the graph replays other steps' layouts, so ops on "
        "the in-graph path must read the device tensors (query_start_loc, context_lens, state_slots, has_initial, "
        "token_req, token_pos, token_local) and num_reqs / num_tokens / num_decode_reqs")


@dataclass(eq=False)
class StepMetadata:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] (or [3, T] for M-RoPE) rotary positions; token_pos unless images moved them
    query_start_loc: torch.Tensor  # [R+1] int32, device
    context_lens: torch.Tensor  # [R] int32, tokens already cached per request
    block_tables: torch.Tensor  # [R, max_pages] int32 page ids of each request (attention caches)
    slot_mapping: torch.Tensor  # [T] int64 flat cache row of each new token
    state_slots: torch.Tensor  # [R] int64 state slot of each request (GDN and PLE conv / recurrent states)
    ngram_context: torch.Tensor  # [R, ngram_size-1] int64 committed tokens before the first new token, EOS padded
    logits_indices: torch.Tensor  # [L] int64 rows whose logits are wanted
    # QSA blocks completed in this step (their compressed keys are computed and stored once):
    new_block_token_slots: torch.Tensor  # [NB, C] int64 flat cache rows of the block's C tokens
    new_block_slots: torch.Tensor  # [NB] int64 flat block-key rows
    new_block_positions: torch.Tensor  # [NB] (or [3, NB]) rotary position of each block's first token
    # Per-token layout on the device (vectorised fast paths; no host data, so CUDA-graph safe):
    token_req: torch.Tensor  # [T] int64 request index of each token
    token_pos: torch.Tensor  # [T] int64 logical position of each token in its request
    token_local: torch.Tensor  # [T] int64 index of the token among its request's new tokens
    has_initial: torch.Tensor  # [R] bool request has cached state (context_len > 0)
    # Sizes, valid in every step (a graph's are those of its buffers: padding rows and requests included):
    num_reqs: int  # R
    num_tokens: int  # T
    num_decode_reqs: int  # requests 0 .. num_decode_reqs-1 bring exactly one token (the runner orders them first)
    max_seq_len: int  # static upper bound on any request's length after this step (sizes QSA score buffers)
    # Host copies that drive per-request loops without device syncs; unset in CUDA-graph steps (see _HostCopy):
    query_start_loc_cpu: list[int] | None = _HostCopy()
    context_lens_cpu: list[int] | None = _HostCopy()
    state_slots_cpu: list[int] | None = _HostCopy()
    # The step is captured in (or replayed from) a CUDA graph: ops must take paths that read per-request data from
    # the device tensors only, whatever mix of requests it holds.
    in_cuda_graph: bool = False
    # Per-step values an op derives once and reuses in every layer (see prefill_chunk_indices).
    derived: dict = field(default_factory=dict, repr=False, compare=False)
    # Speculative verification (see the module docstring): the next num_verify_reqs requests after the decodes are
    # verified ones, which the recurrent ops run token by token; state_token_slots [T] int64 is the slot each row's
    # state is also stored into (-1: none). None (and 0) in steps without verification.
    num_verify_reqs: int = 0
    state_token_slots: torch.Tensor | None = None
    state_token_slots_cpu: list[int] | None = None
    # image tokens: their rows [K] int64 and the vision tower's features [K, H] that replace their embeddings
    # (None in steps without image tokens)
    mm_rows: torch.Tensor | None = None
    mm_features: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (f"StepMetadata(num_reqs={self.num_reqs}, num_tokens={self.num_tokens}, "
                f"num_decode_reqs={self.num_decode_reqs}, num_verify_reqs={self.num_verify_reqs}, "
                f"max_seq_len={self.max_seq_len}, "
                f"in_cuda_graph={self.in_cuda_graph})")

    @property
    def has_initial_state(self) -> list[bool]:
        """Host copy of has_initial (unset in CUDA-graph steps)."""
        if self.__dict__.get("_context_lens_cpu") is None:
            raise _unset("has_initial_state")
        return [c > 0 for c in self.context_lens_cpu]

    def prefill_chunk_indices(self, chunk: int) -> torch.Tensor:
        """[num_chunks, 2] int64 on the device: (prefill request, chunk within it) for every `chunk`-token piece of
        the requests after the decodes and verified requests: fla's varlen chunk layout. Built on the host once per
        step: derived from the device copy of query_start_loc, it costs a device sync in every GDN layer."""
        key = ("prefill_chunk_indices", chunk)
        if key not in self.derived:
            qsl = self.query_start_loc_cpu[self.num_decode_reqs + self.num_verify_reqs:]
            rows = [(r, c) for r in range(len(qsl) - 1) for c in range(-(-(qsl[r + 1] - qsl[r]) // chunk))]
            host = torch.tensor(rows, dtype=torch.long).reshape(-1, 2)
            self.derived[key] = host.to(self.query_start_loc.device, non_blocking=True)
        return self.derived[key]

    def prefill_q_tiles(self, tile_tokens: int) -> torch.Tensor:
        """int32 [num_tiles, 3] on the device: (request, first token row, rows) for every `tile_tokens`-token piece
        of every request, decodes included, longest context first: the tile table of
        `ops.attention_triton.prefill_paged_attention` (see `build_q_tiles`). Built on the host once per step and
        shared by every attention layer, like prefill_chunk_indices."""
        key = ("prefill_q_tiles", tile_tokens)
        if key not in self.derived:
            host = build_q_tiles(self.query_start_loc_cpu, self.context_lens_cpu, tile_tokens)
            self.derived[key] = host.to(self.query_start_loc.device, non_blocking=True)
        return self.derived[key]
