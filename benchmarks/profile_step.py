"""Where a step's time goes on the GPU: every kernel of a CUDA-graph decode step (batch 1 and 64) and of an eager
prefill step (one 8k prompt) in order, with the idle gap before each, the GPU time of each decode graph replayed
alone, and the prefill / decode split of --max-num-seqs requests at once (1k in / 256 out). flash-next-128e, random
weights in bf16 (or fp8 with --quantization fp8); --preset flash-next runs the released shape as the suite's
flash_next stage does (fp8 n-gram table in host memory, 0.95 of the GPU's memory: an H200).

    python benchmarks/profile_step.py --out OUT [--parts decode,prefill,phases] [--quantization fp8]
        [--preset small] [--max-num-seqs 8] [--max-model-len 2048] [--decode-batches 1]
        [--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}']

Writes OUT/step_profile.json and, per profiled step, OUT/<step>_kernels.txt. Kernel times come from the torch
profiler (CUPTI sees the kernels inside a graph replay); with programmatic dependent launch (on by default on
Hopper) a kernel starts early and its time includes the wait for the kernel before it, so run with QWEN4EXP_PDL=0
for per-kernel times. A step's wall time is measured around `engine.step()`, which returns once the sampled ids are
on the host, and is inflated by the profiler.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import time

import torch

from qwen4exp.bench.engines import dummy_engine, preset_model_config
from qwen4exp.bench.fp8_stages import FLASH_NEXT_ENGINE
from qwen4exp.bench.offline import random_prompts, run_requests
from qwen4exp.bench.timing import time_per_call_us
from qwen4exp.config import EngineConfig
from qwen4exp.engine.request import SamplingParams

PARTS = ("decode", "prefill", "phases")


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


def kernels_from_trace(path: str) -> list[dict]:
    """The kernel events of a chrome trace, in start order."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])


def short(name: str) -> str:
    return name.split("(")[0].replace("void ", "")[:70]


def profile_steps(engine, steps: int, out_dir: str, tag: str) -> dict:
    """Profiles `steps` engine steps: per-step wall time, GPU busy time, kernels, idle gaps inside and between
    steps, and the kernels taking the most time. Writes one step's kernels in order to OUT/<tag>_kernels.txt."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    trace = os.path.join(out_dir, f"{tag}_trace.json")
    prof.export_chrome_trace(trace)
    kernels = kernels_from_trace(trace)
    os.remove(trace)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        by_name[short(k["name"])][0] += 1
        by_name[short(k["name"])][1] += k["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:45]
    gaps = [kernels[i]["ts"] - (kernels[i - 1]["ts"] + kernels[i - 1]["dur"]) for i in range(1, len(kernels))]
    # one step's kernels in order, from the middle of the profiled steps
    per_step = len(kernels) // steps
    first = per_step * (steps // 2)
    lines = [f"{kernels[i]['dur']:9.1f} us  gap {gaps[i - 1] if i else 0.0:7.1f}  {short(kernels[i]['name'])}"
             for i in range(first, min(first + per_step, len(kernels)))]
    with open(os.path.join(out_dir, f"{tag}_kernels.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    walls.sort()
    result = {"steps": steps, "median_wall_ms": walls[len(walls) // 2] * 1e3,
              "gpu_busy_ms": sum(k["dur"] for k in kernels) / steps / 1e3,
              "kernels_per_step": len(kernels) / steps,
              # small gaps are launch boundaries inside a step; large ones the host work between steps
              "gaps_under_20us_ms": sum(g for g in gaps if g < 20) / steps / 1e3,
              "gaps_over_20us_ms": sum(g for g in gaps if g >= 20) / steps / 1e3,
              "top": [(n, c / steps, t / steps) for n, (c, t) in top]}
    log(tag, {k: v for k, v in result.items() if k != "top"})
    for n, c, t in result["top"][:25]:
        log(f"  {t:9.1f} us/step  {c:6.1f}x  {n}")
    return result


def graph_runners(engine) -> dict:
    """The engine's CUDA-graph runners by role: the target's, and the draft layer's with speculative decoding."""
    runners = {"target": engine.runner.graphs}
    if engine.spec is not None:
        runners["draft"] = getattr(engine.spec.proposer, "graphs", None)
    return {role: r for role, r in runners.items() if r is not None}


