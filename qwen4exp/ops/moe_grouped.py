"""Routed experts through `torch._grouped_mm`: a pure-torch fast path for large token counts (prefill).

Same contract as `qwen4exp.ops.moe.moe_experts`:
    x [N, H], gate_up [E, 2I, H] (gate rows first), down [E, H, I], topk_ids [N, k] (int64/int32),
    topk_weights [N, k]  ->  [N, H] in x's dtype (optionally with the gated shared expert added).

The N*k (token, slot) pairs are sorted by expert, each token's row is written to its pairs' sorted rows
(`spread_rows`), each expert's contiguous run goes through one grouped GEMM (CUTLASS on sm90 for bf16), and
`sum_pairs` adds each token's k rows, weighted, where they lie. Every step has
shapes fixed by N, k and E and reads the group offsets on the device, so nothing syncs with the host.
`torch._grouped_mm` is a private op: `grouped_mm_available` guards it and `grouped_moe` falls back to the reference
otherwise.
"""

import torch

from .moe import moe_block_ref, silu_mul


def grouped_mm_available(x: torch.Tensor) -> bool:
    """True when `torch._grouped_mm` can take x's dtype on x's device (static: decided by dtype/device only)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        # The CUTLASS kernel is bf16-only and needs Hopper or later; older GPUs would hit a slow fallback or fail.
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def sort_pairs_ref(topk_ids: torch.Tensor, num_experts: int):
    """The N*k (token, slot) pairs of topk_ids [N, k] in expert order, ties in pair order (stable). Returns
    order [N*k] int64 (the pair at each sorted position), offs [E] int32 (the end of each expert's run: the grouped
    GEMM's offsets) and rows [N*k] int64 (each pair's sorted position, the inverse of order)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    # scatter_add instead of bincount: bincount's output size depends on the data, so it syncs on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=flat.device)
    return order, offs, rows


def grouped_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Same contract as `moe_experts` (see the module docstring)."""
    if not grouped_mm_available(x):
        return moe_block_ref(x, gate_up, down, topk_ids, topk_weights, shared)
    num_tokens, top_k = topk_ids.shape
    num_experts = gate_up.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(x)
    # Weights as stored ([E, out, in]) transposed to [E, in, out]: column-major views, which the op accepts without
    # a copy. The pair outputs are summed, weighted, per token where they lie (each pair's row in y is `rows`):
    # deterministic (no atomics), no scatter of y.
    if not x.is_cuda:
        from .triton_moe import sum_pairs_ref

        order, offs, rows = sort_pairs_ref(topk_ids, num_experts)
        h = torch._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(silu_mul(*h.chunk(2, dim=-1)), down.transpose(1, 2), offs=offs)
        return sum_pairs_ref(y, top_k, rows.view(num_tokens, top_k), topk_weights, shared).to(x.dtype)

    from .triton_moe import silu_mul_halves, sort_pairs, spread_rows, sum_pairs

    _, offs, rows = sort_pairs(topk_ids, num_experts)
    h = torch._grouped_mm(spread_rows(x, rows, top_k), gate_up.transpose(1, 2), offs=offs)
    # one pass over both halves (inductor's compiled silu_mul ran at ~60% of bandwidth here)
    y = torch._grouped_mm(silu_mul_halves(h), down.transpose(1, 2), offs=offs)
    return sum_pairs(y, top_k, rows.view(num_tokens, top_k), topk_weights, shared).to(x.dtype)
