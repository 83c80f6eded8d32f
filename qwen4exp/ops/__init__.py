"""Kernels. Each op is a public function with a torch reference beside its fast path.

The reference is the CPU path and the definition of correctness; a fast path (Triton, fla, CUDA) is chosen per
device by `fast_path(tensor)` and must agree with the reference (tests/ops).
"""

import contextlib
import os

import torch

_force_reference = os.environ.get("QWEN4EXP_REFERENCE_OPS", "0") == "1"


def fast_path(x: torch.Tensor) -> bool:
    """True when a fast kernel should run for tensors living where `x` lives."""
    return x.is_cuda and not _force_reference


@contextlib.contextmanager
def reference_ops():
    """Force the torch reference of every op (agreement tests, debugging)."""
    global _force_reference
    saved, _force_reference = _force_reference, True
    try:
        yield
    finally:
        _force_reference = saved


from . import attention, conv, gated_delta, moe, ngram, norm, rotary  # noqa: E402,F401
