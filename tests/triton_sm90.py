"""pytest plugin: every Triton launch of the selected tests compiles its kernel for an sm_90 GPU (H100 / H200) and
launches nothing, on a machine without a GPU. The interpreter, which runs the kernels on the CPU otherwise, accepts
code that Triton's compiler rejects (a loop variable re-typed inside a branch, say); this catches it.

    TRITON_INTERPRET=0 python -m pytest -p triton_sm90 tests/ops    (tests/ on PYTHONPATH)

Launches use the GPU's defaults (programmatic dependent launch on). Nothing runs, so the tests' own assertions are
void and ignored: a test fails only where a launch fails to compile. QWEN4EXP_SM90_REPORT=path writes the names of
the kernels compiled there (JSON)."""

import importlib
import json
import os
import pkgutil

import pytest
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

compiled: set[str] = set()


class KernelCompileError(Exception):
    """A launch whose kernel did not compile (or whose arguments Triton rejected)."""


class CompileOnlyDriver:
    """Triton's active driver on a machine without a GPU: an sm_90 target, device 0, the null stream."""

    target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def _launch_key(fn: JITFunction, args: tuple, kwargs: dict) -> tuple:
    """What decides a compilation here: the kernel, its constexprs and its arguments' dtypes. The launches of many
    tests differ only in sizes, which Triton would compile again for their divisibility."""
    def part(param, value):
        if param.is_constexpr:
            return repr(value)
        return str(value.dtype) if hasattr(value, "dtype") else type(value).__name__
    named = dict(zip((p.name for p in fn.params), args)) | kwargs
    return fn.fn.__name__, tuple((p.name, part(p, named[p.name])) for p in fn.params if p.name in named)


def pytest_configure(config):
    import qwen4exp.ops as ops

    driver.set_active(CompileOnlyDriver())
    run = JITFunction.run
    seen = set()

    def compile_only(self, *args, grid, warmup, **kwargs):
        key = _launch_key(self, args, kwargs)
        if key in seen:
            return None
        seen.add(key)
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:
            raise KernelCompileError(f"{self.fn.__name__}: {type(e).__name__}: {e}") from e
        compiled.add(self.fn.__name__)
        return kernel

    JITFunction.run = compile_only
    # the kernels' PDL variants, which a GPU launches by default (inputs here are CPU tensors)
    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"qwen4exp.ops.{info.name}")
        if info.name.endswith("_triton") and hasattr(module, "launch_options"):
            module.launch_options = lambda x: {"PDL": True, "launch_pdl": True}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    error = outcome.excinfo
    if error is not None and not any(isinstance(e, KernelCompileError) for e in _chain(error[1])):
        outcome.force_result(None)  # the kernels did not run: the test's checks of their outputs mean nothing


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def pytest_collection_modifyitems(config, items):
    """QWEN4EXP_SM90_SHARD=i/n keeps every n-th test from the i-th: processes sharing the tests by item rather than by
    file share the compilations evenly (one file's parametrizations can hold most of them)."""
    shard = os.environ.get("QWEN4EXP_SM90_SHARD")
    if shard:
        i, n = map(int, shard.split("/"))
        items[:] = items[i::n]


def pytest_unconfigure(config):
    path = os.environ.get("QWEN4EXP_SM90_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(sorted(compiled), f)
