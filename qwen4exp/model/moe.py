"""Sparse MoE on every layer: softmax router, top-k (renormalised), SwiGLU experts, sigmoid-gated shared expert."""

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig


class MLP(nn.Module):
    """SwiGLU weights of the shared expert (applied in SparseMoeBlock, fused with the router's GEMM)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


class Router(nn.Module):
    """Router weights [E, H]; the softmax top-k is ops.moe.route."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))


class Experts(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x, topk_weights, topk_ids, shared_expert=None):
        return ops.moe.moe_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, shared_expert)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sh = self.shared_expert
        router_logits, shared_gate, gate, up = ops.linear.merged_linear(
            x, [self.gate.weight, self.shared_expert_gate.weight, sh.gate_proj.weight, sh.up_proj.weight])
        weights, ids = ops.moe.route(router_logits, self.gate.top_k, self.gate.norm_topk_prob)
        return self.experts(x, weights, ids, shared_expert=(gate, up, sh.down_proj.weight, shared_gate))
