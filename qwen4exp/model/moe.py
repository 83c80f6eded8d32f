"""Sparse MoE on every layer: softmax router, top-k (renormalised), SwiGLU experts, sigmoid-gated shared expert.

Over several ranks the router is replicated and the shared expert split by its intermediate size. The routed experts
are split by intermediate size too (tensor parallel: every rank holds a slice of every expert), or placed whole, an
equal range of experts per rank (expert parallel: a rank computes the pairs routed to its experts). Either way a
rank's output is a partial sum over the block, and one all-reduce (the combine) joins them; every rank routes the
same tokens, so the dispatch needs no collective of its own."""

from collections.abc import Iterator

import torch
from torch import nn

from .. import distributed, ops
from ..config import ModelConfig
from ..distributed import Shard
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
        state = distributed.state()
        # this rank's experts [e0, e1) and intermediate columns [i0, i1) of each (see the module docstring)
        self.experts_range, self.columns = (0, e), (0, i)
        if state.parallel and state.expert_parallel:
            self.experts_range = distributed.split(e, "experts", "num_experts")
        elif state.parallel:
            self.columns = distributed.split(i, "columns", "moe_intermediate_size")
        self.global_intermediate_size, self.global_num_experts = i, e
        # expert parallel: the first expert of this rank, by which routed ids are shifted (None: every expert here)
        self.first_expert = self.experts_range[0] if state.parallel and state.expert_parallel else None
        e, i = self.experts_range[1] - self.experts_range[0], self.columns[1] - self.columns[0]
        self.num_experts, self.intermediate_size, self.hidden_size = e, i, h
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)

    def forward(self, x, topk_weights, topk_ids, shared_expert=None):
        if self.first_expert is not None:  # pairs routed to other ranks' experts weigh 0 here
            local = topk_ids - self.first_expert
            here = (local >= 0) & (local < self.num_experts)
            topk_weights = topk_weights * here
            topk_ids = torch.where(here, local, torch.zeros_like(local))
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

    def part_shard(self, leaf: str) -> Shard | None:
        """This rank's part of a stacked checkpoint tensor (transformers' [E, 2I, H] gate_up_proj, [E, H, I]
        down_proj)."""
        if self.first_expert is not None:
            return 0, (self.experts_range,)
        i0, i1 = self.columns
        if (i0, i1) == (0, self.global_intermediate_size):
            return None
        if leaf.startswith("gate_up_proj"):
            full = self.global_intermediate_size
            return 1, ((i0, i1), (full + i0, full + i1))
        return 2, ((i0, i1),)

    def local_expert(self, expert: int) -> int | None:
        """The row of checkpoint expert `expert` in the stacked tensors, None when another rank holds it."""
        if not self.experts_range[0] <= expert < self.experts_range[1]:
            return None
        return expert - self.experts_range[0]

    def expert_shard(self, proj: str) -> Shard | None:
        """This rank's part of one expert's checkpoint projection (gate_proj, up_proj [I, H]; down_proj [H, I])."""
        i0, i1 = self.columns
        if (i0, i1) == (0, self.global_intermediate_size):
            return None
        return (1 if proj == "down_proj" else 0), ((i0, i1),)

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
        s0, s1 = distributed.split(config.shared_expert_intermediate_size, "columns",
                                   "shared_expert_intermediate_size")
        shared = s1 - s0  # this rank's
        self.reduce = distributed.world_size() > 1
        shards = {}
        if self.reduce:
            shards = {"shared_expert.gate_proj": distributed.rows((s0, s1)),
                      "shared_expert.up_proj": distributed.rows((s0, s1))}
        # every projection of the block input: router logits [E], the shared expert's gate logit, gate and up
        self.in_proj = MergedLinear(config.hidden_size, {
            "gate": config.num_experts, "shared_expert_gate": 1,
            "shared_expert.gate_proj": shared, "shared_expert.up_proj": shared},
            quantizable=("shared_expert.gate_proj", "shared_expert.up_proj"), shards=shards)
        self.experts = Experts(config)
        self.shared_expert = SharedExpert(config.hidden_size, shared)
        if self.reduce:
            self.shared_expert.down_proj.checkpoint_shards = {"weight": distributed.columns(s0, s1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits, shared_gate, gate, up = self.in_proj(x)
        weights, ids = ops.moe.route(router_logits, self.top_k, self.norm_topk_prob)
        down = self.shared_expert.down_proj
        shared = (gate, up, down.weight, shared_gate)
        if down.weight_scale_inv is not None:
            shared += (down.weight_scale_inv,)
        out = self.experts(x, weights, ids, shared_expert=shared)
        return distributed.all_reduce(out) if self.reduce else out
