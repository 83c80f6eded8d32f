"""The cache: fixed-size pages for the attention layers and state slots for GDN/PLE.

Two halves. `CacheAllocator` is the scheduler's bookkeeping: it hands out page and slot ids (integers) and knows no
tensors. `allocate_engine_cache` sizes the cache from the memory budget and allocates the model's cache tensors
(model/state.py) that those ids index, with an allocator of the same size. Page 0 and slot 0 are reserved null
entries (padding rows point at them).
"""

from __future__ import annotations

import logging

import torch

from .. import distributed
from ..config import ConfigError, EngineConfig, ModelConfig
from ..memory import DeviceMemory, MemoryPlan, plan_cache, weights_by_dtype
from ..model.state import ModelCache, allocate_cache, page_bytes, slot_bytes
from ..weights.loader import table_names
from ..weights.ngram_table import on_host
from .prefix_cache import PrefixCache

logger = logging.getLogger("qwen4exp")


class PageAllocator:
    """A free list of ids 1..num_pages-1 (id 0 is the null entry)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of cache pages: want {n}, have {len(self._free)}")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class SlotAllocator(PageAllocator):
    """Same free-list discipline; slot 0 is the null slot."""


class CacheAllocator:
    """Pages of `page_size` tokens and state slots, as integers: what the scheduler hands to requests. With
    `num_checkpoints`, prefix caching: the pages are a PrefixCache (engine/prefix_cache.py) and slots num_slots ..
    num_slots + num_checkpoints - 1 its checkpoints (`prefix`; None without)."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int, num_checkpoints: int = 0):
        self.page_size = page_size
        self.prefix = None
        if num_checkpoints:
            self.pages = self.prefix = PrefixCache(num_pages, list(range(num_slots, num_slots + num_checkpoints)))
        else:
            self.pages = PageAllocator(num_pages)
        self.slots = SlotAllocator(num_slots)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def all_free(self) -> bool:
        """No page or sequence slot is held (cached pages nobody holds count as free)."""
        return self.pages.num_free == self.pages.num_usable and self.slots.num_free == self.slots.num_usable

    @property
    def usage(self) -> float:
        return 1.0 - self.pages.num_free / max(self.pages.num_usable, 1)


DEFAULT_PAGE_SIZE = 16


def resolve_page_size(model_config: ModelConfig, page_size: int | None) -> int:
    """The page size a model's cache uses: `page_size` when given, else DEFAULT_PAGE_SIZE rounded up to a multiple
    of the model's QSA block (indexer_compress_ratio tokens), since a block never straddles a page. A given size that
    is no such multiple is a ConfigError."""
    block = model_config.indexer_compress_ratio if model_config.qsa else 1
    if page_size is None:
        return -(-DEFAULT_PAGE_SIZE // block) * block
    if page_size % block:
        raise ConfigError("page_size", f"{page_size} is not a multiple of the model's indexer_compress_ratio={block} "
                                       f"(a QSA block never straddles a page); leave it unset to follow the model")
    return page_size


def allocate_engine_cache(model_config: ModelConfig, engine_config: EngineConfig, dtype: torch.dtype, device,
                          model: torch.nn.Module | None = None) -> tuple[CacheAllocator, ModelCache, int]:
    """The cache tensors, as many pages as the memory budget holds (or `num_pages`) and max_num_seqs + 1 slots
    (with k-token speculative decoding (1 + k) x max_num_seqs + 1, and pages that hold the MTP draft layers' caches
    too; with prefix caching max_num_seqs more slots for its checkpoints), with their allocator and the max_model_len
    they serve (engine_config's, else the model's max_position_embeddings where the pages hold that many tokens, else
    as many as they hold); logs the memory plan (`qwen4exp.memory`, with the weights of `model` when given)."""
    c, e = model_config, engine_config
    device = torch.device(device)
    page_size = resolve_page_size(c, e.page_size)
    mtp = e.speculative_config is not None
    per_seq = 1 + e.num_speculative_tokens
    checkpoints = e.max_num_seqs if e.enable_prefix_caching else 0
    ssm_name = e.ssm_dtype(c)
    ssm_dtype = getattr(torch, ssm_name)
    plan = MemoryPlan(str(device), e.cpu_cache_bytes, page_size, max(page_bytes(c, page_size, dtype, mtp), 1),
                      max(slot_bytes(c, dtype, ssm_dtype), 1), per_seq * e.max_num_seqs + 1 + checkpoints,
                      e.max_model_len or c.max_position_embeddings, e.max_num_seqs, per_seq, checkpoints,
                      ssm_dtype=ssm_name)
    hints = []
    if device.type == "cuda":
        memory = DeviceMemory.measure(device, e.gpu_memory_utilization)
        plan.budget = memory.budget
        plan.reserve = memory.total - int(memory.total * memory.utilization)
        if memory.utilization < 0.95:
            hints.append("--gpu-memory-utilization 0.95")
    if plan.ssm_dtype == "float32":
        hints.append("--mamba-ssm-cache-dtype bfloat16")
    if model is not None:
        tables = set(table_names(model))
        plan.weights = weights_by_dtype(model, device, skip=tables)
        table_params = [p for n, p in model.named_parameters() if n in tables]
        if table_params:
            where = "host memory" if on_host(table_params[0]) else str(device)
            plan.tables = (sum(p.numel() * p.element_size() for p in table_params),
                           f"{where}, {str(table_params[0].dtype).removeprefix('torch.')}")
            if device.type == "cuda" and not on_host(table_params[0]):
                hints.append("--ple-table-device cpu")
        if device.type == "cuda" and "float8_e4m3fn" not in plan.weights:
            hints.append("--quantization fp8")
    plan_cache(plan, e.num_pages, tuple(hints), fit_max_model_len=e.max_model_len is None)
    # every rank holds the same pages and slots: the fewest any rank's memory holds
    plan.num_pages, plan.max_model_len = distributed.min_over_ranks([plan.num_pages, plan.max_model_len])
    allocator = CacheAllocator(plan.num_pages, plan.num_slots - checkpoints, page_size, checkpoints)
    tensors = allocate_cache(c, plan.num_pages, page_size, plan.num_slots, dtype, device, mtp, ssm_dtype)
    logger.info(
        "KV cache: %d pages = %d tokens, %d state slots%s", allocator.pages.num_usable,
        allocator.pages.num_usable * page_size, allocator.slots.num_usable,
        f", prefix caching with {checkpoints} checkpoint slots" if checkpoints else ", prefix caching off",
    )
    logger.info("\n".join(plan.lines()))
    return allocator, tensors, plan.max_model_len
