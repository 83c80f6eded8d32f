"""Projections, their weights in the model dtype or in block-scaled fp8, and the checkpoint tensors each model
parameter holds.

`MergedLinear` computes projections of one input (e.g. GDN's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) as one
GEMM per run of consecutive parts of the same kind (model dtype or fp8), each a `StackedLinear` whose weight holds
its parts' checkpoint rows one after another. Several small GEMMs become one larger, better-fed one.

A part is named as its checkpoint module, relative to the merged module's parent (`in_proj_z`,
`indexer.index_qk_proj`); its checkpoint tensors are `<parent>.<part>.weight` (and `.bias` for the parts given a
bias, `.weight_scale_inv` when it is fp8). `named_checkpoint_tensors` lists every parameter of a model under its
checkpoint names, one entry per part, with the part of the checkpoint tensor this rank holds (`distributed.Shard`:
a module's `checkpoint_shards`, or a MergedLinear's `shards`) when the model is split over several ranks.

Block-scaled fp8 (`ops.fp8`): a quantized weight is float8_e4m3fn with `weight_scale_inv`, one fp32 scale per
128 x 128 block, as a quantized checkpoint stores it. The modules that can hold fp8 weights (`MergedLinear` parts
marked quantizable, `Linear`, the stacked experts) are vLLM's set for `--quantization fp8`: the GDN, attention and
PLE projections and the routed and shared experts; the hyper-connection projections, the router, the shared-expert
gate, norms, convs, embeddings and lm_head stay in the model dtype. Which of them are fp8 is decided before any
weight is read (`use_fp8_`, from the checkpoint's tensor names or the `quantization` option).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from ..distributed import Shard
from ..ops.fp8 import BLOCK, FP8

# Rows of a model-dtype GEMM are padded to a multiple of ROW_ALIGN: an output row of 1409 bf16 values (the MoE router,
# shared gate and shared expert) is not 16-byte aligned, and cuBLAS then falls back to a kernel 3-4x slower.
ROW_ALIGN = 8


class TensorShapeError(ValueError):
    """A checkpoint tensor does not fit the model; the message names the checkpoint tensor."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """The block scales of a rows x cols fp8 weight: [ceil(rows/128), ceil(cols/128)]."""
    return -(-rows // BLOCK), -(-cols // BLOCK)


def _fp8_parameter(shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=FP8), requires_grad=False)


def _scale_parameter(shape) -> nn.Parameter:
    return nn.Parameter(torch.ones(shape, dtype=torch.float32), requires_grad=False)


class StackedLinear(nn.Module):
    """One GEMM of a MergedLinear: consecutive parts of one kind, their rows stacked in `weight`.

    In the model dtype the parts lie back to back, followed by zero rows up to a multiple of ROW_ALIGN. In fp8 each
    part is followed by zero rows up to a multiple of 128, so that every row block and its row of
    `weight_scale_inv` [rows / 128, ceil(in / 128)] belong to one part."""

    def __init__(self, in_features: int, parts: dict[str, int], bias_parts: tuple[str, ...], fp8: bool):
        super().__init__()
        self.part_sizes = tuple(parts.values())
        self.fp8 = fp8
        self.part_rows: dict[str, slice] = {}
        splits = []  # output columns: each part's, then its padding's
        start = 0
        for name, rows in parts.items():
            self.part_rows[name] = slice(start, start + rows)
            padded = round_up(rows, BLOCK) if fp8 else rows
            splits += [rows, padded - rows]
            start += padded
        self.splits = tuple(splits)
        total = start if fp8 else round_up(start, ROW_ALIGN)
        # the rows no checkpoint tensor fills: after each part (fp8), or after the last one
        unused = [(s.stop, s.start + round_up(s.stop - s.start, BLOCK)) for s in self.part_rows.values()] if fp8 \
            else [(start, total)]
        self.unused = [slice(a, b) for a, b in unused if b > a]
        if fp8:
            self.weight = _fp8_parameter((total, in_features))
            self.weight_scale_inv = _scale_parameter(scale_shape(total, in_features))
        else:
            self.weight = nn.Parameter(torch.zeros(total, in_features))
            self.register_parameter("weight_scale_inv", None)
        self.bias = nn.Parameter(torch.zeros(total)) if bias_parts else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.fp8:
            return ops.linear.merged_linear(x, self.weight, self.part_sizes, self.bias)
        return ops.linear.merged_linear(x, self.weight, self.splits, self.bias, scale=self.weight_scale_inv)[::2]

    def scale_rows(self, part: str) -> slice:
        rows = self.part_rows[part]
        return slice(rows.start // BLOCK, -(-rows.stop // BLOCK))


class MergedLinear(nn.Module):
    """Linear projections of the same input; `forward` returns the parts' outputs in order.

    parts: {part name: output rows}, in output order. bias_parts: the parts that have a bias (the merged bias is zero
    elsewhere). quantizable: the parts that may be stored in fp8 (True: all), made fp8 by `use_fp8_`. shards: the
    rows of a part's checkpoint tensor this rank holds (`distributed.Shard`), for the parts split over ranks."""

    def __init__(self, in_features: int, parts: dict[str, int], bias_parts: tuple[str, ...] = (),
                 quantizable: bool | tuple[str, ...] = False, shards: dict[str, Shard] | None = None):
        super().__init__()
        self.in_features = in_features
        self.parts = dict(parts)
        self.shards = dict(shards or {})
        self.part_names = tuple(parts)
        self.bias_parts = tuple(bias_parts)
        self.quantizable_parts = tuple(parts) if quantizable is True else tuple(quantizable or ())
        for field, names in (("bias_parts", self.bias_parts), ("quantizable", self.quantizable_parts)):
            if unknown := set(names) - set(parts):
                raise ValueError(f"{field}: {sorted(unknown)} are not parts of {self.part_names}")
        self._lay_out(fp8_parts=())

    def _lay_out(self, fp8_parts) -> None:
        runs: list[list[str]] = []
        for name in self.part_names:
            if runs and (runs[-1][-1] in fp8_parts) == (name in fp8_parts):
                runs[-1].append(name)
            else:
                runs.append([name])
        self.stacks = nn.ModuleList(
            StackedLinear(self.in_features, {n: self.parts[n] for n in run},
                          tuple(n for n in run if n in self.bias_parts), run[0] in fp8_parts) for run in runs)
        self._stacks = tuple(self.stacks)  # read by forward without ModuleList's indexing
        self.part_stack = {name: stack for run, stack in zip(runs, self.stacks) for name in run}

    @property
    def weight(self) -> torch.Tensor:
        """The stacked weight, when every part is of one kind (one GEMM)."""
        return self._only_stack("weight").weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self._only_stack("bias").bias

    def _only_stack(self, name: str) -> StackedLinear:
        if len(self.stacks) != 1:
            raise AttributeError(f"{name}: the parts are computed by {len(self.stacks)} GEMMs (see .stacks)")
        return self.stacks[0]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[x @ part.T + part bias for each part], views of each GEMM's output (its padding columns dropped)."""
        stacks = self._stacks
        if len(stacks) == 1:  # (forward, not __call__: no hooks to run, a few us less per projection and step)
            return stacks[0].forward(x)
        return tuple(y for stack in stacks for y in stack.forward(x))

    def quantizable(self) -> tuple[str, ...]:
        return tuple(f"{part}.weight" for part in self.quantizable_parts)

    def use_fp8_(self, leaves) -> None:
        """Store the parts whose weights are named in `leaves` ("in_proj_z.weight") in fp8 (the parameters are
        re-created on their device, uninitialised but for the padding and biases)."""
        with torch.device(self.stacks[0].weight.device):
            self._lay_out({leaf.removesuffix(".weight") for leaf in leaves})

    def zero_unused_(self) -> None:
        """Zero what no checkpoint tensor fills, the padding rows and the bias of the parts without one (after the
        parameters were re-allocated uninitialised)."""
        for stack in self.stacks:
            for rows in stack.unused:
                stack.weight.data[rows].zero_()
            if stack.bias is not None:
                stack.bias.data.zero_()

    def part_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint leaf, e.g. "in_proj_z.weight"; the rows it occupies, a view) for every part's tensors."""
        for part in self.part_names:
            stack = self.part_stack[part]
            yield f"{part}.weight", stack.weight.data[stack.part_rows[part]]
            if stack.fp8:
                yield f"{part}.weight_scale_inv", stack.weight_scale_inv.data[stack.scale_rows(part)]
            if part in self.bias_parts:
                yield f"{part}.bias", stack.bias.data[stack.part_rows[part]]

    def part_shard(self, leaf: str) -> Shard | None:
        return self.shards.get(leaf.rsplit(".", 1)[0])

    def parameter_name(self, leaf: str) -> str:
        """The parameter holding part tensor `leaf`, e.g. stacks.0.weight."""
        part, param = leaf.rsplit(".", 1)
        return f"stacks.{list(self.stacks).index(self.part_stack[part])}.{param}"

    def load_part_(self, leaf: str, tensor: torch.Tensor, checkpoint_name: str) -> bool:
        """Copy checkpoint tensor `checkpoint_name`, a part's `leaf` ("in_proj_z.weight"), into its rows.

        The one place a part's checkpoint tensor enters the merged weight: a weight in the model dtype for an fp8
        part is quantized here, its scale written too (returns True then)."""
        part, param = leaf.rsplit(".", 1)
        stack = self.part_stack[part]
        rows = stack.part_rows[part]
        if param == "weight":
            scale = stack.weight_scale_inv.data[stack.scale_rows(part)] if stack.fp8 else None
            return load_weight_(stack.weight.data[rows], scale, tensor, checkpoint_name)
        if param == "weight_scale_inv":
            copy_scale_(stack.weight_scale_inv.data[stack.scale_rows(part)], tensor, checkpoint_name,
                        (rows.stop - rows.start, self.in_features))
        else:
            copy_checked_(getattr(stack, param).data[rows], tensor, checkpoint_name)
        return False


