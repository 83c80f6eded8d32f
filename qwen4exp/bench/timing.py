"""Per-call timing of single ops, as the model runs them (used by benchmarks/kernels and the suite).

A decode step and a mixed step of up to `GRAPH_MAX_TOKENS` tokens replay a CUDA graph: there an op's cost is its
kernels back to back, without the host launching them, so it is timed the same way: `calls` calls captured in one
graph, the graph replayed. Larger (prefill) steps launch eagerly, and so does their timing. Each layer reads its own
weights, which a step cycles through faster than L2 can keep any of them; calls of a benchmark cycle through enough
copies of their operands (`copies_out_of_l2`) that none is found in L2 either.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..engine.cuda_graph import MIXED_GRAPH_TOKENS

# Steps of up to this many tokens run as CUDA graphs in the engine (decode steps, and mixed steps up to the largest
# mixed-graph bucket); larger ones run eagerly.
GRAPH_MAX_TOKENS = max(MIXED_GRAPH_TOKENS)

# Bytes of operand copies a benchmark cycles through: several times the 50-60 MB L2 of an H100 / H200.
L2_FLUSH_BYTES = 256 << 20


def in_graph(tokens: int) -> bool:
    """Whether the engine runs a step of `tokens` tokens as a CUDA graph."""
    return tokens <= GRAPH_MAX_TOKENS


def copies_out_of_l2(nbytes: int, calls: int, total_bytes: int = L2_FLUSH_BYTES) -> int:
    """How many copies of an operand of `nbytes` the calls of a benchmark should cycle through so that none is still
    in L2 when its turn comes again: enough to fill `total_bytes`, but no more than max(calls, 4) (the calls of one
    round would never reach the rest)."""
    return max(1, min(max(calls, 4), -(-total_bytes // max(nbytes, 1))))


class Rotation:
    """Cycles through a list of argument sets: each call of `next()` returns the following one. A graph captures the
    pointers each captured call was given, so `calls` calls captured in one graph read `calls` different copies."""

    def __init__(self, items: list):
        if not items:
            raise ValueError("items: at least one set of arguments")
        self.items = items
        self._i = 0

    def next(self):
        item = self.items[self._i % len(self.items)]
        self._i += 1
        return item

    def rewind(self) -> None:
        self._i = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call_us(fn: Callable[[], object], calls: int, graph: bool, reps: int = 30,
                     device: torch.device | str = "cuda", warm_up: bool = True) -> float:
    """Median microseconds per call of `fn` over `reps` rounds of `calls` calls.

    CUDA with `graph`: the calls are captured in one CUDA graph (after one eager call that compiles and autotunes), and
    a round is one replay, timed with CUDA events. CUDA without `graph`: a round is `calls` eager calls between two
    events. Elsewhere (the CPU, e.g. Triton's interpreter): eager calls timed with the host clock, after one call
    unless `warm_up` is off (the caller has just made one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if warm_up or device.type == "cuda":
        fn()
    _sync(device)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
        return statistics.median(times)
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        # captured on a side stream, as torch.cuda.graph does; the warm-up above ran outside the capture
        with torch.cuda.graph(cuda_graph):
            for _ in range(calls):
                fn()
        cuda_graph.replay()

        def round_():
            cuda_graph.replay()
    else:
        def round_():
            for _ in range(calls):
                fn()
    round_()
    _sync(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        round_()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def max_abs_diff(a, b) -> float:
    """The largest |a - b| over tensors, or over the paired tensors of two tuples (None entries skipped); equal
    entries count 0, infinities included (masked scores are -inf on both sides)."""
    if isinstance(a, (tuple, list)):
        return max((max_abs_diff(x, y) for x, y in zip(a, b) if x is not None and y is not None), default=0.0)
    if not a.numel():
        return 0.0
    a, b = a.float(), b.float()
    return float(torch.where(a == b, 0.0, (a - b).abs()).max())
