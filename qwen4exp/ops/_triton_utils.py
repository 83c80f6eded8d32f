"""Helpers shared by the Triton kernels: programmatic dependent launch and rounding as the references round.

Programmatic dependent launch (PDL, Hopper and later). A decode step is ~1500 small kernels in one CUDA graph, and
every kernel boundary costs a launch and a ramp-up. A kernel launched with PDL may start while the kernel before it
in the stream is still running: it waits at `pdl_start` until that kernel has finished and its writes are visible,
then lets the kernel after it launch. Waiting before the first load or store keeps every kernel's view of memory
what it would be without PDL; what overlaps is the launch itself (H200, a chain of 192 small kernels in a graph:
1.36 -> 1.03 us a kernel). Every kernel takes `PDL: tl.constexpr` and calls `pdl_start(PDL)` before touching
memory that a kernel may write; only weights, which no kernel writes, are read before it (the hc mix kernels'
first tiles, the decode GEMVs' first steps), so that their read overlaps the kernel before. Its launch passes
`**launch_options(tensor)`. `ops.settings.pdl` (QWEN4EXP_PDL=0) turns it off, inductor's too
(`ops.compiled_on_gpu`).
"""

import functools
import os

import torch
import triton
import triton.language as tl

from ._dispatch import settings

# Triton decides at decoration time whether a kernel runs in its interpreter; kernels that must know read this.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(x: torch.Tensor) -> dict:
    """Keyword arguments for a launch whose data lives on x's device."""
    if settings.pdl and not INTERPRETED and x.is_cuda:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if _pdl_supported(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel has finished and its writes are visible
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch; it waits here in turn


def rounding(dtype: torch.dtype) -> str | None:
    """Round-to-nearest-even for narrowing casts (`fp_downcast_rounding`), stated explicitly because the interpreter
    truncates by default (the GPU already rounds to nearest); an fp32 output is no narrowing cast, where Triton
    rejects a mode."""
    return None if dtype == torch.float32 else "rtne"


@triton.jit
def round_to_bf16(x):
    """fp32 -> nearest bf16 (ties to even), kept in fp32, for finite x. The bits are rounded by hand because the
    interpreter's fp32 -> bf16 cast truncates; on the GPU this equals the cast."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, dtype: tl.constexpr, BF16: tl.constexpr):
    """x (fp32) rounded to the model dtype, kept in fp32 (bf16 by hand: the interpreter's casts truncate)."""
    if BF16:
        return round_to_bf16(x)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def head_rows(R, HEADS, D: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R rows of a [T, HEADS, D] tensor seen as R = T * HEADS rows: row ids, in range, token,
    head, and the dimension offsets."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows, rows < R, rows // HEADS, rows % HEADS, tl.arange(0, D)
