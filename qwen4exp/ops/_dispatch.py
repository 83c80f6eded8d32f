"""Which implementation of an op runs: the process-wide switches, read from the environment once.

Every op has a torch reference (the CPU path and the definition of correctness) and, on the GPU, a fast path
(Triton, fla, inductor); `fast_path(x)` picks between them for tensors living where `x` lives. Tests change the
switches through `settings.override(...)` (or pytest's monkeypatch on `settings`), never through module globals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import types

import torch

# Triton is optional on CPU-only installs: every op then runs its reference.
HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclasses.dataclass
class OpSettings:
    # every op runs its torch reference, on the GPU too (QWEN4EXP_REFERENCE_OPS=1): for debugging a fast path
    reference: bool = False
    # fast paths also for CPU tensors, where Triton kernels run in its interpreter (tests of the GPU dispatch)
    fast_on_cpu: bool = False
    # programmatic dependent launch on Hopper and later (QWEN4EXP_PDL=0 turns it off); never in the interpreter
    pdl: bool = True

    @classmethod
    def from_env(cls) -> OpSettings:
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        return cls(reference=os.environ.get("QWEN4EXP_REFERENCE_OPS", "0") == "1",
                   pdl=os.environ.get("QWEN4EXP_PDL", "1") != "0" and not interpreted)

    @contextlib.contextmanager
    def override(self, **changes):
        """The given switches changed for the duration of a `with` block."""
        saved = {name: getattr(self, name) for name in changes}
        for name, value in changes.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)


settings = OpSettings.from_env()


def fast_path(x: torch.Tensor) -> bool:
    """True when a fast kernel should run for tensors living where `x` lives."""
    return not settings.reference and (x.is_cuda or settings.fast_on_cpu)


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
        if not (args[0].is_cuda and fast_path(args[0])):
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

    return {"triton.enable_pdl": True} if settings.pdl and hasattr(inductor_config.triton, "enable_pdl") else {}


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


_side_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """One CUDA stream per (device, purpose), created on first use, for work that overlaps the compute stream.
    Forks and joins are stream waits, which CUDA graphs capture."""
    key = (torch.device(device), purpose)
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream(key[0])
    return stream
