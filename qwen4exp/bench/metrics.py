"""Latency bookkeeping shared by the benchmarks: per-request timestamps -> vLLM-named summary statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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


def distribution(values: list[float], name: str, percentiles=(99,)) -> dict:
    """vLLM's statistics of one latency in ms (`values` in seconds): mean_, median_, std_ and p{P}_{name}_ms for each
    percentile P (numpy's, interpolated). Nothing for no values."""
    if not values:
        return {}
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{int(p) if int(p) == p else p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(timings: list[RequestTiming], elapsed: float) -> dict:
    """The in-process runs' summary: vLLM's `bench serve` keys (p90 and p99), the run's duration_s, and max_*_ms: one
    multi-second stall (e.g. a first-use compilation) hides below the p99 of thousands of ITLs."""
    out_tokens = sum(len(t.token_times) for t in timings)
    in_tokens = sum(t.prompt_len for t in timings)
    res = {"duration_s": elapsed, "completed": len(timings), "total_input_tokens": in_tokens,
           "total_output_tokens": out_tokens, "request_throughput": len(timings) / elapsed,
           "output_throughput": out_tokens / elapsed, "total_token_throughput": (in_tokens + out_tokens) / elapsed}
    for name, values in (("ttft", [t.ttft for t in timings]),
                         ("tpot", [t.tpot for t in timings if t.tpot is not None]),
                         ("itl", [x for t in timings for x in t.itls]),
                         ("e2el", [t.e2e for t in timings])):
        stats = distribution(values, name, (90, 99))
        if stats:
            stats[f"max_{name}_ms"] = max(values) * 1000.0
        res |= stats
    return res
