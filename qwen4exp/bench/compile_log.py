"""Records the compilations a stretch of serving triggers: Triton JIT kernels (name, specialisation key, seconds)
and graphs dynamo compiles. A compilation mid-serving is a stall of 0.3-7 s that the startup warm-up exists to
prevent, so benchmarks report them and a GPU test asserts there are none."""

from __future__ import annotations

import time


class CompileLog:
    def __init__(self):
        self.events: list[dict] = []
        self._graphs0 = 0

    def __enter__(self) -> "CompileLog":
        from torch._dynamo.utils import counters
        from triton.runtime.jit import JITFunction

        self._graphs0 = int(counters["stats"]["unique_graphs"])
        # JITFunction._do_compile is Triton's internal compile entry (3.6 on the H200 and 3.9 here both have it);
        # wrapping it sees every JIT kernel, autotuning configurations included
        self._cls, self._orig = JITFunction, JITFunction._do_compile
        orig, events = self._orig, self.events

        def logged(fn, key, *a, **k):
            t0 = time.perf_counter()
            out = orig(fn, key, *a, **k)
            events.append({"kernel": fn.fn.__name__, "key": str(key)[:600], "s": round(time.perf_counter() - t0, 3)})
            return out

        JITFunction._do_compile = logged
        return self

    def __exit__(self, *exc) -> None:
        self._cls._do_compile = self._orig

    @property
    def dynamo_graphs(self) -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"]) - self._graphs0
