"""Latency bookkeeping shared by the benchmarks: per-request timestamps -> vLLM-named summary statistics."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    prompt_len: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def _pcts(values: list[float], name: str, scale: float = 1000.0) -> dict:
    if not values:
        return {}
    s = sorted(values)

    def pct(p):
        return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] * scale

    # max: one multi-second stall (e.g. a first-use compilation) hides below the p99 of thousands of ITLs
    return {f"mean_{name}_ms": statistics.fmean(s) * scale, f"median_{name}_ms": statistics.median(s) * scale,
            f"p90_{name}_ms": pct(90), f"p99_{name}_ms": pct(99), f"max_{name}_ms": s[-1] * scale}


def summarize(timings: list[RequestTiming], elapsed: float) -> dict:
    out_tokens = sum(len(t.token_times) for t in timings)
    in_tokens = sum(t.prompt_len for t in timings)
    res = {"duration_s": elapsed, "completed": len(timings), "total_input_tokens": in_tokens,
           "total_output_tokens": out_tokens, "request_throughput": len(timings) / elapsed,
           "output_throughput": out_tokens / elapsed, "total_token_throughput": (in_tokens + out_tokens) / elapsed}
    res |= _pcts([t.ttft for t in timings], "ttft")
    res |= _pcts([t.tpot for t in timings if t.tpot is not None], "tpot")
    res |= _pcts([x for t in timings for x in t.itls], "itl")
    res |= _pcts([t.e2e for t in timings], "e2el")
    return res
