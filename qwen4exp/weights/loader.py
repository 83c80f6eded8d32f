"""Checkpoint loading: HF safetensors (one file or an index with shards) into `Qwen4ExpForCausalLM`.

Name mapping (all rules live in `_target`):
- `model.language_model.*` (multimodal checkpoints) and `model.*` both map to the text model; `model.visual.*` and
  `mtp.*` are skipped, as are `hashstats_*`, `token_lookup` and the final mixer's unused `block_inject_weight`.
- Per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` are copied into slices of the stacked expert tensors;
  already stacked `experts.gate_up_proj` / `experts.down_proj` are taken as they are.
- `ple.ple_embedding.ngram_embedding.shard_{i}.weight` are written in order into `ngram_embedding.weight`, straight
  into the table's final place (GPU, or page-locked host memory) and dtype (an fp8 table is quantised on the way
  with one scale per table; an fp8 checkpoint table brings its `ngram_embedding.weight_scale`).
- The PLE hash buffers, when present, must equal the values computed from the config.
Tensors are copied into preallocated parameters one at a time; errors list every missing, unexpected and
mis-shaped tensor by name.
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
from ..model.model import projection_groups
from ..ops.linear import merge_rows_
from .init import fill_
from .ngram_table import (FP8, fill_random_, fp8_scale, host_empty, on_host, resolve_table_dtype, resolve_table_on_host,
                          write_rows_)
from .safetensors_io import checkpoint_files, iterate_files, read_infos

logger = logging.getLogger("qwen4exp")

_SKIP = re.compile(
    r"^(model\.visual\.|mtp\.|model\.mtp\.)|hashstats_|token_lookup|hyper_connection_mixer\.block_inject_weight|"
    r"rotary_emb\.inv_freq"
)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD = re.compile(r"^(.*\.ngram_embedding)\.(?:shard_(\d+)\.)?weight$")  # a table in shards, or whole
_TABLE_SCALE = re.compile(r"^(.*\.ngram_embedding)\.weight_scale$")
_HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


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
    """Allocate the model directly on `device` (parameters uninitialised; fp32 kept for A_log and dt_bias).

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
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for group in projection_groups(model):
        merge_rows_(group)
    return model.eval()


