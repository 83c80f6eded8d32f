"""Checkpoint loading: HF safetensors (one file or an index with shards) into `Qwen4ExpForCausalLM`.

A checkpoint name, with `model.language_model.` (multimodal checkpoints) read as `model.`, is handled by the first
entry of `RULES` whose pattern it matches:
- skipped: `model.visual.*`, `mtp.*`, `hashstats_*`, `token_lookup` and the final mixer's unused
  `block_inject_weight`;
- per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`: copied into expert e's rows of the stacked expert tensors
  (`EXPERT_PARTS`); already stacked `experts.gate_up_proj` / `experts.down_proj` are plain tensors;
- the n-gram table, whole or as `ngram_embedding.shard_{i}.weight`: written in order into `ngram_embedding.weight`,
  straight into the table's final place (GPU, or page-locked host memory) and dtype (an fp8 table is quantised on the
  way with one scale per table; an fp8 checkpoint table brings its `ngram_embedding.weight_scale`);
- the PLE hash buffers, which must equal the values computed from the config;
- any other name: a model tensor (`model.merged_linear.named_checkpoint_tensors`), a parameter or one part of a
  merged projection, which loads it (`CheckpointTensor.load_`).
Tensors are copied into preallocated parameters one at a time; errors list every missing, unexpected and
mis-shaped tensor by its checkpoint name.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable

import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..model import Qwen4ExpForCausalLM
from ..model.merged_linear import MergedLinear, TensorShapeError, copy_checked_, named_checkpoint_tensors
from .init import fill_
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
# (rule, pattern): see the module docstring; the first match handles the tensor
RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("skip", re.compile(r"^(model\.visual\.|mtp\.|model\.mtp\.)|hashstats_|token_lookup|"
                        r"hyper_connection_mixer\.block_inject_weight|rotary_emb\.inv_freq")),
    ("expert", re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                          r"\.weight$")),
    ("table_scale", re.compile(r"^(?P<table>.*\.ngram_embedding)\.weight_scale$")),
    ("table_rows", _SHARD),
    ("hash_buffer", re.compile(r"\.(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$")),
    ("tensor", re.compile("")),
)
# a per-expert projection -> (the stacked parameter, which of its equal row chunks of expert e, of how many)
EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2),
                "down_proj": ("down_proj", 0, 1)}


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
) -> Qwen4ExpForCausalLM:
    """Allocate the model directly on `device` (parameters uninitialised but for the merged projections' zero
    padding rows and biases; fp32 kept for A_log and dt_bias).

    The n-gram tables are stored in `table_dtype` (default `dtype`), with the model or in host memory; a host table
    of a GPU model is page-locked so that kernels read its rows in place. `model`: the config's model on the meta
    device, if the caller already built one."""
    device = torch.device(device)
    if model is None:
        with torch.device("meta"):
            model = Qwen4ExpForCausalLM(config)
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
                new = torch.empty(p.shape, dtype=torch.float32 if keep_fp32 else dtype, device=device)
            setattr(module, name, torch.nn.Parameter(new, requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = b.to(device)
        if isinstance(module, MergedLinear):
            module.zero_unused_()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _normalise(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


class _TableRows:
    """One n-gram table arriving whole or in row shards, possibly out of order."""

    def __init__(self, name: str, dest: torch.Tensor, shard_rows: list[int] | None, scale: float | None):
        self.name, self.dest, self.shard_rows, self.scale = name, dest, shard_rows, scale
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

    def _place(self, index: int, tensor: torch.Tensor, offset: int, errors: list[str]) -> None:
        dest = self.dest
        if tensor.dim() != 2 or tensor.shape[1] != dest.shape[1] or offset + tensor.shape[0] > dest.shape[0]:
            errors.append(f"{self.name} shard {index}: {tuple(tensor.shape)} at row {offset} does not fit "
                          f"{tuple(dest.shape)}")
            return
        scale = 1.0
        if tensor.dtype == FP8:
            self.fp8_source = True
        elif dest.dtype == FP8:
            if self.scale is None:
                raise ValueError(f"{self.name}: quantising to fp8 needs the table's scale (a first pass over its rows)")
            scale = self.scale
        write_rows_(dest.data, offset, tensor, scale)
        self.bar.update(tensor.shape[0])
        self.seen[index] = tensor.shape[0]

    def finish(self, scale_buffer: torch.Tensor, errors: list[str]) -> None:
        self.bar.close()
        dest, name = self.dest, self.name
        if self.pending:
            errors.append(f"{name}: shards {sorted(self.pending)} arrived without shard 0")
        idx = sorted(self.seen)
        if idx != list(range(len(idx))):
            errors.append(f"{name}: shard indices {idx} are not contiguous from 0")
        elif self.seen and sum(self.seen.values()) != dest.shape[0]:
            errors.append(f"{name}: shards hold {sum(self.seen.values())} rows, the model needs {dest.shape[0]}")
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


class _Loading:
    """The state of one `load_weights`: one method per rule of RULES, each given the checkpoint name as it came, the
    rule's match over the normalised name (`m.string`) and the tensor."""

    def __init__(self, model: Qwen4ExpForCausalLM, shard_rows: dict[str, list[int]] | None,
                 table_scales: dict[str, float] | None):
        self.targets = {t.name: t for t in named_checkpoint_tensors(model)}
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.tied_lm_head = model.config.tie_word_embeddings
        self.shard_rows, self.table_scales = shard_rows or {}, table_scales or {}
        self.loaded: set[str] = set()  # names of self.targets
        self.expert_parts: dict[str, set[tuple[int, str]]] = {}
        self.tables: dict[str, _TableRows] = {}
        self.checkpoint_scales: dict[str, float] = {}
        self.unexpected: list[str] = []
        self.misshaped: list[str] = []

    def skip(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        pass

    def expert(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        param, chunk, chunks = EXPERT_PARTS[m["proj"]]
        stacked, e = f"{m['experts']}.{param}", int(m["expert"])
        if stacked not in self.params or e >= self.params[stacked].shape[0]:
            self.unexpected.append(raw_name)
            return
        copy_checked_(self.params[stacked].data[e].chunk(chunks)[chunk], tensor, raw_name)
        self.expert_parts.setdefault(stacked, set()).add((e, m["proj"]))

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
        if table not in self.tables:
            self.tables[table] = _TableRows(table, self.params[table], self.shard_rows.get(table),
                                            self.table_scales.get(table))
        self.tables[table].add(int(m["shard"] or 0), tensor, self.misshaped)

    def hash_buffer(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        expected = self.buffers.get(m.string)
        if expected is None:
            self.unexpected.append(raw_name)
        elif not torch.equal(tensor.to(expected.device).long(), expected):
            self.misshaped.append(f"{raw_name}: checkpoint values {tensor.tolist()} differ from the values computed "
                                  f"from the config {expected.tolist()}")

    def tensor(self, raw_name: str, m: re.Match, tensor: torch.Tensor) -> None:
        name = m.string
        if name not in self.targets:
            if not (name == "lm_head.weight" and self.tied_lm_head):
                self.unexpected.append(raw_name)
            return
        self.targets[name].load_(tensor, raw_name)
        self.loaded.add(name)

    def finish(self) -> None:
        """Raise WeightLoadError naming every missing, unexpected and mis-shaped tensor."""
        for table, rows in self.tables.items():
            rows.checkpoint_scale = self.checkpoint_scales.get(table)
            rows.finish(self.buffers[table + "_scale"], self.misshaped)
            if rows.seen:
                self.loaded.add(table)
        for stacked, parts in self.expert_parts.items():
            kinds = [k for k, (param, _, _) in EXPERT_PARTS.items() if stacked.endswith("." + param)]
            experts = self.params[stacked].shape[0]
            if len(parts) != experts * len(kinds):
                missing = sorted(set(range(experts)) - {e for e, _ in parts}) or "some projections"
                self.misshaped.append(f"{stacked}: experts {missing} missing from the checkpoint")
            self.loaded.add(stacked)
        missing = [n for n in self.targets if n not in self.loaded]
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {', '.join(missing)}")
        if self.unexpected:
            parts.append(f"unexpected tensors ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        if self.misshaped:
            parts.append(f"mis-shaped tensors ({len(self.misshaped)}): {'; '.join(self.misshaped)}")
        if parts:
            raise WeightLoadError("checkpoint does not match the model:\n  " + "\n  ".join(parts))


def load_weights(
    model: Qwen4ExpForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    shard_rows: dict[str, list[int]] | None = None,
    table_scales: dict[str, float] | None = None,
) -> None:
    """Copy (name, tensor) pairs into `model` by RULES. `shard_rows` (table name -> rows of each shard, in order) gives
    exact offsets for n-gram shards; without it shards must have equal rows except the last, and shard 0 fixes the
    size. `table_scales` (table name -> scale) quantises rows arriving in another dtype for an fp8 table."""
    loading = _Loading(model, shard_rows, table_scales)
    for raw_name, tensor in weights:
        name = _normalise(raw_name)
        rule, match = next((rule, m) for rule, pattern in RULES if (m := pattern.search(name)))
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
    so their values do not depend on where the tables live."""
    g = None
    tables = set(table_names(model))
    buffers = dict(model.named_buffers())
    work_device = model.lm_head.weight.device
    for t in named_checkpoint_tensors(model):
        if t.name in tables:
            layer = int(t.name.split(".")[2])
            fill_random_(t.tensor, buffers[t.name + "_scale"], seed * 7919 + layer, work_device)
            continue
        if g is None or g.device != t.tensor.device:
            g = torch.Generator(device=t.tensor.device).manual_seed(seed)
        fill_(t.name, t.tensor, g)


def _weight_bytes(model: Qwen4ExpForCausalLM, dtype: torch.dtype, table_dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the n-gram tables in table_dtype, bytes of every other parameter in dtype)."""
    tables = set(table_names(model))
    table = sum(p.numel() for n, p in model.named_parameters() if n in tables)
    other = sum(p.numel() for n, p in model.named_parameters() if n not in tables)
    size = lambda dt: torch.tensor([], dtype=dt).element_size()  # noqa: E731
    return table * size(table_dtype), other * size(dtype)


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
) -> Qwen4ExpForCausalLM:
    """load_format: "auto"/"safetensors" (files in model_dir), "dummy" (random, no files). `weights` (an iterator of
    (name, tensor)) overrides the files, e.g. for weights already in memory.

    ple_table_device: "gpu" (with the model), "cpu" (host memory, page-locked for a GPU model) or "auto" (the GPU
    when it fits, see ngram_table.resolve_table_on_host). ple_table_dtype: "auto" (fp8 if the checkpoint's table is,
    else the model dtype), "fp8" (e4m3 with one scale per table), or a float dtype name."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format: unknown value {load_format!r} (expected auto, safetensors or dummy)")
    t0 = time.perf_counter()
    device = torch.device(device)
    files = infos = None
    if weights is None and load_format != "dummy":
        files = checkpoint_files(model_dir)
        infos = read_infos(files)
    source_dtype = None
    if infos is not None:
        source_dtype = next((dt for n, (_, dt) in infos.items() if _table_of(n)), None)
    table_dtype = resolve_table_dtype(ple_table_dtype, dtype, source_dtype)
    with torch.device("meta"):
        meta = Qwen4ExpForCausalLM(config)
    on_host = bool(config.ple_layer_ids) and resolve_table_on_host(
        ple_table_device, device, *_weight_bytes(meta, dtype, table_dtype), gpu_memory_utilization)
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
                weights = list(weights)  # in-memory tensors: the list holds references, not copies
                amax = table_amax(weights, tables)
            scales = {t: fp8_scale(a) for t, a in amax.items()}
        if files is not None:
            load_weights(model, iterate_files(files), _shard_layout(infos), scales)
        else:
            load_weights(model, weights, table_scales=scales)
    logger.info("loaded weights in %.1f s", time.perf_counter() - t0)
    return model
