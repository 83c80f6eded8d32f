"""Kernels. Each op is a public function with a torch reference beside its fast path.

The reference is the CPU path and the definition of correctness; a fast path (Triton, fla, CUDA) is chosen per
device by `fast_path(tensor)` and must agree with the reference (tests/ops).
"""

import contextlib
import functools
import os
import types

import torch

_force_reference = os.environ.get("QWEN4EXP_REFERENCE_OPS", "0") == "1"
# Programmatic dependent launch on Hopper+ (ops/triton_pdl.py for our kernels; inductor's own for compiled ones).
pdl_enabled = os.environ.get("QWEN4EXP_PDL", "1") != "0"


def fast_path(x: torch.Tensor) -> bool:
    """True when a fast kernel should run for tensors living where `x` lives."""
    return x.is_cuda and not _force_reference


def compiled_on_gpu(fn=None, *, token_dim: int = 0):
    """`fn` (a pure elementwise-heavy function) compiled by inductor when its first argument is on the GPU, so
    its chain of small kernels becomes one or two; the eager function is the reference and the CPU path.

    The first argument's `token_dim` (and dim 0 of every tensor argument of the same length) is the token count,
    the only size that varies between calls of one call site. Each combination of everything else (dtypes, widths,
    group sizes, int arguments) gets its own copy of `fn`, hence its own dynamo cache, so the token count is the only
    size that turns symbolic: when widths of different call sites turned symbolic too, inductor's kernels divided by
    runtime widths at every element and ran 4-15x below bandwidth at 8k tokens."""
    if fn is None:
        return functools.partial(compiled_on_gpu, token_dim=token_dim)
    variants = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not (args[0].is_cuda and fast_path(args[0])) or _compile_disabled:
            return fn(*args, **kwargs)
        key = _static_signature(args, kwargs, token_dim)
        compiled = variants.get(key)
        if compiled is None:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
            copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                      fn.__closure__)
            compiled = variants[key] = torch.compile(copy, fullgraph=True, options=_compile_options())
        return compiled(*args, **kwargs)

    wrapper.eager = fn
    return wrapper


def _compile_options() -> dict:
    """inductor's programmatic dependent launch: each generated kernel waits for its predecessor before its first
    dependent load and releases the next launch after it, as ours do (torch >= 2.9; inductor itself only generates it
    for CUDA devices of capability 9 and up)."""
    import torch._inductor.config as inductor_config

    return {"triton.enable_pdl": True} if pdl_enabled and hasattr(inductor_config.triton, "enable_pdl") else {}


def _static_signature(args, kwargs, token_dim: int) -> tuple:
    n = args[0].shape[token_dim] if args[0].dim() else None
    key = []
    for i, a in enumerate(list(args) + list(kwargs.values())):
        if isinstance(a, torch.Tensor):
            shape = list(a.shape)
            if i == 0 and shape:
                shape[token_dim] = -1
            elif shape and shape[0] == n:
                shape[0] = -1
            key.append((a.dtype, tuple(shape)))
        else:
            key.append(tuple(a) if isinstance(a, list) else a)
    return tuple(key) + tuple(kwargs)


_side_streams: dict[tuple[torch.device, str], "torch.cuda.Stream"] = {}


def side_stream(device: torch.device, purpose: str) -> "torch.cuda.Stream":
    """One CUDA stream per (device, purpose), created on first use, for work that overlaps the compute stream.
    Forks and joins are stream waits, which CUDA graphs capture."""
    key = (torch.device(device), purpose)
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream(key[0])
    return stream


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
