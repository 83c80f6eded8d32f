"""Greedy verification of a speculative step on the device: how many drafts each request keeps when it decodes
greedily from the raw logits. It runs inside the speculative CUDA graphs (engine/cuda_graph.py), so its shapes are
fixed by the step's rows and requests, and nothing is read on the host.

A verified request owns 1 + k consecutive rows: its last token, then its k drafts. Each row but the last has a draft
after it and its state stored (`state_token_slots` >= 0); the draft is the next row's input id. The request keeps
the leading run of rows whose argmax equals the draft after them; every other request keeps none."""

import torch

from ._dispatch import HAS_TRITON, fast_path

if HAS_TRITON:
    from . import acceptance_triton


def greedy_acceptance(tokens: torch.Tensor, state_token_slots: torch.Tensor, input_ids: torch.Tensor,
                      token_local: torch.Tensor, token_req: torch.Tensor, num_reqs: int,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """`greedy_acceptance_ref`; on the fast path one Triton launch instead of some twenty small kernels."""
    if HAS_TRITON and fast_path(tokens):
        return acceptance_triton.greedy_acceptance(tokens, state_token_slots, input_ids, token_local, token_req,
                                                   num_reqs, rows)
    return greedy_acceptance_ref(tokens, state_token_slots, input_ids, token_local, token_req, num_reqs, rows)


def greedy_acceptance_ref(tokens: torch.Tensor, state_token_slots: torch.Tensor, input_ids: torch.Tensor,
                          token_local: torch.Tensor, token_req: torch.Tensor, num_reqs: int,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
    """The drafts each request keeps, [num_reqs] long. The step's T rows: state_token_slots, input_ids, token_local
    (a row's index within its request), token_req (its request) [T]; tokens: the argmax of the rows `rows` (None: of
    all T rows), which hold every row of a verified request."""
    num_tokens = input_ids.shape[0]
    if rows is None:
        rows = torch.arange(num_tokens, device=tokens.device)
    has_draft = state_token_slots[rows] >= 0
    after_draft = (rows > 0) & (state_token_slots[(rows - 1).clamp_min(0)] >= 0)  # a verified request's last row
    accept = has_draft & (tokens == input_ids[(rows + 1).clamp_max(num_tokens - 1)])
    local = token_local[rows]
    stop = torch.where(accept, num_tokens, torch.where(has_draft | after_draft, local, 0))
    first = torch.full((num_reqs,), num_tokens, dtype=torch.long, device=tokens.device)
    return first.scatter_reduce_(0, token_req[rows], stop, "amin")
