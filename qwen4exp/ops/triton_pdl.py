"""Programmatic dependent launch (PDL, Hopper and later).

A decode step is ~1500 small kernels in one CUDA graph, and every kernel boundary costs a launch and a ramp-up. A
kernel launched with PDL may start while the kernel before it in the stream is still running: it waits at
`pdl_start` until that kernel has finished and its writes are visible, then lets the kernel after it launch. Waiting
before the first load or store keeps every kernel's view of memory what it would be without PDL; what overlaps is the
launch itself (H200, a chain of 192 small kernels in a graph: 1.36 -> 1.03 us a kernel, `python
bench/decode_kernels.py --parts pdl`).

Every Triton kernel here takes `PDL: tl.constexpr` and calls `pdl_start(PDL)` before touching memory; its launch
passes `**launch_options(tensor)`. QWEN4EXP_PDL=0 turns it off (and inductor's, `ops.compiled_on_gpu`).

`tma_descriptor` builds the other Hopper-only launch argument, a TMA descriptor (the kernels' switches that take one,
`triton_moe.TMA_WEIGHTS` and `triton_gdn.TMA_STATE`, are off until measured).
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


def _hopper(x: torch.Tensor) -> bool:
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _supported(index)


def launch_options(x: torch.Tensor) -> dict:
    """Keyword arguments for a launch whose data lives on x's device."""
    if _ENABLED and x.is_cuda and _hopper(x):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def tma_descriptor(x: torch.Tensor, block_shape: list[int]):
    """A TMA descriptor of the contiguous 2-D x in block_shape boxes (Hopper's bulk tensor copies, which the
    interpreter emulates on the CPU), or None where the device has no TMA or x is not contiguous."""
    if not x.is_contiguous() or (x.is_cuda and not _hopper(x)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(x, block_shape=block_shape)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel has finished and its writes are visible
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch; it waits here in turn
