"""Causal depthwise conv1d over a flat batch of sequences, with per-request state slots."""

import torch
import torch.nn.functional as F

from ._dispatch import HAS_TRITON, fast_path

if HAS_TRITON:
    from . import conv_triton


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: list[int],
    state_slots: list[int],
    has_initial_state: list[bool],
    dilation: int = 1,
    activation: str | None = "silu",
    token_slots: list[int] | None = None,
) -> torch.Tensor:
    """x: [T, C] new inputs of all requests; weight: [C, K]; conv_state: [S, C, L], L = (K-1)*dilation.

    Request r owns rows query_start_loc[r]:query_start_loc[r+1] and state row state_slots[r], which holds its last L
    inputs (zeros for a new request, whatever the slot held before). Returns act(conv) [T, C] and writes each
    request's new last-L inputs back into its slot. token_slots [T] (speculative verification): for a request whose
    first row has a token slot (a verified one), the state after each of its rows but the last (the last L inputs
    up to it) is also written into that row's slot where it is >= 0; other requests' rows store nothing.
    """
    out = torch.empty_like(x)
    state_len = conv_state.shape[-1]
    channels, kernel = weight.shape
    for r, slot in enumerate(state_slots):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end == start:
            continue
        prev = conv_state[slot] if has_initial_state[r] else conv_state.new_zeros(channels, state_len)
        window = torch.cat([prev, x[start:end].t().to(conv_state.dtype)], dim=-1)  # [C, L + n]
        y = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], groups=channels, dilation=dilation)[0]
        if activation == "silu":
            y = F.silu(y)
        out[start:end] = y.t().to(x.dtype)
        if token_slots is not None and token_slots[start] >= 0:
            for t in range(start, end - 1):
                if token_slots[t] >= 0:
                    conv_state[token_slots[t]] = window[:, t - start + 1: t - start + 1 + state_len]
        conv_state[slot] = window[:, -state_len:]
    return out


def causal_conv1d(x, weight, conv_state, meta, dilation: int = 1, activation: str | None = "silu",
                  split: tuple[int, int, int] | None = None):
    """Step-level dispatch. GPU: a step of one-token requests takes the fused update kernel (graph capturable),
    any other step the varlen kernel over the whole flat batch, which also stores the states of verified rows
    (`meta.state_token_slots`). CPU: the reference.

    split: return the output's three channel parts of these widths (GDN's q, k, v), which the varlen kernel writes
    as contiguous tensors."""
    if not (HAS_TRITON and fast_path(x)):
        out = causal_conv1d_ref(x, weight, conv_state, meta.query_start_loc_cpu, meta.state_slots_cpu,
                                meta.has_initial_state, dilation, activation, meta.state_token_slots_cpu)
        return out if split is None else out.split(list(split), -1)
    if meta.num_decode_reqs == meta.num_reqs:  # no verified request: those bring more than one token
        out = conv_triton.causal_conv1d_update(x, weight, conv_state, meta.state_slots, meta.has_initial, dilation,
                                               activation)
        return out if split is None else out.split(list(split), -1)
    return conv_triton.causal_conv1d_varlen(x, weight, conv_state, meta.query_start_loc, meta.token_local,
                                            meta.state_slots, meta.has_initial, dilation, activation, split=split,
                                            token_slots=meta.state_token_slots)
