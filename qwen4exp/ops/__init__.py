"""Kernels. Each op is a public function with a torch reference beside its fast path.

The reference is the CPU path and the definition of correctness; a fast path (Triton, fla, CUDA) is chosen per
device by `fast_path(tensor)` and must agree with the reference (tests/ops).
"""

import contextlib
import functools
import os

import torch

_force_reference = os.environ.get("QWEN4EXP_REFERENCE_OPS", "0") == "1"


def fast_path(x: torch.Tensor) -> bool:
    """True when a fast kernel should run for tensors living where `x` lives."""
    return x.is_cuda and not _force_reference


def compiled_on_gpu(fn):
    """`fn` (a pure elementwise-heavy function) compiled by inductor when its first argument is on the GPU, so
    its chain of small kernels becomes one or two; the eager function is the reference and the CPU path."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if not (args[0].is_cuda and fast_path(args[0])) or _compile_disabled:
            return fn(*args, **kwargs)
        if compiled is None:
            # one specialisation per (dtype, group size, ...) combination the model uses; shapes stay dynamic
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(*args, **kwargs)

    wrapper.eager = fn
    return wrapper


_compile_disabled = os.environ.get("QWEN4EXP_NO_COMPILE", "0") == "1"


@contextlib.contextmanager
def reference_ops():
    """Force the torch reference of every op (agreement tests, debugging)."""
    global _force_reference
    saved, _force_reference = _force_reference, True
    try:
        yield
    finally:
        _force_reference = saved


from . import (  # noqa: E402,F401
    attention, conv, gated_delta, hyper_connection, linear, moe, ngram, norm, rotary, table_gather,
)
