"""Sparse MoE on every layer: softmax router, top-k (renormalised), SwiGLU experts, sigmoid-gated shared expert."""

from collections.abc import Iterator

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..ops.fp8 import BLOCK, FP8
from .merged_linear import (
    Linear,
    MergedLinear,
    TensorShapeError,
    copy_checked_,
    copy_scale_,
    load_weight_,
    round_up,
    scale_shape,
)


class SharedExpert(nn.Module):
    """The shared expert's down projection; its gate_proj and up_proj are parts of SparseMoeBlock.in_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)


class Experts(nn.Module):
    """The routed experts, stacked as transformers stacks them: gate_up_proj [E, 2I, H] (gate rows, then up rows)
    and down_proj [E, H, I]. Either may be block-scaled fp8 (`use_fp8_`), with `gate_up_proj_scale_inv`
    [E, 2I'/128, ceil(H/128)] (I' = I rounded up to 128: the gate rows and the up rows each padded with zero rows, so
    no row block mixes them) and `down_proj_scale_inv` [E, ceil(H/128), ceil(I/128)]. A checkpoint stores them per
    expert (`experts.{e}.gate_proj.weight`, with `.weight_scale_inv` when fp8), loaded by `load_expert_`."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts, self.intermediate_size, self.hidden_size = e, i, h
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)

    def forward(self, x, topk_weights, topk_ids, shared_expert=None):
        return ops.moe.moe_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, shared_expert,
                                   gate_up_scale=self.gate_up_proj_scale_inv, down_scale=self.down_proj_scale_inv)

    def quantizable(self) -> tuple[str, ...]:
        return ("gate_up_proj", "down_proj")

    def use_fp8_(self, leaves) -> None:
        e, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        with torch.device(self.down_proj.device):
            if "gate_up_proj" in leaves:
                rows = 2 * round_up(i, BLOCK)
                self.gate_up_proj = nn.Parameter(torch.empty(e, rows, h, dtype=FP8), requires_grad=False)
                self.gate_up_proj_scale_inv = nn.Parameter(torch.ones(e, *scale_shape(rows, h)), requires_grad=False)
            if "down_proj" in leaves:
                self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=FP8), requires_grad=False)
                self.down_proj_scale_inv = nn.Parameter(torch.ones(e, *scale_shape(h, i)), requires_grad=False)

    def zero_unused_(self) -> None:
        """Zero the padding rows after the gate rows and after the up rows of fp8 experts."""
        half, i = self.gate_up_proj.shape[1] // 2, self.intermediate_size
        if half > i:
            self.gate_up_proj.data[:, i:half].zero_()
            self.gate_up_proj.data[:, half + i:].zero_()

    def part_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.named_parameters(recurse=False):
            yield name, p.data

    def parameter_name(self, leaf: str) -> str:
        return leaf

    def expert_tensors(self, expert: int, proj: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight rows, scale rows or None) of one expert's gate_proj [I, H], up_proj [I, H] or down_proj [H, I]."""
        if proj == "down_proj":
            scale = self.down_proj_scale_inv
            return self.down_proj.data[expert], None if scale is None else scale.data[expert]
        half = self.gate_up_proj.shape[1] // 2
        start = 0 if proj == "gate_proj" else half
        weight = self.gate_up_proj.data[expert, start:start + self.intermediate_size]
        scale = self.gate_up_proj_scale_inv
        if scale is None:
            return weight, None
        blocks = half // BLOCK
        return weight, scale.data[expert, start // BLOCK:start // BLOCK + blocks]

    def load_expert_(self, expert: int, proj: str, leaf: str, tensor: torch.Tensor, checkpoint_name: str) -> bool:
        """Copy checkpoint tensor `experts.{expert}.{proj}.{leaf}` (leaf: weight or weight_scale_inv) into its
        rows; a weight in another dtype for fp8 experts is quantized, its scale written too (returns True then)."""
        weight, scale = self.expert_tensors(expert, proj)
        if leaf == "weight":
            return load_weight_(weight, scale, tensor, checkpoint_name)
        if scale is None:
            raise TensorShapeError(f"{checkpoint_name}: a scale for experts stored in "
                                   f"{str(weight.dtype).removeprefix('torch.')}")
        copy_scale_(scale, tensor, checkpoint_name, tuple(weight.shape))
        return False

    def load_part_(self, leaf: str, tensor: torch.Tensor, checkpoint_name: str) -> bool:
        """A stacked checkpoint tensor (transformers' layout, or this module's own); stacked weights in another dtype
        for fp8 experts are quantized expert by expert."""
        param = getattr(self, leaf)
        if leaf.endswith("_scale_inv"):
            weight = getattr(self, leaf.removesuffix("_scale_inv"))
            copy_scale_(param.data, tensor, checkpoint_name, tuple(weight.shape))
            return False
        if param.dtype != FP8 or tensor.dtype == FP8:
            copy_checked_(param.data, tensor, checkpoint_name)
            return False
        i = self.intermediate_size
        expected = (self.num_experts, 2 * i, self.hidden_size) if leaf == "gate_up_proj" else tuple(param.shape)
        if tuple(tensor.shape) != expected:
            raise TensorShapeError(f"{checkpoint_name}: checkpoint {tuple(tensor.shape)}, model {expected}")
        for e in range(self.num_experts):
            if leaf == "down_proj":
                self.load_expert_(e, "down_proj", "weight", tensor[e], checkpoint_name)
            else:
                self.load_expert_(e, "gate_proj", "weight", tensor[e, :i], checkpoint_name)
                self.load_expert_(e, "up_proj", "weight", tensor[e, i:], checkpoint_name)
        return True


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        shared = config.shared_expert_intermediate_size
        # every projection of the block input: router logits [E], the shared expert's gate logit, gate and up
        self.in_proj = MergedLinear(config.hidden_size, {
            "gate": config.num_experts, "shared_expert_gate": 1,
            "shared_expert.gate_proj": shared, "shared_expert.up_proj": shared},
            quantizable=("shared_expert.gate_proj", "shared_expert.up_proj"))
        self.experts = Experts(config)
        self.shared_expert = SharedExpert(config.hidden_size, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits, shared_gate, gate, up = self.in_proj(x)
        weights, ids = ops.moe.route(router_logits, self.top_k, self.norm_topk_prob)
        down = self.shared_expert.down_proj
        shared = (gate, up, down.weight, shared_gate)
        if down.weight_scale_inv is not None:
            shared += (down.weight_scale_inv,)
        return self.experts(x, weights, ids, shared_expert=shared)
