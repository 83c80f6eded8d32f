"""Checkpoint loading: HF safetensors (one file or an index with shards) into `Qwen4ExpForCausalLM`.

A checkpoint name, with `model.language_model.` (multimodal checkpoints) read as `model.` and `model.mtp.` as `mtp.`,
is handled by the first entry of `RULES` whose pattern it matches:
- skipped: `hashstats_*`, `token_lookup` and the final mixers' unused `block_inject_weight`; the vision tower's
  `model.visual.*` for a config without `vision_config` (`SKIP_VISION`); the MTP layers' `mtp.*` (`SKIP_MTP`)
  unless the model was built with them (`load_model(..., mtp=True)`), when a checkpoint without any is an error
  that says so;
- per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (and `.weight_scale_inv`): copied into expert e's rows of
  the stacked expert tensors (`EXPERT_PARTS`, `model.moe.Experts.load_expert_`); already stacked
  `experts.gate_up_proj` / `experts.down_proj` are model tensors;
- the n-gram table, whole or as `ngram_embedding.shard_{i}.weight`: written in order into `ngram_embedding.weight`,
  straight into the table's final place (GPU, or page-locked host memory) and dtype (an fp8 table is quantised on the
  way with one scale per table; an fp8 checkpoint table brings its `ngram_embedding.weight_scale`);
- the PLE hash buffers, which must equal the values computed from the config;
- any other name: a model tensor (`model.merged_linear.named_checkpoint_tensors`), a parameter or one part of a
  merged projection, which loads it (`CheckpointTensor.load_`).
Tensors are copied into preallocated parameters one at a time; errors list every missing, unexpected and
mis-shaped tensor by its checkpoint name.

A model split over ranks (`qwen4exp.distributed`) holds a part of most tensors (`CheckpointTensor.shard`, per-expert
parts from `Experts`, a range of n-gram table rows): each rank reads only the bytes of its parts from the files
(`_Loading.part`) and skips the experts and table shards other ranks hold.

Block-scaled fp8 (`ops.fp8`, the layout of `model.merged_linear`): a checkpoint weight stored as float8_e4m3fn comes
with its scales `<weight>_scale_inv` (`x.weight_scale_inv`). The model is built with fp8 parameters for the
checkpoint's fp8 weights it can hold in fp8 (`fp8_weights`, decided from the names before any tensor is read), or for
every quantizable weight with `quantization="fp8"` on a checkpoint without fp8 weights. A weight in another dtype
for an fp8 parameter is quantized on the way, one tensor at a time; an fp8 weight the model keeps in its dtype (a
hyper-connection projection, the router, lm_head) is dequantized once both it and its scale have arrived.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .. import distributed, ops
from ..config import ModelConfig
from ..memory import DeviceMemory, check_weights_fit
from ..model import Qwen4ExpForCausalLM
from ..model.merged_linear import (
    TensorShapeError,
    check_scale_shape,
    named_checkpoint_tensors,
    quantizable_weights,
    use_fp8_,
)
from ..model.moe import Experts
from ..model.ple import NGramEmbedding
from .init import fill_, fill_fp8_
from .ngram_table import (
    FP8,
    fill_random_,
    fp8_scale,
    host_empty,
    on_host,
    resolve_table_dtype,
    resolve_table_on_host,
    write_rows_,
)
from .safetensors_io import checkpoint_files, iterate_files, read_infos

logger = logging.getLogger("qwen4exp")

# an n-gram table in shards, or whole
_SHARD = re.compile(r"^(?P<table>.*\.ngram_embedding)\.(?:shard_(?P<shard>\d+)\.)?weight$")
_EXPERT = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.(?P<leaf>weight|weight_scale_inv)$")
# (rule, pattern): see the module docstring; the first match handles the tensor
RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("skip", re.compile(r"hashstats_|token_lookup|hyper_connection_mixer\.block_inject_weight|"
                        r"rotary_emb\.inv_freq")),
    ("expert", _EXPERT),
    ("table_scale", re.compile(r"^(?P<table>.*\.ngram_embedding)\.weight_scale$")),
    ("table_rows", _SHARD),
    ("hash_buffer", re.compile(r"\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$")),
    ("tensor", re.compile("")),
)
# the rules before RULES for a model without its MTP layers, and for one without a vision tower
SKIP_MTP = ("skip", re.compile(r"^mtp\."))
SKIP_VISION = ("skip", re.compile(r"^model\.visual\."))
MTP = "mtp."  # the MTP layers' checkpoint names (normalised)
# a per-expert projection -> the stacked parameter holding it
EXPERT_PARTS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
SCALE = "_scale_inv"  # a block-scaled fp8 weight `x` has its scales in `x_scale_inv`


class WeightLoadError(ValueError):
    pass


def table_names(model: Qwen4ExpForCausalLM) -> list[str]:
    return [f"model.layers.{i}.ple.ple_embedding.ngram_embedding.weight"
            for i, layer in enumerate(model.model.layers) if layer.ple is not None]


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device,
    tables_on_host: bool = False,
    table_dtype: torch.dtype | None = None,
    model: Qwen4ExpForCausalLM | None = None,
    fp8: Iterable[str] = (),
    mtp: bool = False,
) -> Qwen4ExpForCausalLM:
    """Allocate the model directly on `device` (parameters uninitialised but for the merged projections' zero
    padding rows and biases; fp32 kept for A_log and dt_bias), with its MTP layers when `mtp`.

    The n-gram tables are stored in `table_dtype` (default `dtype`), with the model or in host memory; a host table
    of a GPU model is page-locked so that kernels read its rows in place. `fp8`: the checkpoint weights stored as
    block-scaled fp8 (see `fp8_weights`), their scales in fp32. `model`: the config's model on the meta device, if
    the caller already built one (with its fp8 weights chosen)."""
    device = torch.device(device)
    if model is None:
        with torch.device("meta"):
            model = Qwen4ExpForCausalLM(config, mtp=mtp)
        use_fp8_(model, fp8)
    tables = set(table_names(model))
    for module_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if f"{module_name}.{name}" in tables:
                if tables_on_host:
                    new = host_empty(tuple(p.shape), table_dtype or dtype, pin=device.type == "cuda")
                else:
                    new = torch.empty(p.shape, dtype=table_dtype or dtype, device=device)
            else:
                keep_fp32 = name in ("A_log", "dt_bias")
                keep = p.dtype == FP8 or name.endswith(SCALE)  # fp8 weights and their fp32 scales
                new = torch.empty(p.shape, dtype=p.dtype if keep else torch.float32 if keep_fp32 else dtype,
                                  device=device)
            setattr(module, name, torch.nn.Parameter(new, requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = b.to(device)
    for module in model.modules():
        if hasattr(module, "zero_unused_"):
            module.zero_unused_()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _module_of(weight: str) -> str:
    """The module a checkpoint weight belongs to: x for x.weight, x.experts for x.experts.gate_up_proj."""
    return weight.removesuffix(".weight") if weight.endswith(".weight") else weight.rpartition(".")[0]


def checkpoint_fp8_weights(names: Iterable[str]) -> set[str]:
    """The weights a checkpoint with tensors `names` stores in fp8, those with a `<weight>_scale_inv` beside them,
    named as the model tensors they load into (a per-expert weight as its stacked `experts.gate_up_proj`)."""
    stored = set()
    for name in map(_normalise, names):
        if not name.endswith(SCALE):
            continue
        if (m := _EXPERT.search(name)) is not None:
            stored.add(f"{m['experts']}.{EXPERT_PARTS[m['proj']]}")
        else:
            stored.add(name.removesuffix(SCALE))
    return stored


def fp8_weights(model: Qwen4ExpForCausalLM, config: ModelConfig, checkpoint_names: Iterable[str] | None,
                quantization: str | None) -> set[str]:
    """The checkpoint weights `model` (on the meta device) holds in fp8, decided before any tensor is read: the
    checkpoint's own fp8 weights (`checkpoint_fp8_weights`) that the model can hold in fp8; without any (a checkpoint
    in bf16, or no checkpoint: dummy weights), every quantizable weight when `quantization` is "fp8" or the config
    has a `quantization_config`, less the modules it names in modules_to_not_convert."""
    quantizable = quantizable_weights(model)
    if checkpoint_names is not None:
        stored = checkpoint_fp8_weights(checkpoint_names)
        if stored:
            return stored & set(quantizable)
    quant = config.quantization_config
    if quantization is None and (quant is None or checkpoint_names is not None):
        return set()
    return {w for w in quantizable if quant is None or quant.converts(_module_of(w))}


def _normalise(name: str) -> str:
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    if name.startswith("model.mtp."):
        name = name[len("model."):]
    return name


class MissingMTPError(WeightLoadError):
    """The model was asked for its MTP layers and the checkpoint has none."""

    def __init__(self, config: ModelConfig):
        super().__init__(
            f"the checkpoint has no MTP weights (mtp.*), though its config has mtp_num_hidden_layers="
            f"{config.mtp_num_hidden_layers}: load it without MTP (speculative decoding off), or from a checkpoint "
            f"that ships its MTP layer")


class _TableRows:
    """One n-gram table arriving whole or in row shards, possibly out of order."""

    def __init__(self, name: str, dest: torch.Tensor, shard_rows: list[int] | None, scale: float | None,
                 row_range: tuple[int, int] | None = None):
        """row_range: the table rows [start, stop) `dest` holds (all of them by default)."""
        self.name, self.dest, self.shard_rows, self.scale = name, dest, shard_rows, scale
        self.row_range = row_range or (0, dest.shape[0])
        self.total_rows = dest.shape[0] * (1 if row_range is None else distributed.world_size())
        self.seen: dict[int, int] = {}  # shard index -> rows
        self.pending: dict[int, torch.Tensor] = {}  # shards that came before shard 0 fixed the shard size
        self.fp8_source = False
        self.checkpoint_scale: float | None = None
        self.started = time.perf_counter()
        self.bar = tqdm(total=dest.shape[0], unit="rows", unit_scale=True, leave=False, disable=None,
                        desc=name.split(".ple.")[0] + " n-gram rows")

    def add(self, index: int, tensor: torch.Tensor, errors: list[str]) -> None:
        """Without `shard_rows`, shards must have equal rows except the last, and shard 0 fixes the size."""
        if self.shard_rows is not None:
            self._place(index, tensor, sum(self.shard_rows[:index]), errors)
        elif 0 in self.seen or index == 0:
            rows0 = tensor.shape[0] if index == 0 else self.seen[0]
            self._place(index, tensor, index * rows0, errors)
            for i, t in sorted(self.pending.items()):
                self._place(i, t, i * rows0, errors)
            self.pending.clear()
        else:
            self.pending[index] = tensor

    def skip(self, index: int, rows: int) -> None:
        """A shard none of whose rows this rank holds (not read)."""
        self.seen[index] = rows

    def _place(self, index: int, tensor: torch.Tensor, offset: int, errors: list[str]) -> None:
        dest = self.dest
        if tensor.dim() != 2 or tensor.shape[1] != dest.shape[1] or offset + tensor.shape[0] > self.total_rows:
            errors.append(f"{self.name} shard {index}: {tuple(tensor.shape)} at row {offset} does not fit "
                          f"{(self.total_rows, dest.shape[1])}")
            return
        first, last = max(offset, self.row_range[0]), min(offset + tensor.shape[0], self.row_range[1])
        self.seen[index] = tensor.shape[0]
        if first >= last:
            return
        tensor, offset = tensor[first - offset:last - offset], first - self.row_range[0]
        scale = 1.0
        if tensor.dtype == FP8:
            self.fp8_source = True
        elif dest.dtype == FP8:
            if self.scale is None:
                raise ValueError(f"{self.name}: quantising to fp8 needs the table's scale (a first pass over its rows)")
            scale = self.scale
        write_rows_(dest.data, offset, tensor, scale)
        self.bar.update(tensor.shape[0])

    def finish(self, scale_buffer: torch.Tensor, errors: list[str]) -> None:
        self.bar.close()
        dest, name = self.dest, self.name
        if self.pending:
            errors.append(f"{name}: shards {sorted(self.pending)} arrived without shard 0")
        idx = sorted(self.seen)
        if idx != list(range(len(idx))):
            errors.append(f"{name}: shard indices {idx} are not contiguous from 0")
        elif self.seen and sum(self.seen.values()) != self.total_rows:
            errors.append(f"{name}: shards hold {sum(self.seen.values())} rows, the model needs {self.total_rows}")
        if self.fp8_source and self.checkpoint_scale is None:
            errors.append(f"{name}: the table is float8 but the checkpoint has no "
                          f"{name.removesuffix('.weight')}.weight_scale")
        quantised = dest.dtype == FP8 and not self.fp8_source and self.scale is not None
        scale_buffer.fill_((self.scale if quantised else 1.0) * (self.checkpoint_scale or 1.0))
        if not self.seen:
            return
        place = (("page-locked " if dest.is_pinned() else "") + "host memory") if on_host(dest) else str(dest.device)
        logger.info("%s: %d x %d %s in %s (%.2f GiB), loaded in %.1f s", name, dest.shape[0], dest.shape[1],
                    str(dest.dtype).removeprefix("torch."), place, dest.numel() * dest.element_size() / 2**30,
                    time.perf_counter() - self.started)


@dataclass
class _Destination:
    """Where a checkpoint weight and its scales go: `load` (returns whether it quantized the weight and wrote its
    scales), `load_scale` (None when the model keeps the weight in its dtype), and what to record as loaded."""

    load: Callable[[torch.Tensor, str], bool]
    load_scale: Callable[[torch.Tensor, str], object] | None
    dtype: torch.dtype
    device: torch.device
    loaded: Callable[[], None]
    scale_loaded: Callable[[], None]


class _Loading:
    """The state of one `load_weights`: one method per rule of RULES, each given the checkpoint name as it came, the
    rule's match over the normalised name (`m.string`) and the tensor."""

    def __init__(self, model: Qwen4ExpForCausalLM, shard_rows: dict[str, list[int]] | None,
                 table_scales: dict[str, float] | None, sliced: bool = False):
        """sliced: the tensors arrive as this rank's parts already (read by `part`), else whole."""
        self.sliced = sliced
        self.targets = {t.name: t for t in named_checkpoint_tensors(model)}
        self.table_ranges = {name + ".ngram_embedding.weight": m.row_range for name, m in model.named_modules()
                             if isinstance(m, NGramEmbedding) and m.split_rows}
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
        self.tied_lm_head = model.config.tie_word_embeddings
        self.config = model.config
        self.mtp = model.mtp is not None
        self.shard_rows, self.table_scales = shard_rows or {}, table_scales or {}
        self.loaded: set[str] = set()  # names of self.targets
        self.expert_parts: dict[str, set[tuple[int, str]]] = {}
        self.tables: dict[str, _TableRows] = {}
        self.checkpoint_scales: dict[str, float] = {}
        self.unexpected: list[str] = []
        self.misshaped: list[str] = []
        # block-scaled fp8, by checkpoint weight name (normalised): the weights (raw name, dtype) and scales (raw name)
        # that came, and the fp8 weights or scales held until their partner comes, to be dequantized together
        self.weights_in: dict[str, tuple[str, torch.dtype]] = {}
        self.scales_in: dict[str, str] = {}
        self.held: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
        self.dequantized: list[str] = []
        self.rules = RULES if model.mtp is not None else (SKIP_MTP, *RULES)
        if model.visual is None:
            self.rules = (SKIP_VISION, *self.rules)

    def part(self, raw_name: str, shape: tuple[int, ...]) -> distributed.Shard | None | bool:
        """The part of checkpoint tensor `raw_name` this rank holds: a Shard, None (all of it) or False (none: an
        expert or n-gram table shard another rank holds)."""
        rule, m = self._rule(_normalise(raw_name))
        if rule == "expert":
            experts = self.experts.get(m["experts"])
            if experts is None:
                return None
            if experts.local_expert(int(m["expert"])) is None:
                return False if int(m["expert"]) < experts.global_num_experts else None
            shard = experts.expert_shard(m["proj"])
        elif rule == "tensor":
            name = m.string
            target = self.targets.get(name.removesuffix(SCALE))
            if target is None:
                return None
            shard = target.shard
        elif rule == "table_rows":
            table = m["table"] + ".weight"
            rows, layout = self.table_ranges.get(table), self.shard_rows.get(table)
            if rows is None or layout is None:
                return None
            index = int(m["shard"] or 0)
            offset = sum(layout[:index])
            if offset < rows[1] and offset + shape[0] > rows[0]:
                return None
            if table in self.params:
                self._table(table).skip(index, shape[0])
            return False
        else:
            return None
        if shard is not None and raw_name.endswith(SCALE):
            shard = distributed.scale_shard(shard, ops.fp8.BLOCK, shape)
        return shard

    def _rule(self, name: str) -> tuple[str, re.Match]:
        return next((rule, m) for rule, pattern in self.rules if (m := pattern.search(name)))

    def _cut(self, raw_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor (the tensor itself when it came as the part)."""
        if self.sliced:
            return tensor
        shard = self.part(raw_name, tuple(tensor.shape))
        return tensor if shard is None or shard is True else distributed.take(tensor, shard)

    def skip(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        pass

    def expert(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        stacked, e, proj = f"{m['experts']}.{EXPERT_PARTS[m['proj']]}", int(m["expert"]), m["proj"]
        experts = self.experts.get(m["experts"])
        if experts is None or e >= experts.global_num_experts:
            self.unexpected.append(raw_name)
            return
        e = experts.local_expert(e)
        if e is None:  # another rank's
            return
        tensor = self._cut(raw_name, tensor)
        param = self.params[stacked]
        dest = _Destination(
            lambda t, name: experts.load_expert_(e, proj, "weight", t, name),
            (lambda t, name: experts.load_expert_(e, proj, "weight_scale_inv", t, name)) if param.dtype == FP8
            else None,
            param.dtype, param.device,
            lambda: self.expert_parts.setdefault(stacked, set()).add((e, proj)), lambda: None)
        weight = m.string.removesuffix(SCALE)
        if m["leaf"] == "weight":
            self._weight(raw_name, weight, tensor, dest)
        else:
            self._scale(raw_name, weight, tensor, dest)

    def table_scale(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        table = m["table"] + ".weight"
        if table not in self.params:
            self.unexpected.append(raw_name)
        else:
            self.checkpoint_scales[table] = float(tensor.float().reshape(-1)[0])

    def table_rows(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        table = m["table"] + ".weight"
        if table not in self.params:
            self.unexpected.append(raw_name)
            return
        self._table(table).add(int(m["shard"] or 0), tensor, self.misshaped)

    def _table(self, table: str) -> _TableRows:
        if table not in self.tables:
            self.tables[table] = _TableRows(table, self.params[table], self.shard_rows.get(table),
                                            self.table_scales.get(table), self.table_ranges.get(table))
        return self.tables[table]

    def hash_buffer(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        expected = self.buffers.get(m.string)
        if expected is None:
            self.unexpected.append(raw_name)
        elif not torch.equal(tensor.to(expected.device).long(), expected):
            self.misshaped.append(f"{raw_name}: checkpoint values {tensor.tolist()} differ from the values computed "
                                  f"from the config {expected.tolist()}")

    def tensor(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        name = m.string
        weight = name.removesuffix(SCALE)
        if weight not in self.targets:
            if not (name == "lm_head.weight" and self.tied_lm_head):
                self.unexpected.append(raw_name)
            return
        target, scale = self.targets[weight], self.targets.get(weight + SCALE)
        tensor = self._cut(raw_name, tensor)

        def loaded() -> None:
            self.loaded.add(weight)

        def scale_loaded() -> None:
            self.loaded.add(weight + SCALE)

        dest = _Destination(target.load_, None if scale is None else scale.load_, target.tensor.dtype,
                            target.tensor.device, loaded, scale_loaded)
        if weight == name:
            self._weight(raw_name, weight, tensor, dest)
        else:
            self._scale(raw_name, weight, tensor, dest)

    def _weight(self, raw_name: str, weight: str, tensor: torch.Tensor, dest: _Destination) -> None:
        """A checkpoint weight: copied, quantized on the way for an fp8 parameter, or (fp8 for a parameter in the model
        dtype) held until its scale comes."""
        self.weights_in[weight] = (raw_name, tensor.dtype)
        if tensor.dtype == FP8 and dest.load_scale is None:
            self._hold(weight, "weight", raw_name, tensor, dest)
            return
        if dest.load(tensor, raw_name):
            dest.scale_loaded()
        dest.loaded()

    def _scale(self, raw_name: str, weight: str, tensor: torch.Tensor, dest: _Destination) -> None:
        self.scales_in[weight] = raw_name
        if dest.load_scale is None:
            self._hold(weight, "scale", raw_name, tensor, dest)
            return
        dest.load_scale(tensor, raw_name)
        dest.scale_loaded()

    def _hold(self, weight: str, kind: str, raw_name: str, tensor: torch.Tensor, dest: _Destination) -> None:
        """An fp8 weight the model keeps in its dtype is dequantized once it and its scale have both come."""
        pair = self.held.setdefault(weight, {})
        pair[kind] = (raw_name, tensor)
        if len(pair) < 2 or pair["weight"][1].dtype != FP8:
            return  # (a scale beside a weight that is not fp8 is reported by `finish`)
        del self.held[weight]
        (raw_weight, wq), (raw_scale, scale) = pair["weight"], pair["scale"]
        check_scale_shape(scale, tuple(wq.shape), raw_scale)
        dest.load(ops.fp8.dequantize_weight(wq.to(dest.device), scale.to(dest.device), dest.dtype), raw_weight)
        dest.loaded()
        self.dequantized.append(raw_weight)

    def _fp8_errors(self) -> list[str]:
        errors = []
        for weight, (raw_name, dtype) in self.weights_in.items():
            if dtype == FP8 and weight not in self.scales_in:
                errors.append(f"{raw_name}: a float8 weight without its {raw_name}{SCALE}")
            elif dtype != FP8 and weight in self.scales_in:
                errors.append(f"{self.scales_in[weight]}: a scale beside {raw_name}, which is "
                              f"{str(dtype).removeprefix('torch.')}, not float8")
        for weight, raw_scale in self.scales_in.items():
            if weight not in self.weights_in:
                errors.append(f"{raw_scale}: a scale without its weight {raw_scale.removesuffix(SCALE)}")
        return errors

    def finish(self) -> None:
        """Raise WeightLoadError naming every missing, unexpected and mis-shaped tensor (MissingMTPError for a model
        with MTP layers and a checkpoint without any)."""
        if self.mtp and not any(n.startswith(MTP) for n in self.loaded):
            raise MissingMTPError(self.config)
        for table, rows in self.tables.items():
            rows.checkpoint_scale = self.checkpoint_scales.get(table)
            rows.finish(self.buffers[table + "_scale"], self.misshaped)
            if rows.seen:
                self.loaded.add(table)
        for stacked, parts in self.expert_parts.items():
            kinds = [k for k, param in EXPERT_PARTS.items() if stacked.endswith("." + param)]
            experts = self.params[stacked].shape[0]
            if len(parts) != experts * len(kinds):
                missing = sorted(set(range(experts)) - {e for e, _ in parts}) or "some projections"
                self.misshaped.append(f"{stacked}: experts {missing} missing from the checkpoint")
            self.loaded.update((stacked, stacked + SCALE))  # each expert's scale: checked by _fp8_errors
        fp8_errors = self._fp8_errors()
        reported = {w + SCALE for w, (_, dtype) in self.weights_in.items() if dtype == FP8}
        missing = [n for n in self.targets if n not in self.loaded and n not in reported]
        parts = []
        if weights := [n for n in missing if not n.endswith(SCALE)]:
            parts.append(f"missing tensors ({len(weights)}): {', '.join(weights)}")
        if scales := [n for n in missing if n.endswith(SCALE)]:
            parts.append(f"missing scales ({len(scales)}): {', '.join(scales)}")
        if fp8_errors:
            parts.append(f"fp8 weights and scales without their partner ({len(fp8_errors)}): {'; '.join(fp8_errors)}")
        if self.unexpected:
            parts.append(f"unexpected tensors ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        if self.misshaped:
            parts.append(f"mis-shaped tensors ({len(self.misshaped)}): {'; '.join(self.misshaped)}")
        if parts:
            raise WeightLoadError("checkpoint does not match the model:\n  " + "\n  ".join(parts))
        if self.dequantized:
            logger.info("%d fp8 checkpoint weights dequantized to the model dtype, which the model keeps unquantized "
                        "(%s)", len(self.dequantized), ", ".join(self.dequantized))


def load_weights(
    model: Qwen4ExpForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    shard_rows: dict[str, list[int]] | None = None,
    table_scales: dict[str, float] | None = None,
    loading: _Loading | None = None,
) -> None:
    """Copy (name, tensor) pairs into `model` by RULES. `shard_rows` (table name -> rows of each shard, in order) gives
    exact offsets for n-gram shards; without it shards must have equal rows except the last, and shard 0 fixes the
    size. `table_scales` (table name -> scale) quantises rows arriving in another dtype for an fp8 table. A model
    split over ranks takes each tensor's part of a whole tensor; `loading` (made with `sliced`) when the tensors
    come as the parts its `part` chose."""
    loading = loading or _Loading(model, shard_rows, table_scales)
    for raw_name, tensor in weights:
        name = _normalise(raw_name)
        rule, match = loading._rule(name)
        try:
            getattr(loading, rule)(raw_name, match, tensor)
        except TensorShapeError as e:
            loading.misshaped.append(str(e))
    loading.finish()


def _shard_layout(infos: dict[str, tuple]) -> dict[str, list[int]]:
    tables: dict[str, dict[int, int]] = {}
    for name, (shape, _) in infos.items():
        if m := _SHARD.match(_normalise(name)):
            tables.setdefault(m["table"] + ".weight", {})[int(m["shard"] or 0)] = shape[0]
    return {t: [rows[i] for i in sorted(rows)] for t, rows in tables.items() if sorted(rows) == list(range(len(rows)))}


def _table_of(raw_name: str) -> str | None:
    m = _SHARD.match(_normalise(raw_name))
    return m["table"] + ".weight" if m else None


def table_amax(weights: Iterable[tuple[str, torch.Tensor]], tables: list[str]) -> dict[str, float]:
    """max |row value| of each table over its shards: the first of two passes that quantise a table to fp8."""
    amax = dict.fromkeys(tables, 0.0)
    for raw_name, tensor in weights:
        table = _table_of(raw_name)
        if table in amax and tensor.dtype != FP8 and tensor.numel():
            lo, hi = torch.aminmax(tensor)  # no |tensor| temporary
            amax[table] = max(amax[table], -float(lo), float(hi))
    return amax


def dummy_weights_(model: Qwen4ExpForCausalLM, seed: int = 0) -> None:
    """Random weights in place, on the model's device (vLLM's load_format="dummy"), each checkpoint tensor (each part
    of a merged projection) by its own name's rule. n-gram tables are filled in chunks computed on the model's device,
    so their values do not depend on where the tables live. fp8 weights are drawn and quantized a chunk at a time
    straight into their fp8 rows and scales (`fill_fp8_`); stacked experts one projection at a time, so their
    padding rows stay zero."""
    g = None
    tables = set(table_names(model))
    buffers = dict(model.named_buffers())
    work_device = model.lm_head.weight.device
    entries = {t.name: t for t in named_checkpoint_tensors(model)}
    for t in entries.values():
        if t.name in tables:
            layer = int(t.name.split(".")[2])
            fill_random_(t.tensor, buffers[t.name + "_scale"], seed * 7919 + layer, work_device)
            continue
        if g is None or g.device != t.tensor.device:
            g = torch.Generator(device=t.tensor.device).manual_seed(seed)
        if t.name.endswith(SCALE):
            continue  # written with its weight
        if t.tensor.dtype != FP8:
            fill_(t.name, t.tensor, g)
        elif isinstance(t.module, Experts):
            for proj, param in EXPERT_PARTS.items():
                if param == t.leaf:
                    fill_fp8_(t.name, *t.module.expert_tensors(slice(None), proj), g)
        else:
            fill_fp8_(t.name, t.tensor, entries[t.name + SCALE].tensor, g)


def _weight_bytes(model: Qwen4ExpForCausalLM, dtype: torch.dtype, table_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the n-gram tables in table_dtype, bytes of every other parameter: fp8 weights and their fp32
    scales as they are, the rest in dtype)."""
    tables = set(table_names(model))
    size = lambda dt: torch.tensor([], dtype=dt).element_size()  # noqa: E731
    table = sum(p.numel() for n, p in model.named_parameters() if n in tables) * size(table_dtype)
    other = sum(p.numel() * (p.element_size() if p.dtype == FP8 or n.endswith(SCALE) else size(dtype))
                for n, p in model.named_parameters() if n not in tables)
    return table, other


