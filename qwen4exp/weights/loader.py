"""Checkpoint loading: HF safetensors (one file or an index with shards) into `Qwen4ExpForCausalLM`.

Name mapping (all rules live in `_target`):
- `model.language_model.*` (multimodal checkpoints) and `model.*` both map to the text model; `model.visual.*` and
  `mtp.*` are skipped, as are `hashstats_*`, `token_lookup` and the final mixer's unused `block_inject_weight`.
- Per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` are copied into slices of the stacked expert tensors;
  already stacked `experts.gate_up_proj` / `experts.down_proj` are taken as they are.
- `ple.ple_embedding.ngram_embedding.shard_{i}.weight` are concatenated in order into `ngram_embedding.weight`.
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

from ..config import ModelConfig
from ..model import Qwen4ExpForCausalLM
from ..model.model import projection_groups
from ..ops.linear import merge_rows_
from .init import fill_
from .safetensors_io import checkpoint_files, iterate_files, read_shapes

logger = logging.getLogger("qwen4exp")

_SKIP = re.compile(
    r"^(model\.visual\.|mtp\.|model\.mtp\.)|hashstats_|token_lookup|hyper_connection_mixer\.block_inject_weight|"
    r"rotary_emb\.inv_freq"
)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD = re.compile(r"^(.*\.ngram_embedding)\.shard_(\d+)\.weight$")
_HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class WeightLoadError(ValueError):
    pass


def build_model(config: ModelConfig, dtype: torch.dtype, device) -> Qwen4ExpForCausalLM:
    """Allocate the model directly on `device` (parameters uninitialised; fp32 kept for A_log and dt_bias)."""
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
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
    model: Qwen4ExpForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], shard_rows: dict[str, list[int]] | None = None
) -> None:
    """Copy (name, tensor) pairs into `model`. `shard_rows` (table name -> rows of each shard, in order) gives exact
    offsets for n-gram shards; without it shards must have equal rows except the last, and shard 0 fixes the size."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    cfg = model.config
    loaded: set[str] = set()
    expert_parts: dict[str, set] = {}
    unexpected, misshaped = [], []
    shard_seen: dict[str, dict[int, int]] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}

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
        dest.data[offset: offset + tensor.shape[0]].copy_(tensor)
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
        if m := _SHARD.match(name):
            table, index = m.group(1) + ".weight", int(m.group(2))
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


def _shard_layout(shapes: dict[str, tuple[int, ...]]) -> dict[str, list[int]]:
    tables: dict[str, dict[int, int]] = {}
    for name, shape in shapes.items():
        if m := _SHARD.match(_normalise(name)):
            tables.setdefault(m.group(1) + ".weight", {})[int(m.group(2))] = shape[0]
    return {t: [rows[i] for i in sorted(rows)] for t, rows in tables.items() if sorted(rows) == list(range(len(rows)))}


def dummy_weights_(model: Qwen4ExpForCausalLM, seed: int = 0) -> None:
    """Random weights in place, on the model's device (vLLM's load_format="dummy")."""
    g = None
    for name, p in model.named_parameters():
        if g is None or g.device != p.device:
            g = torch.Generator(device=p.device).manual_seed(seed)
        fill_(name, p.data, g)


def load_model(
    config: ModelConfig,
    model_dir: str | None,
    dtype: torch.dtype,
    device,
    load_format: str = "auto",
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    seed: int = 0,
) -> Qwen4ExpForCausalLM:
    """load_format: "auto"/"safetensors" (files in model_dir), "dummy" (random, no files). `weights` (an iterator of
    (name, tensor)) overrides the files, e.g. for weights already in memory."""
    t0 = time.perf_counter()
    model = build_model(config, dtype, device)
    if load_format == "dummy":
        dummy_weights_(model, seed)
    elif weights is not None:
        load_weights(model, weights)
    elif load_format in ("auto", "safetensors"):
        files = checkpoint_files(model_dir)
        load_weights(model, iterate_files(files), _shard_layout(read_shapes(files)))
    else:
        raise ValueError(f"load_format: unknown value {load_format!r} (expected auto, safetensors or dummy)")
    logger.info("loaded weights in %.1f s", time.perf_counter() - t0)
    return model
