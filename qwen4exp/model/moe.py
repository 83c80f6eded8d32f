"""Sparse MoE on every layer: softmax router, top-k (renormalised), SwiGLU experts, sigmoid-gated shared expert."""

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from .merged_linear import MergedLinear


class SharedExpert(nn.Module):
    """The shared expert's down projection; its gate_proj and up_proj are parts of SparseMoeBlock.in_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


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
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        shared = config.shared_expert_intermediate_size
        # every projection of the block input: router logits [E], the shared expert's gate logit, gate and up
        self.in_proj = MergedLinear(config.hidden_size, {
            "gate": config.num_experts, "shared_expert_gate": 1,
            "shared_expert.gate_proj": shared, "shared_expert.up_proj": shared})
        self.experts = Experts(config)
        self.shared_expert = SharedExpert(config.hidden_size, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits, shared_gate, gate, up = self.in_proj(x)
        weights, ids = ops.moe.route(router_logits, self.top_k, self.norm_topk_prob)
        return self.experts(x, weights, ids, shared_expert=(gate, up, self.shared_expert.down_proj.weight, shared_gate))
