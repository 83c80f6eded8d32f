import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton kernels run in the interpreter when there is no GPU (must be set before triton is imported).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language's modules at each launch and again at every @triton.jit helper a
    kernel calls (inspect.getmembers over them, ~1 ms a call, never undone), which makes a helper in a kernel's loop
    cost more than the loop's arithmetic. Within a launch, a helper whose modules (triton.language, .core) are
    already patched skips the repeat here. Only where this Triton's interpreter is laid out as expected."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import threading

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or not hasattr(interpreter, "GridExecutor"):
        return
    launch = threading.local()  # this thread's launch in progress: the language modules patched in it

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    class LaunchScope:
        def __init__(self, scope, patched):
            self.scope = scope
            launch.patched = patched

        def restore(self):
            launch.patched = None
            self.scope.restore()

    class AlreadyPatched:
        def restore(self):
            pass

    def patch_once(fn):
        patched = getattr(launch, "patched", None)
        if patched is None:  # a launch (GridExecutor): its scope is restored when it ends
            return LaunchScope(patch(fn), languages(fn))
        wanted = languages(fn)
        if wanted <= patched:
            return AlreadyPatched()
        patched |= wanted
        return patch(fn)  # a helper's call: Triton never restores these

    interpreter._patch_lang = patch_once


_patch_language_once_per_launch()


def _no_overflow_checks_in_the_interpreter() -> None:
    """Triton's interpreter checks every 32-bit integer add, sub and mul for overflow (both operands cast to 64 bits,
    two compares and an assert), a check the GPU build makes only with debug on; it is about a quarter of an
    engine-level test's time. At the tests' sizes no index comes near 2**31, and numpy's int32 wraps as the GPU's
    does."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import dataclasses

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not hasattr(options, "sanitize_overflow"):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


_no_overflow_checks_in_the_interpreter()
