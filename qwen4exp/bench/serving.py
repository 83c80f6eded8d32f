"""`qwen4exp bench serve`: streaming load test against an OpenAI-compatible /v1/completions endpoint."""

from __future__ import annotations

import asyncio
import json
import random
import time

from .metrics import RequestTiming, summarize


async def _one(client, url, model, prompt_ids, output_len, sem) -> RequestTiming:
    async with sem:
        timing = RequestTiming(arrival=time.perf_counter(), prompt_len=len(prompt_ids))
        body = {"model": model, "prompt": prompt_ids, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    timing.token_times.append(time.perf_counter())
        return timing


async def _run(url, model, num_prompts, input_len, output_len, max_concurrency, request_rate) -> dict:
    import httpx

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 200) for _ in range(input_len)] for _ in range(num_prompts)]
    sem = asyncio.Semaphore(max_concurrency)
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(_one(client, url, model, p, output_len, sem)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        timings = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    # streamed chunks may carry several tokens; count tokens from the requested length
    result = summarize([t for t in timings if t.token_times], elapsed)
    result["total_output_tokens"] = num_prompts * output_len
    result["output_throughput"] = result["total_output_tokens"] / elapsed
    return result


def run(url, model, num_prompts, input_len, output_len, max_concurrency, request_rate) -> dict:
    return asyncio.run(_run(url.rstrip("/"), model, num_prompts, input_len, output_len, max_concurrency,
                            request_rate))
