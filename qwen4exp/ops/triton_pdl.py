"""Programmatic dependent launch (PDL, Hopper and later).

A decode step is ~1500 small kernels in one CUDA graph, and every kernel boundary costs a launch and a ramp-up. A
kernel launched with PDL may start while the kernel before it in the stream is still running: it waits at
`pdl_start` until that kernel has finished and its writes are visible, then lets the kernel after it launch. Waiting
before the first load or store keeps every kernel's view of memory what it would be without PDL; what overlaps is the
launch itself (H200, a chain of 192 small kernels in a graph: 1.36 -> 1.03 us a kernel, `python
bench/decode_kernels.py --parts pdl`).

Every Triton kernel here takes `PDL: tl.constexpr` and calls `pdl_start(PDL)` before touching memory; its launch
passes `**launch_options(tensor)`. QWEN4EXP_PDL=0 turns it off (and inductor's, `ops.compiled_on_gpu`).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from . import pdl_enabled

_ENABLED = pdl_enabled and os.environ.get("TRITON_INTERPRET", "0") != "1"


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(x: torch.Tensor) -> dict:
    """Keyword arguments for a launch whose data lives on x's device."""
    if _ENABLED and x.is_cuda:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if _supported(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel has finished and its writes are visible
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch; it waits here in turn
