"""`qwen4exp bench serve`: streaming load test against an OpenAI-compatible /v1/completions endpoint, with vLLM's
`bench serve` result keys.

A request fails on an HTTP error status, a connection or protocol error, an error event in its stream, or a stream
that ends without a token; the run goes on, counts it in `failed` and its message in `error_summary`. The latency
statistics are over the completed requests; output tokens are the server's `usage.completion_tokens`.

When the server runs speculative decoding, its `vllm:spec_decode_*` counters are read from /metrics before and after
the run and the result gets vLLM's `spec_decode_*` keys (acceptance rate in percent, acceptance length = 1 +
accepted tokens per draft, per-position acceptance rates) over the run's steps.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import time
from dataclasses import dataclass, field

from .metrics import distribution

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    generated_text: str = ""


async def _one(client, url: str, model: str, prompt_ids: list[int], output_len: int,
               sem: asyncio.Semaphore) -> RequestResult:
    async with sem:
        out = RequestResult(prompt_len=len(prompt_ids))
        body = {"model": model, "prompt": prompt_ids, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = last = time.perf_counter()
        chunks = 0
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    out.error = f"HTTP {resp.status_code}: {_message(resp.text) or resp.reason_phrase}"
                    return out
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        out.error = f"error event: {_message(data) or data['error']}"
                        return out
                    if data.get("choices"):
                        now = time.perf_counter()
                        if chunks == 0:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last, chunks = now, chunks + 1
                        out.generated_text += data["choices"][0].get("text") or ""
                    elif data.get("usage"):
                        out.output_tokens = data["usage"].get("completion_tokens") or 0
        except Exception as e:  # noqa: BLE001 - a failed request, counted; the run goes on
            out.error = f"{type(e).__name__}: {e}"
            return out
        if chunks == 0:
            out.error = "the stream ended without a token"
            return out
        out.success, out.latency = True, last - start
        out.output_tokens = out.output_tokens or chunks  # a server without usage: one token per chunk
        return out


def _message(payload) -> str | None:
    """The message of an OpenAI error envelope (a dict, or its JSON text)."""
    try:
        data = json.loads(payload) if isinstance(payload, str) else payload
        return data["error"]["message"]
    except (ValueError, TypeError, KeyError):
        return None


def summarize(results: list[RequestResult], duration: float, percentile_metrics=PERCENTILE_METRICS,
              percentiles=(99,)) -> dict:
    """vLLM's `bench serve` metrics of a run, plus `error_summary` (message -> count)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    res = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
           "total_token_throughput": (total_in + total_out) / duration}
    values = {"ttft": [r.ttft for r in ok],
              "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}
    for name in percentile_metrics:
        res |= distribution(values[name] or [0.0], name, percentiles)  # as vLLM: zeros when nothing completed
    res["error_summary"] = dict(collections.Counter(r.error for r in results if not r.success).most_common())
    return res


async def _run(url, model, num_prompts, input_len, output_len, max_concurrency, request_rate, percentile_metrics,
               percentiles) -> tuple[dict, list[RequestResult]]:
    import httpx

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 200) for _ in range(input_len)] for _ in range(num_prompts)]
    sem = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(_one(client, url, model, p, output_len, sem)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return summarize(results, duration, percentile_metrics, percentiles), results


SPEC_DECODE_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counters(url: str) -> tuple[dict[str, float], dict[int, float]] | None:
    """The server's speculative decoding counters (summed over its label sets) and accepted tokens per draft
    position, from its /metrics; None when it exports none (speculation off) or /metrics cannot be read."""
    import httpx

    try:
        r = httpx.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    totals, per_pos, found = dict.fromkeys(SPEC_DECODE_COUNTERS, 0.0), {}, False
    for line in r.text.splitlines():
        if not line.startswith("vllm:spec_decode_"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{")[0][len("vllm:spec_decode_"):]
        if not name.endswith("_total"):
            continue
        name, found = name[:-len("_total")], True
        if name == "num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', series)
            if pos:  # a series without its position label cannot be placed
                per_pos[int(pos[1])] = per_pos.get(int(pos[1]), 0.0) + float(value)
        elif name in totals:
            totals[name] += float(value)
    return (totals, per_pos) if found else None


def spec_decode_stats(before, after) -> dict:
    """vLLM's `spec_decode_*` result keys over what the counters gained between `before` and `after` (from
    `spec_decode_counters`); {} when either is None or no draft token was verified."""
    if before is None or after is None:
        return {}
    gained = {k: after[0][k] - before[0][k] for k in SPEC_DECODE_COUNTERS}
    drafts, draft_tokens, accepted = (gained[k] for k in SPEC_DECODE_COUNTERS)
    if draft_tokens <= 0:
        return {}
    positions = sorted(set(before[1]) | set(after[1]))
    return {
        "spec_decode_acceptance_rate": 100 * accepted / draft_tokens,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts > 0 else 0.0,
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_per_position_acceptance_rates": [
            (after[1].get(p, 0.0) - before[1].get(p, 0.0)) / drafts for p in positions] if drafts > 0 else [],
    }


def run(url: str, model: str | None, num_prompts: int, input_len: int, output_len: int, max_concurrency: int,
        request_rate: float, percentile_metrics=PERCENTILE_METRICS, percentiles=(99,),
        save_detailed: bool = False) -> dict:
    """The run's results as vLLM's `bench serve` writes them (its configuration, then the metrics; the
    per-request lists only with `save_detailed`). `model`: the served name, else the server's first model."""
    url = url.rstrip("/")
    if model is None:
        import httpx

        model = httpx.get(f"{url}/v1/models", timeout=30).raise_for_status().json()["data"][0]["id"]
    spec_before = spec_decode_counters(url)
    metrics, results = asyncio.run(_run(url, model, num_prompts, input_len, output_len, max_concurrency,
                                        request_rate, percentile_metrics, percentiles))
    out = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "model_id": model,
           "num_prompts": num_prompts, "request_rate": request_rate if request_rate < float("inf") else "inf",
           "max_concurrency": max_concurrency} | metrics | spec_decode_stats(spec_before, spec_decode_counters(url))
    if save_detailed:
        out |= {"input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
                "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                "latencies": [r.latency for r in results], "generated_texts": [r.generated_text for r in results],
                "errors": [r.error for r in results]}
    return out
