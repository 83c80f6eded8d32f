"""Routed experts (SwiGLU) of the sparse MoE block: torch reference."""

import torch
import torch.nn.functional as F


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """x: [N, H]; gate_up: [E, 2I, H] (gate rows first); down: [E, H, I]; topk_ids/weights: [N, k].
    Returns sum_j w_j * down_e(silu(gate_e x) * up_e x) over each token's k experts, [N, H] in x's dtype."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
