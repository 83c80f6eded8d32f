"""Where the PLE n-gram tables live and in which dtype, and how rows are written into them.

The released table has 320M rows (51.2B parameters, 102 GB in bf16): more than a GPU should hold next to the model.
Its rows are addressed by token ids alone, so it can stay in page-locked host memory, read by the GPU row by row
(ops/table_gather.py), or be stored as float8_e4m3fn with one fp32 scale per table (half the bytes).
"""

from __future__ import annotations

import logging
import mmap
import time

import torch

logger = logging.getLogger("qwen4exp")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TABLE_DEVICES = ("auto", "gpu", "cpu")
TABLE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8")
# bytes of fp32 converted at a time when quantising or filling, so that conversion temporaries stay small
_CHUNK_BYTES = 4 << 20


_host_tables: set[int] = set()  # data pointers of live host_empty mappings


def on_host(table: torch.Tensor) -> bool:
    """Whether `table` was allocated by host_empty."""
    return table.untyped_storage().data_ptr() in _host_tables


class _HostMapping(mmap.mmap):
    """Anonymous mapping whose CUDA registration is undone when the last tensor viewing it is freed."""

    registered_ptr: int | None = None
    data_ptr: int | None = None

    def __del__(self):
        _host_tables.discard(self.data_ptr)
        if self.registered_ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.registered_ptr)
            except Exception:  # interpreter shutdown: the driver may already be gone
                pass


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor in its own mapping (2 MB pages where the kernel allows: random row reads touch
    fewer pages), registered with CUDA when `pin` so that kernels read it in place."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    mapping = _HostMapping(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)  # holds the mapping alive
    mapping.data_ptr = tensor.data_ptr()
    _host_tables.add(mapping.data_ptr)
    if pin and nbytes:
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"ple_table_device: could not page-lock {nbytes / 2**30:.1f} GiB of host memory for "
                               f"the n-gram table (cudaHostRegister error {int(err)})")
        mapping.registered_ptr = tensor.data_ptr()
    return tensor.view(dtype).view(shape)


def resolve_table_dtype(requested: str, model_dtype: torch.dtype, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """auto: an fp8 checkpoint table stays fp8, anything else takes the model dtype."""
    if requested not in TABLE_DTYPES:
        raise ValueError(f"ple_table_dtype: unknown value {requested!r} (expected one of {', '.join(TABLE_DTYPES)})")
    if requested == "auto":
        return FP8 if checkpoint_dtype == FP8 else model_dtype
    return FP8 if requested == "fp8" else getattr(torch, requested)


def resolve_table_on_host(
    requested: str, device: torch.device, table_bytes: int, other_bytes: int, gpu_memory_utilization: float
) -> bool:
    """Whether the n-gram tables live in host memory ("cpu") rather than with the model on its device ("gpu").

    auto keeps them with the model when all weights, tables included, leave at least 10% of the memory budget
    (gpu_memory_utilization x device memory, minus what others already use) for caches and activations; a CPU model
    keeps them with itself. "cpu" on a CPU model only changes the allocation (an anonymous mapping, see host_empty).
    """
    if requested not in TABLE_DEVICES:
        raise ValueError(f"ple_table_device: unknown value {requested!r} (expected one of {', '.join(TABLE_DEVICES)})")
    device = torch.device(device)
    if device.type != "cuda":
        if requested == "gpu":
            raise ValueError(f"ple_table_device: 'gpu' needs a CUDA model device, the model runs on {device}")
        return requested == "cpu"
    if requested != "auto":
        logger.info("n-gram tables (%.2f GiB) on %s, as requested", table_bytes / 2**30,
                    "page-locked host memory" if requested == "cpu" else "the GPU")
        return requested == "cpu"
    free, total = torch.cuda.mem_get_info(device)
    budget = total * gpu_memory_utilization - (total - free)
    fits = other_bytes + table_bytes <= 0.9 * budget
    logger.info(
        "ple_table_device=auto: weights %.2f GiB + n-gram tables %.2f GiB %s 90%% of the %.2f GiB budget "
        "-> tables on %s",
        other_bytes / 2**30, table_bytes / 2**30, "fit in" if fits else "exceed", budget / 2**30,
        "the GPU" if fits else "the host (page-locked)",
    )
    return not fits


def fp8_scale(amax: float) -> float:
    return amax / FP8_MAX if amax > 0 else 1.0


def write_rows_(dest: torch.Tensor, offset: int, rows: torch.Tensor, scale: float) -> None:
    """dest[offset: offset+len(rows)] = rows, quantised as rows / scale when dest is fp8 and rows are not.

    Converted a chunk at a time on the rows' device, so the temporaries stay a few MB whatever the shard size."""
    quantise = dest.dtype == FP8 and rows.dtype != FP8
    step = max(1, _CHUNK_BYTES // (4 * max(rows.shape[1], 1)))
    for s in range(0, rows.shape[0], step):
        part = rows[s: s + step]
        if quantise:
            part = (part.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        elif dest.dtype != part.dtype:
            part = part.to(dest.dtype)
        dest[offset + s: offset + s + part.shape[0]].copy_(part, non_blocking=False)


def fill_random_(table: torch.Tensor, scale_buffer: torch.Tensor, seed: int, work_device: torch.device) -> None:
    """Random N(0, 1) rows for `load_format="dummy"`, generated in chunks on `work_device` from `seed` alone, so the
    values do not depend on where the table lives or its dtype (an fp8 table holds their quantised values)."""
    rows = table.shape[0]
    step = 1 << 20

    def chunk(i: int) -> torch.Tensor:
        g = torch.Generator(device=work_device).manual_seed(seed * 1_000_003 + i)
        n = min(step, rows - i * step)
        return torch.randn(n, table.shape[1], generator=g, device=work_device)

    n_chunks = -(-rows // step)
    scale = 1.0
    if table.dtype == FP8:
        amax = max(chunk(i).abs().max().item() for i in range(n_chunks))
        scale = fp8_scale(amax)
    t0 = time.perf_counter()
    for i in range(n_chunks):
        write_rows_(table, i * step, chunk(i), scale)
    scale_buffer.fill_(scale)
    logger.debug("random n-gram table %s %s filled in %.1f s", tuple(table.shape), table.dtype,
                 time.perf_counter() - t0)