def decode_part(engine, out_dir: str, batch: int, results: dict) -> None:
    """Ten graph-decode steps of `batch` requests (128-token prompts), once every request is decoding; then each
    graph those steps replayed, replayed alone (its GPU time without the host: a verify and a draft graph apart
    with speculative decoding)."""
    vocab = engine.model_config.vocab_size
    for i, p in enumerate(random_prompts(batch, 128, vocab, seed=5)):
        engine.add_request(f"dec{batch}-{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False))
    while any(len(r.output_token_ids) < 8 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    runners = graph_runners(engine)
    replayed = {role: set() for role in runners}
    for role, runner in runners.items():  # record the graphs the profiled steps replay
        runner._run = lambda key, role=role, run=runner._run: replayed[role].add(key) or run(key)
    try:
        results[f"decode_b{batch}"] = profile_steps(engine, 10, out_dir, f"decode_b{batch}")
    finally:
        for runner in runners.values():
            del runner._run  # the class's method again
    while engine.has_unfinished_requests():
        engine.step()
    # after the requests finished: a replay rewrites only the freed pages and slots of the last step's layout; the
    # median over rounds of 20 replays back to back, between CUDA events
    times = {f"{role} {key}": time_per_call_us(runners[role].graphs[key][0].replay, 20, graph=False, reps=10)
             for role, keys in replayed.items() for key in sorted(keys, key=str)}
    results[f"decode_b{batch}"]["graph_replay_us"] = times
    log(f"decode_b{batch} graph replays alone, us:", {k: round(v, 1) for k, v in times.items()})


def prefill_part(engine, out_dir: str, results: dict) -> None:
    """The eager step prefilling one 8k prompt (the second such step: the first compiles)."""
    vocab = engine.model_config.vocab_size
    for seed in (1, 2):
        engine.add_request(f"pf{seed}", {"prompt_token_ids": random_prompts(1, 8192, vocab, seed=seed)[0]},
                           SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
        if seed == 2:
            results["prefill_8k"] = profile_steps(engine, 1, out_dir, "prefill_8k")
        while engine.has_unfinished_requests():
            engine.step()


def phases_part(engine, results: dict, concurrency: int) -> None:
    """`concurrency` requests (1024 in, 256 out) at once, every step's wall time and token count recorded
    (synchronised after each step): how much of the run prefills and how much decodes."""
    steps = []
    execute = engine.runner.execute

    def timed(chunks, *args, **kwargs):
        t0 = time.perf_counter()
        out = execute(chunks, *args, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize()
        steps.append((sum(len(c.token_ids) for c in chunks), len(chunks), time.perf_counter() - t0))
        return out

    vocab = engine.model_config.vocab_size
    run_requests(engine, random_prompts(4, 1024, vocab, seed=98), 4)  # warm-up, outside the record
    engine.runner.execute = timed
    try:
        r = run_requests(engine, random_prompts(concurrency, 1024, vocab, seed=7), 256)
    finally:
        engine.runner.execute = execute
    prefill = [s for s in steps if s[0] > s[1]]
    decode = [s for s in steps if s[0] == s[1]]
    results[f"phases_c{concurrency}"] = {
        "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
        "output_tok_s": r["output_throughput"], "duration_s": r["duration_s"],
        "prefill_steps": len(prefill), "prefill_s": sum(s[2] for s in prefill),
        "prefill_tokens": sum(s[0] for s in prefill),
        "prefill_steps_ms_tokens": [(round(s[2] * 1e3, 1), s[0]) for s in prefill],
        "decode_steps": len(decode), "decode_s": sum(s[2] for s in decode),
        "decode_median_step_ms": sorted(s[2] for s in decode)[len(decode) // 2] * 1e3 if decode else None,
        "decode_batch_hist": collections.Counter(s[1] for s in decode).most_common(6),
    }
    log("phases", results[f"phases_c{concurrency}"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    ap.add_argument("--preset", default="flash-next-128e")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="the engine's step budget (its warm-up compiles prefill shapes up to it)")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="block-scaled fp8 weights, built in place")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=33 * 1024, help="(at most the preset's)")
    ap.add_argument("--decode-batches", default="1,64", help="comma-separated batch sizes the decode part profiles")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help="the engine's speculative decoding (JSON, as `serve` takes it): decode steps then verify "
                         "and draft; with random weights the drafts are rejected, so each step emits one token")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}, choose from {', '.join(PARTS)}")
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("qwen4exp").setLevel(logging.INFO)
    os.makedirs(args.out, exist_ok=True)
    cfg = preset_model_config(args.preset)
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 48, 64) if b <= args.max_num_seqs]
    # the released shape as the suite's flash_next stage runs it: its fp8 n-gram table in host memory, 0.95 of the GPU
    memory = ({k: FLASH_NEXT_ENGINE[k] for k in ("ple_table_device", "ple_table_dtype", "gpu_memory_utilization")}
              if args.preset == "flash-next" else dict(gpu_memory_utilization=0.92))
    ecfg = EngineConfig(max_model_len=min(args.max_model_len, cfg.max_position_embeddings),
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        cuda_graph_sizes=sizes, quantization=args.quantization,
                        speculative_config=args.speculative_config,
                        **memory)
    engine, startup = dummy_engine(cfg, ecfg, torch.device("cuda"))
    results = {"startup_s": startup, "device": torch.cuda.get_device_name(0), "quantization": args.quantization,
               "preset": args.preset, "speculative_config": args.speculative_config}
    path = os.path.join(args.out, "step_profile.json")
    for part in parts:
        if part == "decode":
            for batch in args.decode_batches.split(","):
                decode_part(engine, args.out, int(batch), results)
        elif part == "prefill":
            prefill_part(engine, args.out, results)
        elif part == "phases":
            phases_part(engine, results, args.max_num_seqs)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