def _fp8_bytes(model: Qwen4ExpForCausalLM, dtype: torch.dtype) -> int:
    """About the bytes of every weight but the n-gram tables if `--quantization fp8` quantized the quantizable ones:
    one byte a value plus a 4-byte scale per 128 x 128 block (padding rows left out)."""
    quantizable = set(quantizable_weights(model))
    tables = set(table_names(model))
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for t in named_checkpoint_tensors(model):
        n = t.tensor.numel()
        if t.name in tables:
            continue
        if t.name in quantizable:
            total += n + 4 * -(-n // (128 * 128))
        else:
            total += n * (t.tensor.element_size() if t.tensor.dtype == FP8 or t.name.endswith(SCALE) else size)
    return total


def load_model(
    config: ModelConfig,
    model_dir: str | None,
    dtype: torch.dtype,
    device,
    load_format: str = "auto",
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    seed: int = 0,
    ple_table_device: str = "auto",
    ple_table_dtype: str = "auto",
    gpu_memory_utilization: float = 0.9,
    quantization: str | None = None,
    mtp: bool = False,
) -> Qwen4ExpForCausalLM:
    """load_format: "auto"/"safetensors" (files in model_dir), "dummy" (random, no files). `weights` (an iterator of
    (name, tensor)) overrides the files, e.g. for weights already in memory.

    ple_table_device: "gpu" (with the model), "cpu" (host memory, page-locked for a GPU model) or "auto" (the GPU
    when it fits, see ngram_table.resolve_table_on_host). ple_table_dtype: "auto" (fp8 if the checkpoint's table is,
    else the model dtype), "fp8" (e4m3 with one scale per table), or a float dtype name. quantization: None, or
    "fp8" to quantize a checkpoint without fp8 weights on load (see `fp8_weights`). mtp: also load the MTP draft
    layers (`model.mtp`): a ConfigError when the config has none, a MissingMTPError when the checkpoint has none."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format: unknown value {load_format!r} (expected auto, safetensors or dummy)")
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization: unknown value {quantization!r} (expected fp8)")
    t0 = time.perf_counter()
    device = torch.device(device)
    files = infos = names = None
    if weights is None and load_format != "dummy":
        files = checkpoint_files(model_dir)
        infos = read_infos(files)
        names = list(infos)
    elif weights is not None and load_format != "dummy":
        weights = list(weights)  # in-memory tensors: the list holds references, not copies
        names = [n for n, _ in weights]
    source_dtype = None
    if infos is not None:
        source_dtype = next((dt for n, (_, dt) in infos.items() if _table_of(n)), None)
    table_dtype = resolve_table_dtype(ple_table_dtype, dtype, source_dtype)
    if mtp and names is not None and not any(_normalise(n).startswith(MTP) for n in names):
        config.check_mtp()
        raise MissingMTPError(config)
    with torch.device("meta"):
        meta = Qwen4ExpForCausalLM(config, mtp=mtp)
    fp8 = fp8_weights(meta, config, names, quantization)
    use_fp8_(meta, fp8)
    if fp8:
        logger.info("%d of %d quantizable weights in block-scaled fp8", len(fp8), len(quantizable_weights(meta)))
    table_bytes, other_bytes = _weight_bytes(meta, dtype, table_dtype)
    on_host = bool(config.ple_layer_ids) and resolve_table_on_host(
        ple_table_device, device, table_bytes, other_bytes, gpu_memory_utilization)
    if device.type == "cuda":
        check_weights_fit(DeviceMemory.measure(device, gpu_memory_utilization), other_bytes, table_bytes, not on_host,
                          None if fp8 else _fp8_bytes(meta, dtype))
    model = build_model(config, dtype, device, on_host, table_dtype, model=meta)
    tables = table_names(model)
    if load_format == "dummy":
        dummy_weights_(model, seed)
    else:
        scales = None
        if table_dtype == FP8 and tables and source_dtype != FP8:
            # one scale per table needs its max before the first row is quantised: a first pass over the shards
            if files is not None:
                amax = table_amax(iterate_files(files, only=_table_of), tables)
            else:
                amax = table_amax(weights, tables)
            scales = {t: fp8_scale(a) for t, a in amax.items()}
        if files is not None and distributed.world_size() > 1:
            loading = _Loading(model, _shard_layout(infos), scales, sliced=True)
            load_weights(model, iterate_files(files, parts=loading.part), loading=loading)
        elif files is not None:
            load_weights(model, iterate_files(files), _shard_layout(infos), scales)
        else:
            load_weights(model, weights, table_scales=scales)
    logger.info("loaded weights in %.1f s", time.perf_counter() - t0)
    return model