class Linear(nn.Linear):
    """nn.Linear whose weight may be block-scaled fp8 (`use_fp8_`): float8_e4m3fn [N, K] with `weight_scale_inv`
    fp32 [ceil(N/128), ceil(K/128)], as a quantized checkpoint stores them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale_inv", None)
        self.checkpoint_shards: dict[str, Shard] = {}  # the owner's, when this rank holds a part (see the module doc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear.linear(x, self.weight, self.bias, scale=self.weight_scale_inv)

    def quantizable(self) -> tuple[str, ...]:
        return ("weight",)

    def use_fp8_(self, leaves) -> None:
        if "weight" in leaves:
            with torch.device(self.weight.device):
                self.weight = _fp8_parameter((self.out_features, self.in_features))
                self.weight_scale_inv = _scale_parameter(scale_shape(self.out_features, self.in_features))

    def part_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.named_parameters(recurse=False):
            yield name, p.data

    def part_shard(self, leaf: str) -> Shard | None:
        return self.checkpoint_shards.get(leaf.removesuffix("_scale_inv"))

    def parameter_name(self, leaf: str) -> str:
        return leaf

    def load_part_(self, leaf: str, tensor: torch.Tensor, checkpoint_name: str) -> bool:
        if leaf == "weight":
            scale = None if self.weight_scale_inv is None else self.weight_scale_inv.data
            return load_weight_(self.weight.data, scale, tensor, checkpoint_name)
        if leaf == "weight_scale_inv":
            copy_scale_(self.weight_scale_inv.data, tensor, checkpoint_name, tuple(self.weight.shape))
        else:
            copy_checked_(getattr(self, leaf).data, tensor, checkpoint_name)
        return False


def copy_checked_(dest: torch.Tensor, tensor: torch.Tensor, checkpoint_name: str) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise TensorShapeError(f"{checkpoint_name}: checkpoint {tuple(tensor.shape)}, model {tuple(dest.shape)}")
    if tensor.dtype == FP8 and dest.dtype != FP8:  # the loader dequantizes such tensors with their scales first
        raise TensorShapeError(f"{checkpoint_name}: a float8 tensor for a {str(dest.dtype).removeprefix('torch.')} "
                               f"parameter, without its scale")
    dest.copy_(tensor)


def check_scale_shape(scale: torch.Tensor, weight_shape: tuple[int, ...], checkpoint_name: str) -> None:
    """A weight of shape [..., N, K] has block scales [..., ceil(N/128), ceil(K/128)]; else a TensorShapeError."""
    *lead, n, k = weight_shape
    expected = (*lead, *scale_shape(n, k))
    if tuple(scale.shape) != expected:
        raise TensorShapeError(
            f"{checkpoint_name}: checkpoint {tuple(scale.shape)}, expected {expected} = "
            f"[{''.join(f'{e}, ' for e in lead)}ceil(N/128), ceil(K/128)] for the {n} x {k} weight")


def copy_scale_(dest: torch.Tensor, tensor: torch.Tensor, checkpoint_name: str, weight_shape: tuple[int, ...]) -> None:
    """Copy the block scales of a weight of shape weight_shape ([..., N, K]) into `dest`."""
    check_scale_shape(tensor, weight_shape, checkpoint_name)
    copy_checked_(dest, tensor, checkpoint_name)


def load_weight_(weight: torch.Tensor, scale: torch.Tensor | None, tensor: torch.Tensor, checkpoint_name: str) -> bool:
    """Copy checkpoint weight `tensor` into `weight`. An fp8 `weight` given a tensor in another dtype gets it quantized
    (`ops.fp8.quantize_weight`, on the weight's device) and its block scales written into `scale`: returns True."""
    if weight.dtype != FP8 or tensor.dtype == FP8:
        copy_checked_(weight, tensor, checkpoint_name)
        return False
    if tuple(tensor.shape) != tuple(weight.shape):
        raise TensorShapeError(f"{checkpoint_name}: checkpoint {tuple(tensor.shape)}, model {tuple(weight.shape)}")
    wq, s = ops.fp8.quantize_weight(tensor.to(weight.device))
    weight.copy_(wq)
    scale.copy_(s)
    return True


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one checkpoint tensor lives: rows `tensor` (a view) of `parameter`, as `leaf` of `module` when that
    module loads its own tensors (a MergedLinear's part, an fp8-capable projection or the stacked experts)."""

    name: str  # checkpoint name, e.g. model.layers.0.linear_attn.in_proj_z.weight
    parameter: str  # model parameter name, e.g. model.layers.0.linear_attn.in_proj.stacks.0.weight
    tensor: torch.Tensor
    module: nn.Module
    leaf: str | None = None  # the tensor within `module`, e.g. in_proj_z.weight
    # the part of the checkpoint tensor this rank holds (None: all of it); a scale's entry has its weight's
    shard: Shard | None = None

    def load_(self, tensor: torch.Tensor, checkpoint_name: str | None = None) -> bool:
        """Copy a checkpoint tensor in (named `checkpoint_name` in errors, by default this entry's name). Returns
        whether the weight was quantized on the way, its scale (entry `name + "_scale_inv"`) written too."""
        name = checkpoint_name or self.name
        if self.leaf is None:
            copy_checked_(self.tensor, tensor, name)
            return False
        return self.module.load_part_(self.leaf, tensor, name)


def _checkpoint_prefix(module_name: str, module: nn.Module) -> str:
    """A MergedLinear's parts are named from its parent; any other module's tensors from itself."""
    if isinstance(module, MergedLinear):
        module_name = module_name.rpartition(".")[0]
    return module_name + "." if module_name else ""


def named_checkpoint_tensors(model: nn.Module) -> Iterator[CheckpointTensor]:
    """Every parameter under its checkpoint name: a merged module's weight as one entry per part (a view of its
    rows), an fp8 weight's scale as `<weight>_scale_inv` (`weight_scale_inv`, `gate_up_proj_scale_inv`), any other
    parameter as itself (its checkpoint name is its parameter name). Tied parameters once."""
    seen = set()
    owned = ()  # prefixes of the modules that list their submodules' parameters (a MergedLinear's stacks)
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        if prefix.startswith(owned):
            continue
        if hasattr(module, "part_tensors"):
            owned += (prefix,)
            parent = _checkpoint_prefix(module_name, module)
            for leaf, view in module.part_tensors():
                yield CheckpointTensor(parent + leaf, prefix + module.parameter_name(leaf), view, module, leaf,
                                       module.part_shard(leaf))
            continue
        shards = getattr(module, "checkpoint_shards", {})
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield CheckpointTensor(prefix + name, prefix + name, p.data, module, shard=shards.get(name))


def quantizable_weights(model: nn.Module) -> list[str]:
    """Checkpoint names of the weights `model` can hold in fp8 (see the module docstring): merged parts'
    `<part>.weight`, `Linear` weights and the stacked experts' `gate_up_proj` and `down_proj`."""
    return [_checkpoint_prefix(name, m) + leaf for name, m in model.named_modules() if hasattr(m, "quantizable")
            for leaf in m.quantizable()]


def use_fp8_(model: nn.Module, weights) -> None:
    """Store the checkpoint weights named in `weights` (some of `quantizable_weights`) in fp8 with their scales;
    their parameters are re-created on their device."""
    weights = set(weights)
    for name, m in model.named_modules():
        if hasattr(m, "quantizable"):
            prefix = _checkpoint_prefix(name, m)
            leaves = [leaf for leaf in m.quantizable() if prefix + leaf in weights]
            if leaves:
                m.use_fp8_(leaves)