def _normalise(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def load_weights(
    model: Qwen4ExpForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    shard_rows: dict[str, list[int]] | None = None,
    table_scales: dict[str, float] | None = None,
) -> None:
    """Copy (name, tensor) pairs into `model`. `shard_rows` (table name -> rows of each shard, in order) gives exact
    offsets for n-gram shards; without it shards must have equal rows except the last, and shard 0 fixes the size.
    `table_scales` (table name -> scale) quantises rows arriving in another dtype for an fp8 table."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    cfg = model.config
    loaded: set[str] = set()
    expert_parts: dict[str, set] = {}
    unexpected, misshaped = [], []
    shard_seen: dict[str, dict[int, int]] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    fp8_source: set[str] = set()
    checkpoint_scales: dict[str, float] = {}
    started: dict[str, tuple[float, tqdm]] = {}

    def check(name, tensor, expected) -> bool:
        if tuple(tensor.shape) != tuple(expected):
            misshaped.append(f"{name}: checkpoint {tuple(tensor.shape)}, model {tuple(expected)}")
            return False
        return True

    def place_shard(table: str, index: int, tensor: torch.Tensor, offset: int) -> None:
        dest = params[table]
        if tensor.dim() != 2 or tensor.shape[1] != dest.shape[1] or offset + tensor.shape[0] > dest.shape[0]:
            misshaped.append(
                f"{table} shard {index}: {tuple(tensor.shape)} at row {offset} does not fit {tuple(dest.shape)}"
            )
            return
        if table not in started:
            bar = tqdm(total=dest.shape[0], unit="rows", unit_scale=True, desc=table.split(".ple.")[0] + " n-gram rows",
                       leave=False, disable=None)
            started[table] = (time.perf_counter(), bar)
        scale = 1.0
        if tensor.dtype == FP8:
            fp8_source.add(table)
        elif dest.dtype == FP8:
            if table_scales is None or table not in table_scales:
                raise ValueError(f"{table}: quantising to fp8 needs the table's scale (a first pass over its rows)")
            scale = table_scales[table]
        write_rows_(dest.data, offset, tensor, scale)
        started[table][1].update(tensor.shape[0])
        shard_seen.setdefault(table, {})[index] = tensor.shape[0]

    for raw_name, tensor in weights:
        if _SKIP.search(raw_name):
            continue
        name = _normalise(raw_name)
        if m := _EXPERT.match(name):
            prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
            target = f"{prefix}.down_proj" if kind == "down_proj" else f"{prefix}.gate_up_proj"
            if target not in params:
                unexpected.append(raw_name)
                continue
            dest = params[target]
            inter = cfg.moe_intermediate_size
            if e >= dest.shape[0]:
                unexpected.append(raw_name)
                continue
            view = dest.data[e] if kind == "down_proj" else dest.data[e, (0 if kind == "gate_proj" else inter):][:inter]
            if check(raw_name, tensor, view.shape):
                view.copy_(tensor)
                expert_parts.setdefault(target, set()).add((e, kind))
            continue
        if m := _TABLE_SCALE.match(name):
            if m.group(1) + ".weight" not in params:
                unexpected.append(raw_name)
            else:
                checkpoint_scales[m.group(1) + ".weight"] = float(tensor.float().reshape(-1)[0])
            continue
        if m := _SHARD.match(name):
            table, index = m.group(1) + ".weight", int(m.group(2) or 0)
            if table not in params:
                unexpected.append(raw_name)
                continue
            if shard_rows is not None and table in shard_rows:
                place_shard(table, index, tensor, sum(shard_rows[table][:index]))
            elif index == 0 or table in shard_seen and 0 in shard_seen[table]:
                rows0 = tensor.shape[0] if index == 0 else shard_seen[table][0]
                place_shard(table, index, tensor, index * rows0)
                for i, t in pending.pop(table, {}).items():
                    place_shard(table, i, t, i * rows0)
            else:
                pending.setdefault(table, {})[index] = tensor  # placed once shard 0 fixes the shard size
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _HASH_BUFFERS and name in buffers:
            if not torch.equal(tensor.to(buffers[name].device).long(), buffers[name]):
                misshaped.append(f"{raw_name}: checkpoint values {tensor.tolist()} differ from the values computed "
                                 f"from the config {buffers[name].tolist()}")
            continue
        if name not in params:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            unexpected.append(raw_name)
            continue
        if check(raw_name, tensor, params[name].shape):
            params[name].data.copy_(tensor)
            loaded.add(name)

    for table, shards in pending.items():
        misshaped.append(f"{table}: shards {sorted(shards)} arrived without shard 0")
    for table, seen in shard_seen.items():
        idx = sorted(seen)
        rows = sum(seen.values())
        if idx != list(range(len(idx))):
            misshaped.append(f"{table}: shard indices {idx} are not contiguous from 0")
        elif rows != params[table].shape[0]:
            misshaped.append(f"{table}: shards hold {rows} rows, the model needs {params[table].shape[0]}")
        loaded.add(table)
        t0, bar = started[table]
        bar.close()
        dest = params[table]
        if table in fp8_source and table not in checkpoint_scales:
            misshaped.append(f"{table}: the table is float8 but the checkpoint has no "
                             f"{table.removesuffix('.weight')}.weight_scale")
        scale = (table_scales or {}).get(table, 1.0) if dest.dtype == FP8 and table not in fp8_source else 1.0
        buffers[table + "_scale"].fill_(scale * checkpoint_scales.get(table, 1.0))
        place = (("page-locked " if dest.is_pinned() else "") + "host memory") if on_host(dest) else str(dest.device)
        logger.info("%s: %d x %d %s in %s (%.2f GiB), loaded in %.1f s", table, dest.shape[0], dest.shape[1],
                    str(dest.dtype).removeprefix("torch."), place, dest.numel() * dest.element_size() / 2**30,
                    time.perf_counter() - t0)
    for target, parts in expert_parts.items():
        kinds = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
        if len(parts) == params[target].shape[0] * len(kinds):
            loaded.add(target)
        else:
            have = {e for e, _ in parts}
            missing = sorted(set(range(params[target].shape[0])) - have) or "some projections"
            misshaped.append(f"{target}: experts {missing} missing from the checkpoint")
            loaded.add(target)
    missing = [n for n in params if n not in loaded and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
        if misshaped:
            parts.append(f"mis-shaped tensors ({len(misshaped)}): {'; '.join(misshaped)}")
        raise WeightLoadError("checkpoint does not match the model:\n  " + "\n  ".join(parts))


def _shard_layout(infos: dict[str, tuple]) -> dict[str, list[int]]:
    tables: dict[str, dict[int, int]] = {}
    for name, (shape, _) in infos.items():
        if m := _SHARD.match(_normalise(name)):
            tables.setdefault(m.group(1) + ".weight", {})[int(m.group(2) or 0)] = shape[0]
    return {t: [rows[i] for i in sorted(rows)] for t, rows in tables.items() if sorted(rows) == list(range(len(rows)))}


def _table_of(raw_name: str) -> str | None:
    m = _SHARD.match(_normalise(raw_name))
    return m.group(1) + ".weight" if m else None


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
    """Random weights in place, on the model's device (vLLM's load_format="dummy"). n-gram tables are filled in
    chunks computed on the model's device, so their values do not depend on where the tables live."""
    g = None
    tables = set(table_names(model))
    buffers = dict(model.named_buffers())
    work_device = model.lm_head.weight.device
    for name, p in model.named_parameters():
        if name in tables:
            layer = int(name.split(".")[2])
            fill_random_(p.data, buffers[name + "_scale"], seed * 7919 + layer, work_device)
            continue
        if g is None or g.device != p.device:
            g = torch.Generator(device=p.device).manual_seed(seed)
        fill_(name, p.data, g)


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
