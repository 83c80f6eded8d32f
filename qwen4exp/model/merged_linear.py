"""Projections of one input computed as one GEMM, and the checkpoint tensors each model parameter holds.

`MergedLinear` owns one weight whose rows are its parts' checkpoint weights one after another (e.g. GDN's
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), followed by zero rows up to a multiple of ROW_ALIGN: an output row
of 1409 bf16 values (the MoE router, shared gate and shared expert) is not 16-byte aligned, and cuBLAS then falls
back to a kernel 3-4x slower. Several small GEMMs become one larger, better-fed one.

A part is named as its checkpoint module, relative to the merged module's parent (`in_proj_z`,
`indexer.index_qk_proj`); its checkpoint tensors are `<parent>.<part>.weight` (and `.bias` for the parts given a
bias). `named_checkpoint_tensors` lists every parameter of a model under its checkpoint names, one entry per part.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops

ROW_ALIGN = 8


class TensorShapeError(ValueError):
    """A checkpoint tensor does not fit the model; the message names the checkpoint tensor."""


class MergedLinear(nn.Module):
    """Linear projections of the same input as one GEMM; `forward` returns the parts' outputs in order.

    parts: {part name: output rows}, in output order. bias_parts: the parts that have a bias (the merged bias is zero
    elsewhere); no bias parameter when empty."""

    def __init__(self, in_features: int, parts: dict[str, int], bias_parts: tuple[str, ...] = ()):
        super().__init__()
        self.in_features = in_features
        self.part_names = tuple(parts)
        self.part_sizes = tuple(parts.values())
        self.part_rows = {}
        start = 0
        for name, rows in parts.items():
            self.part_rows[name] = slice(start, start + rows)
            start += rows
        self.rows = start
        self.padding = -start % ROW_ALIGN
        self.bias_parts = tuple(bias_parts)
        if unknown := set(bias_parts) - set(parts):
            raise ValueError(f"bias_parts: {sorted(unknown)} are not parts of {self.part_names}")
        self.weight = nn.Parameter(torch.zeros(self.rows + self.padding, in_features))
        self.bias = nn.Parameter(torch.zeros(self.rows + self.padding)) if bias_parts else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[x @ part.T + part bias for each part], views of one GEMM's output (its padding columns dropped)."""
        return ops.linear.merged_linear(x, self.weight, self.part_sizes, self.bias)

    def zero_unused_(self) -> None:
        """Zero what no checkpoint tensor fills, the padding rows and the bias of the parts without one (after the
        parameters were re-allocated uninitialised)."""
        self.weight.data[self.rows:].zero_()
        if self.bias is not None:
            self.bias.data.zero_()

    def part_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint leaf, e.g. "in_proj_z.weight"; the rows it occupies, a view) for every part's tensors."""
        for part in self.part_names:
            yield f"{part}.weight", self.weight.data[self.part_rows[part]]
            if part in self.bias_parts:
                yield f"{part}.bias", self.bias.data[self.part_rows[part]]

    def load_part_(self, leaf: str, tensor: torch.Tensor, checkpoint_name: str) -> None:
        """Copy checkpoint tensor `checkpoint_name`, a part's `leaf` ("in_proj_z.weight"), into its rows.

        The one place a part's checkpoint tensor enters the merged weight: a part stored in another form (e.g. a
        quantised weight with its scales) is converted here."""
        part, param = leaf.rsplit(".", 1)
        copy_checked_(getattr(self, param).data[self.part_rows[part]], tensor, checkpoint_name)


def copy_checked_(dest: torch.Tensor, tensor: torch.Tensor, checkpoint_name: str) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise TensorShapeError(f"{checkpoint_name}: checkpoint {tuple(tensor.shape)}, model {tuple(dest.shape)}")
    dest.copy_(tensor)


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one checkpoint tensor lives: rows `tensor` (a view) of `parameter`, as part `leaf` of `module` when that
    is a MergedLinear."""

    name: str  # checkpoint name, e.g. model.layers.0.linear_attn.in_proj_z.weight
    parameter: str  # model parameter name, e.g. model.layers.0.linear_attn.in_proj.weight
    tensor: torch.Tensor
    module: nn.Module
    leaf: str | None = None  # the part's tensor within `module`, e.g. in_proj_z.weight

    def load_(self, tensor: torch.Tensor, checkpoint_name: str | None = None) -> None:
        """Copy a checkpoint tensor in (named `checkpoint_name` in errors, by default this entry's name)."""
        name = checkpoint_name or self.name
        if self.leaf is None:
            copy_checked_(self.tensor, tensor, name)
        else:
            self.module.load_part_(self.leaf, tensor, name)


def named_checkpoint_tensors(model: nn.Module) -> Iterator[CheckpointTensor]:
    """Every parameter under its checkpoint name: a merged module's weight as one entry per part (a view of its
    rows), any other parameter as itself (its checkpoint name is its parameter name). Tied parameters once."""
    seen = set()
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        if isinstance(module, MergedLinear):
            parent = module_name.rpartition(".")[0]
            parent += "." if parent else ""
            for leaf, view in module.part_tensors():
                yield CheckpointTensor(parent + leaf, prefix + leaf.rsplit(".", 1)[1], view, module, leaf)
            continue
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield CheckpointTensor(prefix + name, prefix + name, p.data, module)
