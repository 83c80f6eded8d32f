"""Soak test of the OpenAI server, run by hand (not part of the test suite): a bounded load of mixed requests on
loopback with a share of clients that disconnect mid-way, on a cache small enough to force preemption. Reports the
requests and their statuses, 5xx, the cache pages and state slots still held once idle (leaks), the server's RSS
at start (after a warm-up), peak and end, and whether a greedy probe returns the same text before, during and after.

    python benchmarks/soak_server.py                      # 2,000 requests, 30% disconnects, at most 10 minutes
    python benchmarks/soak_server.py --requests 200 --time-limit 120

The server runs in this process (so its cache can be inspected); the load comes from a child process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

PROBE = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0.0}
ERRORS_400: set[str] = set()  # what the random requests got wrong (the client's side)


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


# ----- the load (child process) -----
async def _one(client, url: str, rng: random.Random, disconnect: bool) -> tuple[int | str, bool]:
    """Sends one random request; returns its status (or "cut" when we cut it) and whether it reported a 5xx
    in-band."""
    chat = rng.random() < 0.4
    stream = rng.random() < 0.6
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "fox", "dog", "Paris", "42", "é", "你好"])
                     for _ in range(rng.randint(1, 60)))
    body = {"max_tokens": rng.randint(1, 64), "temperature": rng.choice([0.0, 0.7, 1.0]), "stream": stream,
            "n": rng.choice([1, 1, 1, 2]), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["stop"] = ["a"]
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": words}]
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=2)
    else:
        path = "/v1/completions"
        body["prompt"] = words if rng.random() < 0.7 else [rng.randrange(3, 500) for _ in range(rng.randint(1, 80))]
        if rng.random() < 0.3:
            body["logprobs"] = 2
    cut_after = rng.randint(0, 4) if disconnect else None
    if not stream:
        if disconnect:  # the client gives up while the request is generating
            try:
                await client.post(url + path, json=body, timeout=rng.uniform(0.01, 0.3))
            except Exception:  # noqa: BLE001 - the cut we asked for
                pass
            return "cut", False
        r = await client.post(url + path, json=body, timeout=300)
        if r.status_code == 400:
            ERRORS_400.add(r.json()["error"]["message"][:120])
        return r.status_code, False
    async with client.stream("POST", url + path, json=body, timeout=300) as r:
        if r.status_code == 400:
            ERRORS_400.add(json.loads(await r.aread())["error"]["message"][:120])
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if '"error"' in line and '"code": 5' in line:
                return r.status_code, True
            events += 1
            if cut_after is not None and events > cut_after:
                return "cut", False
        return r.status_code, False


async def _load(url: str, requests: int, concurrency: int, disconnect: float, seed: int, time_limit: float) -> dict:
    import httpx

    rng = random.Random(seed)
    statuses: dict[str, int] = {}
    inband_5xx, probes = 0, []
    sem = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + time_limit

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def task(i: int):
            nonlocal inband_5xx
            async with sem:
                if time.monotonic() > deadline:
                    statuses["skipped (time limit)"] = statuses.get("skipped (time limit)", 0) + 1
                    return
                if i % 250 == 125:  # the probe, while the load runs
                    r = await client.post(url + "/v1/completions", json=PROBE, timeout=300)
                    probes.append(r.json()["choices"][0]["text"])
                try:
                    status, bad = await _one(client, url, random.Random(rng.random()), rng.random() < disconnect)
                except Exception as e:  # noqa: BLE001 - counted, reported
                    status, bad = type(e).__name__, False
                statuses[str(status)] = statuses.get(str(status), 0) + 1
                inband_5xx += bad

        await asyncio.gather(*[task(i) for i in range(requests)])
    return {"statuses": statuses, "inband_5xx": inband_5xx, "probes_during": probes, "400s": sorted(ERRORS_400)[:5]}


# ----- the server (this process) -----
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: a random tiny one)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=500, help="requests before RSS is first measured")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.3, help="share of clients that cut their request")
    p.add_argument("--num-pages", type=int, default=48, help="a small cache forces preemption")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds the load may run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tracemalloc", action="store_true",
                   help="also report where Python's allocations grew during the load (slower)")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the child: the URL to load
    args = p.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(_load(args.client, args.requests, args.concurrency, args.disconnect,
                                           args.seed, args.time_limit))))
        return

    import httpx
    import uvicorn

    from qwen4exp.config import EngineConfig
    from qwen4exp.engine.engine import LLMEngine
    from qwen4exp.entrypoints.async_engine import AsyncEngine
    from qwen4exp.entrypoints.server import build_app
    from qwen4exp.weights.random_checkpoint import make_random

    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="soak-tiny-")
        make_random(model, "tiny", dtype="float32")
    engine = LLMEngine(model, EngineConfig(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=16,
                                           max_num_batched_tokens=512, num_pages=args.num_pages))
    async_engine = AsyncEngine(engine).start()
    app = build_app(async_engine, "soak", max_model_len=256)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"  # loopback only
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    def probe() -> str:
        return httpx.post(url + "/v1/completions", json=PROBE, timeout=300).json()["choices"][0]["text"]

    def load(n: int, seed: int, time_limit: float) -> dict:
        out = subprocess.run([sys.executable, __file__, "--client", url, "--requests", str(n), "--concurrency",
                              str(args.concurrency), "--disconnect", str(args.disconnect), "--seed", str(seed),
                              "--time-limit", str(time_limit)], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def idle() -> None:
        """Waits until the engine is at rest: no request left, and idle long enough that its thread has handed
        freed heap back to the system (AsyncEngine trims the heap after idle_wait_s without work), so RSS at the
        start and at the end are measured in the same state."""
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.1)
        gc.collect()
        time.sleep(async_engine.idle_wait_s + 0.5)

    start = time.monotonic()
    before = probe()
    load(args.warmup, args.seed + 1, args.time_limit)
    idle()
    rss_start = rss_mib()
    peak, sampling = [rss_start], threading.Event()

    def sample():
        while not sampling.wait(0.5):
            peak.append(rss_mib())
            timeline.append(round(peak[-1], 1))

    timeline: list[float] = []

    sampler = threading.Thread(target=sample)
    sampler.start()
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(10)
        traced = tracemalloc.take_snapshot()
    preempted = preemptions(engine)
    result = load(args.requests, args.seed, args.time_limit - (time.monotonic() - start))
    sampling.set()
    sampler.join()
    after = probe()
    idle()
    cache = engine.cache
    workers = _children()  # the client is done: these are the render workers
    report = {
        "requests": args.requests,
        "statuses": result["statuses"],
        "5xx": sum(n for s, n in result["statuses"].items() if s.isdigit() and int(s) >= 500) + result["inband_5xx"],
        "preemptions": preemptions(engine) - preempted,
        "leaked_pages": cache.pages.num_usable - cache.pages.num_free,
        "leaked_slots": cache.slots.num_usable - cache.slots.num_free,
        "unfinished_requests": engine.num_unfinished_requests,
        "rss_mib": {"start": round(rss_start, 1), "peak": round(max(peak), 1), "end": round(rss_mib(), 1)},
        "rss_end_vs_start": f"{100 * (rss_mib() / rss_start - 1):+.1f}%",
        "rss_mib_at_each_tenth_of_the_load": timeline[len(timeline) // 10 - 1::len(timeline) // 10][:10],
        "400_messages": result["400s"],
        "render_workers_rss_mib": [round(rss_mib(pid), 1) for pid in workers],
        "probe_same_before_during_after": all(t == before for t in [*result["probes_during"], after]),
        "probes_during": len(result["probes_during"]),
        "seconds": round(time.monotonic() - start, 1),
    }
    if args.tracemalloc:
        growth = tracemalloc.take_snapshot().compare_to(traced, "traceback")
        report["python_allocation_growth"] = [
            f"{stat.size_diff / 1024:+.0f} KiB in {stat.count_diff:+d} blocks at "
            + " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in stat.traceback[:4])
            for stat in growth[:8]]
    print(json.dumps(report, indent=1))
    server.should_exit = True
    async_engine.shutdown()


def preemptions(engine) -> float:
    return engine.metrics.total("vllm:num_preemptions_total")


def _children() -> list[int]:
    pid = os.getpid()
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


if __name__ == "__main__":
    main()
