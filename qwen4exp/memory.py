"""Memory planning for one device: where an engine's memory goes, decided at start-up and logged as one table, and,
when something does not fit, one error that says what to change.

On a GPU the engine's share is gpu_memory_utilization x the device's memory. The weights come first (checked before
any is allocated: `check_weights_fit`), then the state slots (one per sequence of max_num_seqs, 1 + k with k-token
speculative decoding, plus the null slot, plus max_num_seqs prefix-cache checkpoints with prefix caching), then as
many KV cache pages as the rest of the share holds; activations and CUDA-graph pools live in what the share leaves
of the device (1 - gpu_memory_utilization), and their peak is logged after the warm-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("qwen4exp")

GiB = 2**30


class InsufficientMemoryError(ValueError):
    """The model or its cache does not fit the memory budget; the message says what to change."""


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


@dataclass
class DeviceMemory:
    """The device's memory and the engine's share of it, measured when the engine starts."""

    device: str
    total: int
    used_by_others: int  # in use when measured: other processes, this process's earlier allocations
    utilization: float

    @property
    def budget(self) -> int:
        """What the engine may use: utilization x total, less what others already use."""
        return max(int(self.total * self.utilization) - self.used_by_others, 0)

    @classmethod
    def measure(cls, device, utilization: float) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(str(device), total, total - free, utilization)


def check_weights_fit(memory: DeviceMemory, weights: int, tables: int, tables_on_device: bool,
                      weights_in_fp8: int | None) -> None:
    """Raises InsufficientMemoryError, before any weight is allocated, when the weights (and the n-gram tables when
    they would live on the device) exceed the engine's share. `weights_in_fp8`: the weights' size if quantized to
    fp8 (None when they already are)."""
    need = weights + (tables if tables_on_device else 0)
    if need <= memory.budget:
        return
    hints = []
    if tables_on_device and weights <= memory.budget:
        hints.append(f"--ple-table-device cpu (the n-gram tables, {_gib(tables)}, to page-locked host memory)")
    if weights_in_fp8 is not None and weights_in_fp8 < weights:
        fits = weights_in_fp8 <= memory.budget
        hints.append(f"--quantization fp8 (weights {_gib(weights)} -> {_gib(weights_in_fp8)}"
                     f"{'' if fits else ', still too large alone'})")
    if memory.utilization < 0.95 and need <= int(memory.total * 0.95) - memory.used_by_others:
        hints.append("--gpu-memory-utilization 0.95")
    raise InsufficientMemoryError(
        f"the model does not fit {memory.device}: weights {_gib(weights)}"
        + (f" + n-gram tables {_gib(tables)}" if tables_on_device else "")
        + f" > the engine's share {_gib(memory.budget)} (gpu_memory_utilization {memory.utilization} of "
        f"{_gib(memory.total)}, {_gib(memory.used_by_others)} already in use); "
        + ("try " + ", or ".join(hints) if hints else "this model needs a larger GPU"))


@dataclass
class MemoryPlan:
    """The cache's share of the budget and the resulting capacity."""

    device: str
    budget: int  # bytes the cache may take (after the weights); on the CPU, cpu_cache_bytes
    page_size: int
    page_bytes: int
    slot_bytes: int
    num_slots: int  # slots_per_sequence x max_num_seqs + the null slot + checkpoint_slots
    max_model_len: int
    max_num_seqs: int
    slots_per_sequence: int = 1  # 1 + k with k-token speculative decoding (a state after each draft)
    checkpoint_slots: int = 0  # prefix caching's saved states (engine/prefix_cache.py)
    ssm_dtype: str = "float32"  # the GDN recurrent states' storage (EngineConfig.mamba_ssm_cache_dtype)
    num_pages: int = 0  # decided by `plan_cache` (page 0 is the null page)
    weights: dict[str, int] = field(default_factory=dict)  # bytes on the device by dtype
    tables: tuple[int, str] | None = None  # (bytes, where) of the n-gram tables
    reserve: int | None = None  # bytes the share leaves for activations and CUDA graphs (GPU)
    pages_from_budget: bool = False  # num_pages is what the budget holds (not a given num_pages)

    @property
    def pages_per_sequence(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def max_concurrent(self) -> int:
        """Sequences of max_model_len tokens the pages hold at once, within max_num_seqs."""
        return min(self.max_num_seqs, (self.num_pages - 1) // self.pages_per_sequence)

    @property
    def max_concurrent_without_checkpoints(self) -> int:
        """max_concurrent if prefix caching's checkpoint slots were pages instead (the budget's pages only)."""
        if not (self.checkpoint_slots and self.pages_from_budget):
            return self.max_concurrent
        pages = self.num_pages + self.checkpoint_slots * self.slot_bytes // self.page_bytes
        return min(self.max_num_seqs, (pages - 1) // self.pages_per_sequence)

    def lines(self) -> list[str]:
        usable = self.num_pages - 1
        rows = [f"memory plan on {self.device}:"]
        if self.weights:
            total = sum(self.weights.values())
            parts = ", ".join(f"{name} {_gib(n)}" for name, n in sorted(self.weights.items(), key=lambda kv: -kv[1]))
            rows.append(f"  weights            {_gib(total):>10}  ({parts})")
        if self.tables is not None:
            rows.append(f"  n-gram tables      {_gib(self.tables[0]):>10}  ({self.tables[1]})")
        per = f", {self.slots_per_sequence} per sequence" if self.slots_per_sequence > 1 else ""
        if self.checkpoint_slots:
            per += f", {self.checkpoint_slots} prefix-cache checkpoints"
        rows.append(f"  state slots        {_gib(self.num_slots * self.slot_bytes):>10}  ({self.num_slots} slots of "
                    f"{self.slot_bytes / 2**20:.1f} MiB: GDN recurrent ({self.ssm_dtype}) + conv, PLE conv{per})")
        rows.append(f"  KV cache pages     {_gib(self.num_pages * self.page_bytes):>10}  ({usable} pages of "
                    f"{self.page_size} tokens = {usable * self.page_size} tokens)")
        if self.reserve is not None:
            rows.append(f"  activations, CUDA graphs {_gib(self.reserve):>4}  (what gpu_memory_utilization leaves)")
        without = self.max_concurrent_without_checkpoints
        rows.append(f"  concurrent sequences of max_model_len {self.max_model_len}: {self.max_concurrent} "
                    f"(max_num_seqs {self.max_num_seqs})" + (f"; {without} with --no-enable-prefix-caching, whose "
                                                           "checkpoint slots would be pages"
                                                           if without > self.max_concurrent else ""))
        return rows


def plan_cache(plan: MemoryPlan, num_pages: int | None = None, hints: tuple[str, ...] = (),
               fit_max_model_len: bool = False) -> MemoryPlan:
    """Fills in `plan.num_pages`: `num_pages` when given, else as many pages as the budget holds after the state
    slots. With `fit_max_model_len`, plan.max_model_len (the model's length) is lowered to what the pages hold where
    they hold less (logged). Raises InsufficientMemoryError when they cannot hold one sequence of max_model_len,
    naming the largest max_model_len and max_num_seqs that would fit; `hints` are further changes to suggest."""
    slots = plan.num_slots * plan.slot_bytes
    plan.pages_from_budget = num_pages is None
    if num_pages is None:
        num_pages = max(plan.budget - slots, 0) // plan.page_bytes
    plan.num_pages = int(num_pages)
    held = max(plan.num_pages - 1, 0) * plan.page_size
    if fit_max_model_len and 0 < held < plan.max_model_len:
        logger.warning("max_model_len=%d: the model's %d tokens do not fit the cache on %s, which holds %d tokens "
                       "(raise the memory budget for longer sequences)", held, plan.max_model_len, plan.device, held)
        plan.max_model_len = held
    if plan.num_pages - 1 >= plan.pages_per_sequence:
        return plan
    pages_left = max(plan.num_pages - 1, 0)
    fixes = []
    if pages_left:
        fixes.append(f"--max-model-len {pages_left * plan.page_size}")
    one_sequence = (plan.pages_per_sequence + 1) * plan.page_bytes
    per_seq_slots = plan.slots_per_sequence + (plan.checkpoint_slots > 0)  # a checkpoint slot per sequence
    seqs = (plan.budget - one_sequence - plan.slot_bytes) // (plan.slot_bytes * per_seq_slots)
    if 0 < seqs < plan.max_num_seqs:
        fixes.append(f"--max-num-seqs {seqs}")
    if plan.checkpoint_slots and plan.pages_from_budget and plan.max_concurrent_without_checkpoints >= 1:
        fixes.append("--no-enable-prefix-caching")
    fixes += hints
    per = "one" if plan.slots_per_sequence == 1 else f"{plan.slots_per_sequence} (speculative decoding)"
    if plan.checkpoint_slots:
        per += " + a prefix-cache checkpoint"
    raise InsufficientMemoryError(
        f"the cache does not hold one sequence of max_model_len={plan.max_model_len}: the {_gib(plan.budget)} left for "
        f"it on {plan.device} take {plan.num_slots} state slots ({_gib(slots)}, {per} per --max-num-seqs + 1) and "
        f"{pages_left} pages of {plan.page_size} tokens, and one sequence needs {plan.pages_per_sequence} pages; "
        + ("try " + ", or ".join(fixes) if fixes else "raise the memory budget"))


def weights_by_dtype(model: torch.nn.Module, device: torch.device, skip: set[str] = frozenset()) -> dict[str, int]:
    """Bytes of the model's parameters that live on `device`, by dtype name (`skip`: names left out)."""
    out: dict[str, int] = {}
    for name, p in model.named_parameters():
        if name in skip or p.device != device:
            continue
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out
