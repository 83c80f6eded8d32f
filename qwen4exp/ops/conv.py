"""Causal depthwise conv1d over a flat batch of sequences, with per-request state slots."""

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: list[int],
    state_slots: list[int],
    has_initial_state: list[bool],
    dilation: int = 1,
    activation: str | None = "silu",
) -> torch.Tensor:
    """x: [T, C] new inputs of all requests; weight: [C, K]; conv_state: [S, C, L], L = (K-1)*dilation.

    Request r owns rows query_start_loc[r]:query_start_loc[r+1] and state row state_slots[r], which holds its last L
    inputs (zeros for a new request, whatever the slot held before). Returns act(conv) [T, C] and writes each
    request's new last-L inputs back into its slot.
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
        conv_state[slot] = window[:, -state_len:]
    return out
