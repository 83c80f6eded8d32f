"""Where a step's time goes on the GPU: CUDA-graph decode at batch 1 and 64, eager prefill of one 8k prompt, and the
prefill / decode split of the 64-request throughput run.

    python bench/step_profile.py --out OUT_DIR [--parts decode,prefill,phases,host_modules,...]

Writes OUT_DIR/step_profile.json and, per decode batch, OUT_DIR/decode_b{B}_kernels.txt: every kernel of one step in
order with its duration and the idle gap before it. Kernel times come from the torch profiler (CUPTI sees the
kernels inside a graph replay); a step's wall time is measured around `engine.step()`, which returns once the
sampled ids are on the host.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h200_suite import log, preset  # noqa: E402

from qwen4exp.bench.offline import random_prompts, run_requests  # noqa: E402
from qwen4exp.config import EngineConfig  # noqa: E402
from qwen4exp.engine.engine import LLMEngine  # noqa: E402
from qwen4exp.engine.request import SamplingParams  # noqa: E402


def kernels_from_trace(path: str) -> list[dict]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ks = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    ks.sort(key=lambda e: e["ts"])
    return ks


def short(name: str) -> str:
    return name.split("(")[0].replace("void ", "")[:70]


def profile_steps(engine, steps: int, out_dir: str, tag: str) -> dict:
    """Profiles `steps` engine steps; returns per-step wall, GPU busy, kernel counts and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    trace = os.path.join(out_dir, f"{tag}_trace.json")
    prof.export_chrome_trace(trace)
    ks = kernels_from_trace(trace)
    os.remove(trace)
    busy = sum(k["dur"] for k in ks) / steps
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for k in ks:
        by_name[short(k["name"])][0] += 1
        by_name[short(k["name"])][1] += k["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:45]
    # one step's kernels in order: split the stream at the largest gaps (the host work between steps)
    gaps = [ks[i]["ts"] - (ks[i - 1]["ts"] + ks[i - 1]["dur"]) for i in range(1, len(ks))]
    lines = []
    per_step = len(ks) // steps
    first = per_step * (steps // 2)
    for i in range(first, min(first + per_step, len(ks))):
        g = gaps[i - 1] if i else 0.0
        lines.append(f"{ks[i]['dur']:9.1f} us  gap {g:7.1f}  {short(ks[i]['name'])}")
    with open(os.path.join(out_dir, f"{tag}_kernels.txt"), "w") as f:
        f.write("\n".join(lines))
    small_gaps = sum(g for g in gaps if g < 20) / steps
    big_gaps = sum(g for g in gaps if g >= 20) / steps
    walls.sort()
    res = {"steps": steps, "median_wall_ms": walls[len(walls) // 2] * 1e3, "gpu_busy_ms": busy / 1e3,
           "kernels_per_step": len(ks) / steps, "gaps_under_20us_ms": small_gaps / 1e3,
           "gaps_over_20us_ms": big_gaps / 1e3,
           "top": [(n, c / steps, t / steps) for n, (c, t) in top]}
    log(tag, {k: v for k, v in res.items() if k != "top"})
    for n, c, t in res["top"][:25]:
        log(f"  {t:9.1f} us/step  {c:6.1f}x  {n}")
    return res


def decode_part(engine, out_dir: str, batch: int, results: dict) -> None:
    vocab = engine.model_config.vocab_size
    for i, p in enumerate(random_prompts(batch, 128, vocab, seed=5)):
        engine.add_request(f"dec{batch}-{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False))
    while any(len(r.output_token_ids) < 8 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    results[f"decode_b{batch}"] = profile_steps(engine, 10, out_dir, f"decode_b{batch}")
    while engine.has_unfinished_requests():
        engine.step()


def prefill_part(engine, out_dir: str, results: dict) -> None:
    vocab = engine.model_config.vocab_size
    for seed in (1, 2):  # the first compiles
        engine.add_request(f"pf{seed}", {"prompt_token_ids": random_prompts(1, 8192, vocab, seed=seed)[0]},
                           SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
        if seed == 2:
            results["prefill_8k"] = profile_steps(engine, 1, out_dir, "prefill_8k")
        while engine.has_unfinished_requests():
            engine.step()


def prefill_batch_part(engine, out_dir: str, results: dict, n: int = 8, length: int = 1024) -> None:
    """One eager step prefilling `n` prompts of `length` tokens (the steps of the 64-request run's prefill phase);
    the first such step compiles, the second is profiled."""
    vocab = engine.model_config.vocab_size
    for seed in (11, 12):
        for i, p in enumerate(random_prompts(n, length, vocab, seed=seed)):
            engine.add_request(f"pb{seed}-{i}", {"prompt_token_ids": p},
                               SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
        if seed == 12:
            results[f"prefill_{n}x{length}"] = profile_steps(engine, 1, out_dir, f"prefill_{n}x{length}")
        while engine.has_unfinished_requests():
            engine.step()


def prefill_host_part(engine, results: dict, n: int = 8, length: int = 1024) -> None:
    """Unprofiled wall time of eager prefill steps of `n` x `length` tokens (synchronous scheduling, so one step is
    one forward), then one such step under cProfile: where the host time goes."""
    import cProfile
    import io
    import pstats

    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    engine.async_scheduling, was = False, engine.async_scheduling
    walls = []
    prof = cProfile.Profile()
    for rnd in range(4):
        for i, p in enumerate(random_prompts(n, length, vocab, seed=40 + rnd)):
            engine.add_request(f"ph{rnd}-{i}", {"prompt_token_ids": p}, params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rnd == 3:
            prof.enable()
        engine.step()
        torch.cuda.synchronize()
        if rnd == 3:
            prof.disable()
        walls.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    engine.async_scheduling = was
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    results[f"prefill_{n}x{length}_host"] = {"walls_ms": [w * 1e3 for w in walls], "cprofile": text.getvalue()}
    log("prefill walls ms", [round(w * 1e3, 1) for w in walls])
    log(text.getvalue()[:14000])


def splits_part(engine, results: dict, rounds: int = 3) -> None:
    """Batch-1 decode with one-bucket graphs whose dense attention sizes its key splits for the graph's context
    bound, against graphs sized for the block table's capacity (the previous default); the engine's own graphs
    (all buckets, bounded) as a third column. Alternating, one process."""
    from qwen4exp.engine.cuda_graph import CUDAGraphRunner
    from qwen4exp.ops import triton_attention

    bounded = triton_attention.sparse_paged_attention

    def unbounded(*a, max_context=None, **k):
        return bounded(*a, **k)

    def graphs(fn):
        triton_attention.sparse_paged_attention = fn
        try:
            g = CUDAGraphRunner(engine.model, engine.runner.cache, engine.cache.page_size,
                                engine.config.max_model_len, 1, engine.device, [1])
            g.capture()
        finally:
            triton_attention.sparse_paged_attention = bounded
        return g

    variants = {"engine": engine.runner.graphs, "bounded": graphs(bounded), "unbounded": graphs(unbounded)}
    vocab = engine.model_config.vocab_size
    prompt = random_prompts(1, 128, vocab, seed=3)
    tpot = {k: [] for k in variants}
    for _ in range(rounds):
        for name, g in variants.items():
            engine.runner.graphs = g
            tpot[name].append(run_requests(engine, prompt, 128)["median_tpot_ms"])
    engine.runner.graphs = variants["engine"]
    results["splits_b1_tpot_ms"] = tpot
    log("splits", tpot)


def syncs_part(engine, results: dict) -> None:
    """Device syncs inside the model's forward on a mixed step (8 decodes + 7 x 1k prompts): each one stalls the
    launch queue. torch's sync debug mode reports them; the innermost frames in this repo or a library name each."""
    import traceback
    import warnings

    vocab = engine.model_config.vocab_size
    for i, p in enumerate(random_prompts(8, 64, vocab, seed=21)):
        engine.add_request(f"sd{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=4, ignore_eos=True,
                                                                            detokenize=False))
    engine.step()
    engine.step()
    for i, p in enumerate(random_prompts(7, 1024, vocab, seed=22)):
        engine.add_request(f"sp{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=1, ignore_eos=True,
                                                                            detokenize=False))
    model = engine.runner.model
    forward = model.forward
    stacks = collections.Counter()

    def keep(message, category, filename, lineno, file=None, line=None):
        # called where the warning is issued, so the Python stack is the syncing call's
        if "synchroniz" in str(message):
            frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
                      if "qwen4exp" in f.filename or "/fla/" in f.filename]
            stacks[" <- ".join(reversed(frames[-4:]))] += 1

    def watched(*a, **k):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return forward(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    model.forward = watched
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters on exit
            warnings.simplefilter("always")
            warnings.showwarning = keep
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        model.forward = forward
    results["syncs_in_forward"] = {"stacks": stacks.most_common(30), "total": sum(stacks.values())}
    log("syncs", results["syncs_in_forward"])


def phases_part(engine, results: dict, budget: int | None = None) -> None:
    """The 64 x (1024 in, 256 out) run, with every step's wall time and token count recorded; `budget` overrides
    max_num_batched_tokens for the run."""
    steps = []
    execute = engine.runner.execute

    def timed(chunks, pending_ids=None, *args):
        t0 = time.perf_counter()
        out = execute(chunks, pending_ids, *args)
        if out.is_cuda:
            torch.cuda.synchronize()
        steps.append((sum(len(c.token_ids) for c in chunks), len(chunks), time.perf_counter() - t0))
        return out

    vocab = engine.model_config.vocab_size
    # warm-up outside the record: a 4096-token step compiles the token-count-symbolic variants
    run_requests(engine, random_prompts(4, 1024, vocab, seed=98), 4)
    engine.runner.execute = timed
    config = engine.scheduler.config
    default_budget = config.max_num_batched_tokens
    engine.scheduler.config = dataclasses.replace(config, max_num_batched_tokens=budget or default_budget)
    try:
        r = run_requests(engine, random_prompts(64, 1024, vocab, seed=7), 256)
    finally:
        engine.runner.execute = execute
        engine.scheduler.config = config
    pre = [s for s in steps if s[0] > s[1]]
    dec = [s for s in steps if s[0] == s[1]]
    results[f"phases_c64_budget{budget or default_budget}"] = {
        "output_tok_s": r["output_throughput"], "duration_s": r["duration_s"],
        "prefill_steps": len(pre), "prefill_s": sum(s[2] for s in pre),
        "prefill_tokens": sum(s[0] for s in pre),
        "prefill_steps_ms_tokens": [(round(s[2] * 1e3, 1), s[0]) for s in pre],
        "decode_steps": len(dec), "decode_s": sum(s[2] for s in dec),
        "decode_median_step_ms": sorted(s[2] for s in dec)[len(dec) // 2] * 1e3 if dec else None,
        "decode_batch_hist": collections.Counter(s[1] for s in dec).most_common(6),
    }
    log("phases", budget or default_budget, results[f"phases_c64_budget{budget or default_budget}"])


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The union of [ts, ts + dur) over events (kernels of every stream), merged, in order."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    merged = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def run_trace_part(engine, out_dir: str, results: dict) -> None:
    """The 64 x (1024 in, 256 out) run as `bench throughput` runs it (asynchronous scheduling, nothing synchronised),
    traced with CUDA activity only: how much of the wall time the GPU runs no kernel, in the prefill phase (until the
    last request's first token) and in the decode phase, and the largest idle gaps with the kernels around them."""
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.model_config.vocab_size
    run_requests(engine, random_prompts(4, 1024, vocab, seed=98), 4)
    plain = run_requests(engine, random_prompts(64, 1024, vocab, seed=7), 256)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        traced = run_requests(engine, random_prompts(64, 1024, vocab, seed=7), 256)
        torch.cuda.synchronize()
    trace = os.path.join(out_dir, "run_trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    os.remove(trace)
    ks = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    busy = busy_intervals(ks)
    t_start, t_end = busy[0][0], busy[-1][1]
    t_split = t_start + traced["max_ttft_ms"] * 1e3  # the first kernel is ~the run's start; ttft is from arrival
    phases = {"prefill": [0.0, 0.0, 0], "decode": [0.0, 0.0, 0]}  # [busy us, idle us, gaps over 50 us]
    gaps = []
    for i, (s, e) in enumerate(busy):
        ph = phases["prefill" if s < t_split else "decode"]
        ph[0] += e - s
        if i:
            g = s - busy[i - 1][1]
            ph[1] += g
            if g > 50:
                ph[2] += 1
                gaps.append((g, busy[i - 1][1] - t_start))
    gaps.sort(reverse=True)
    starts = [k["ts"] for k in ks]

    def around(t):  # the kernels starting before / after the gap at offset t
        j = bisect.bisect_left(starts, t + t_start)
        before = short(ks[j - 1]["name"]) if j else "-"
        after = short(ks[j]["name"]) if j < len(ks) else "-"
        return before, after

    r = {"plain_output_tok_s": plain["output_throughput"], "traced_output_tok_s": traced["output_throughput"],
         "traced_duration_s": traced["duration_s"], "max_ttft_ms": traced["max_ttft_ms"],
         "kernel_span_s": (t_end - t_start) / 1e6, "kernels": len(ks),
         "copies": len(copies), "copy_busy_ms": sum(e["dur"] for e in copies) / 1e3}
    for name, (b, idle, n) in phases.items():
        r[name] = {"busy_ms": b / 1e3, "idle_ms": idle / 1e3, "gaps_over_50us": n}
    r["largest_gaps"] = [(round(g, 1), round(t / 1e3, 2), *around(t)) for g, t in gaps[:30]]
    results["run_trace"] = r
    log("run_trace", {k: v for k, v in r.items() if k != "largest_gaps"})
    for g, t, before, after in r["largest_gaps"][:15]:
        log(f"  gap {g:9.1f} us at {t:9.2f} ms  after {before}  before {after}")


def compiles_part(engine, results: dict) -> None:
    """The suite's throughput sweep (1, 8, 32, 64 requests of 1024 in, 256 out) with every compilation logged."""
    from qwen4exp.bench.compile_log import CompileLog
    from qwen4exp.bench.offline import throughput

    out = {}
    for conc in (1, 8, 32, 64):
        with CompileLog() as cl:
            r = throughput(engine, conc, 1024, 256)
        out[conc] = {"output_tok_s": r["output_throughput"], "max_itl_ms": r["max_itl_ms"],
                     "median_itl_ms": r["median_itl_ms"], "max_ttft_ms": r["max_ttft_ms"],
                     "dynamo_graphs": cl.dynamo_graphs, "triton": cl.events}
        log("compiles", conc, {k: v for k, v in out[conc].items() if k != "triton"})
        for e in cl.events:
            log(f"   {e['s']:6.2f} s  {e['kernel']}  {e['key'][:300]}")
    results["compiles"] = out


def ab_prenorm_part(engine, results: dict, rounds: int = 2) -> None:
    """The suite's 64-request run (1024 in, 256 out) and eager 1 x 256 prefill steps, alternating the
    hyper-connection mix of eager steps with and without the Triton combine + norm pass (without: the compiled
    combine, then the compiled mix, as before it). Decode graphs are the same in both (captured with the pass)."""
    from qwen4exp.bench.offline import throughput
    from qwen4exp.ops import triton_hc

    supported = triton_hc.prenorm_supported
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)

    def prefill_walls(seed):
        engine.async_scheduling, was = False, engine.async_scheduling
        walls = []
        for rnd in range(4):
            engine.add_request(f"ab{seed}-{rnd}", {"prompt_token_ids": random_prompts(1, 256, vocab, seed + rnd)[0]},
                               params)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            walls.append(round((time.perf_counter() - t0) * 1e3, 1))
            while engine.has_unfinished_requests():
                engine.step()
        engine.async_scheduling = was
        return walls

    out = {"pass": [], "no_pass": []}
    try:
        triton_hc.prenorm_supported = lambda *a: False
        run_requests(engine, random_prompts(64, 1024, vocab, seed=97), 2)  # compiles the separate combine and mix
        prefill_walls(500)
        for rnd in range(rounds):
            for mode in ("pass", "no_pass"):
                triton_hc.prenorm_supported = supported if mode == "pass" else (lambda *a: False)
                r = throughput(engine, 64, 1024, 256)
                row = {"output_tok_s": r["output_throughput"], "duration_s": r["duration_s"],
                       "max_ttft_ms": r["max_ttft_ms"], "prefill_1x256_walls_ms": prefill_walls(600 + 10 * rnd)}
                out[mode].append(row)
                log("ab_prenorm", mode, row)
    finally:
        triton_hc.prenorm_supported = supported
    results["ab_prenorm"] = out


def gc_freeze_part(engine, results: dict, rounds: int = 3) -> None:
    """Batch-1 decode (128 in, 128 out) alternating without and with gc.freeze() (vLLM freezes the objects alive
    after startup, so the collector stops scanning them during steps)."""
    import gc

    vocab = engine.model_config.vocab_size
    prompt = random_prompts(1, 128, vocab, seed=3)
    run_requests(engine, prompt, 128)
    tpot = {"plain": [], "frozen": []}
    for _ in range(rounds):
        for mode in ("plain", "frozen"):
            if mode == "frozen":
                gc.freeze()
            r = run_requests(engine, prompt, 128)
            gc.unfreeze()
            tpot[mode].append(r["median_tpot_ms"])
    results["gc_freeze_b1_tpot_ms"] = tpot
    log("gc.freeze", tpot)


def add_small_step(engine, tag: str, seed: int) -> None:
    """Queues what makes the next engine step one of two small eager shapes: "prefill_1x256" (one 256-token prompt)
    or "mixed_63d_218p" (63 running decodes + one 218-token prompt: the 64-request run's last prefill step)."""
    vocab = engine.model_config.vocab_size
    if tag == "mixed_63d_218p":
        for i, p in enumerate(random_prompts(63, 8, vocab, seed=seed)):
            engine.add_request(f"{tag}-{seed}-{i}", {"prompt_token_ids": p},
                               SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False))
        for _ in range(3):
            engine.step()
    n = 218 if tag == "mixed_63d_218p" else 256
    engine.add_request(f"{tag}-{seed}", {"prompt_token_ids": random_prompts(1, n, vocab, seed)[0]},
                       SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))


def host_modules_part(engine, results: dict, rounds: int = 3) -> None:
    """Where an eager step's host time goes: a 1 x 256 prefill step, and a mixed step of 63 decodes + one 218-token
    prompt (the shape of the 64-request run's last prefill step). Synchronous scheduling; host time per decoder
    block (forward hooks) and per op (wrappers around the `ops` functions the model calls), inclusive, measured with
    perf_counter and no syncs inside the forward, so it is launch and Python time. Then the CPU-side launch calls
    under the torch profiler, and launch microbenchmarks (empty Triton kernel, torch add, a compiled function)."""
    from qwen4exp import ops

    model = engine.runner.model
    cuda = engine.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    block_t = collections.defaultdict(float)
    op_t = collections.defaultdict(float)
    op_n = collections.Counter()
    recording = [False]

    handles = []

    def hooks(mod):
        name = type(mod).__name__
        start = {}
        handles.append(mod.register_forward_pre_hook(lambda m, a: start.__setitem__("t", time.perf_counter())))

        def post(m, a, out):
            if recording[0]:
                block_t[name] += time.perf_counter() - start["t"]
        handles.append(mod.register_forward_hook(post))

    wanted = ("GatedDeltaNet", "Attention", "SparseMoeBlock", "GatedResidual", "PLELayer", "DecoderLayer")
    for m in model.modules():
        if type(m).__name__ in wanted:
            hooks(m)
    patched = []
    for modname in ("linear", "conv", "gated_delta", "hyper_connection", "moe", "attention", "norm", "rotary",
                    "ngram"):
        mod = getattr(ops, modname)
        for fname in dir(mod):
            fn = getattr(mod, fname)
            if fname.startswith("_") or not callable(fn) or isinstance(fn, type) or \
                    getattr(fn, "__module__", None) != mod.__name__:
                continue

            def wrap(fn=fn, key=f"{modname}.{fname}"):
                def timed(*a, **k):
                    if not recording[0]:
                        return fn(*a, **k)
                    t0 = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        op_t[key] += time.perf_counter() - t0
                        op_n[key] += 1
                timed.eager = getattr(fn, "eager", fn)
                return timed
            patched.append((mod, fname, fn))
            setattr(mod, fname, wrap())
    forward = model.forward
    fwd_t = []

    def timed_forward(*a, **k):
        t0 = time.perf_counter()
        out = forward(*a, **k)
        if recording[0]:
            fwd_t.append(time.perf_counter() - t0)
        return out
    model.forward = timed_forward
    engine.async_scheduling, was = False, engine.async_scheduling
    out = {}

    def one_step(tag, rnd, prof=None):
        sync()
        recording[0] = rnd > 0
        t0 = time.perf_counter()
        if prof is not None:
            with prof:
                engine.step()
                sync()
        else:
            engine.step()
            sync()
        wall = time.perf_counter() - t0
        recording[0] = False
        out.setdefault(tag, {"walls_ms": [], "forward_host_ms": []})
        out[tag]["walls_ms"].append(round(wall * 1e3, 1))
        if rnd > 0:
            out[tag]["forward_host_ms"].append(round(fwd_t[-1] * 1e3, 1))

    try:
        for tag in ("prefill_1x256", "mixed_63d_218p"):
            block_t.clear(), op_t.clear(), op_n.clear()
            for rnd in range(rounds + 1):  # round 0 unrecorded
                add_small_step(engine, tag, 70 + rnd)
                one_step(tag, rnd)
                while engine.has_unfinished_requests():
                    engine.step()
            out[tag]["blocks_ms_per_step"] = {k: round(v * 1e3 / rounds, 2) for k, v in
                                              sorted(block_t.items(), key=lambda kv: -kv[1])}
            out[tag]["ops_ms_per_step"] = {k: (round(v * 1e3 / rounds, 2), op_n[k] // rounds) for k, v in
                                           sorted(op_t.items(), key=lambda kv: -kv[1])}
            log("host_modules", tag, out[tag])
        # launch calls as the CUDA runtime / driver sees them, one 1 x 256 step
        from torch.profiler import ProfilerActivity, profile
        add_small_step(engine, "prefill_1x256", 99)
        prof = profile(activities=[ProfilerActivity.CPU])
        one_step("profiled_1x256", 0, prof)
        while engine.has_unfinished_requests():
            engine.step()
        launches = {}
        for e in prof.key_averages():
            if "Launch" in e.key or "launch" in e.key:
                launches[e.key] = (e.count, round(e.self_cpu_time_total / 1e3, 2))
        out["launch_calls_1x256"] = launches
        log("launch calls (count, self ms)", launches)
    finally:
        engine.async_scheduling = was
        model.forward = forward
        for h in handles:
            h.remove()
        for mod, fname, fn in patched:
            setattr(mod, fname, fn)

    results["host_modules"] = out
    if not cuda:
        return

    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    x = torch.zeros(1024, device="cuda")
    fn = ops.norm.rms_norm
    w = torch.ones(1024, device="cuda")
    micro = {}
    for name, call in (("triton_empty", lambda: _empty[(1,)](x, 1024, BLOCK=1024)),
                       ("torch_add", lambda: x.add_(1.0)),
                       ("compiled_rms_norm", lambda: fn(x[None], w, 1e-6))):
        for _ in range(50):
            call()
        sync()
        t0 = time.perf_counter()
        for _ in range(2000):
            call()
        micro[name + "_us"] = round((time.perf_counter() - t0) / 2000 * 1e6, 2)
        sync()
    out["launch_micro"] = micro
    log("launch micro", micro)
    results["host_modules"] = out


def small_step_walls(engine, seed: int, rounds: int = 3) -> dict:
    """Wall times (synchronous scheduling, synchronised) of the two small step shapes of `add_small_step`."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    engine.async_scheduling, was = False, engine.async_scheduling
    walls = {"prefill_1x256": [], "mixed_63d_218p": []}
    try:
        for rnd in range(rounds):
            for tag in walls:
                add_small_step(engine, tag, seed + rnd)
                sync()
                t0 = time.perf_counter()
                engine.step()
                sync()
                walls[tag].append(round((time.perf_counter() - t0) * 1e3, 1))
                while engine.has_unfinished_requests():
                    engine.step()
    finally:
        engine.async_scheduling = was
    return walls


def ab_mixed_part(engine, results: dict, rounds: int = 2) -> None:
    """The suite's 64-request run (1024 in, 256 out) and the small steps of `small_step_walls`, alternating with and
    without the mixed-step CUDA graphs (without: those steps run eagerly, as before them). One process."""
    from qwen4exp.bench.offline import throughput

    graphs = engine.runner.graphs
    if graphs is None or not graphs.mixed_sizes:
        log("ab_mixed: no mixed-step graphs in this engine")
        return
    sizes = graphs.mixed_sizes
    out = {"graphs": [], "eager": []}
    try:
        for rnd in range(rounds):
            for mode in ("graphs", "eager"):
                graphs.mixed_sizes = sizes if mode == "graphs" else []
                r = throughput(engine, 64, 1024, 256)
                row = {"output_tok_s": r["output_throughput"], "duration_s": r["duration_s"],
                       "max_ttft_ms": r["max_ttft_ms"], "median_itl_ms": r["median_itl_ms"],
                       "max_itl_ms": r["max_itl_ms"], "small_steps_ms": small_step_walls(engine, 700 + 10 * rnd)}
                out[mode].append(row)
                log("ab_mixed", mode, row)
    finally:
        graphs.mixed_sizes = sizes
    results["ab_mixed"] = out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--parts", default="decode,prefill,phases")
    ap.add_argument("--preset", default="flash-next-128e")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="the engine's step budget (the warm-up compiles up to it); phasesN runs with budget N")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("qwen4exp").setLevel(logging.INFO)
    os.makedirs(args.out, exist_ok=True)
    cfg = preset(args.preset)
    ecfg = EngineConfig(max_model_len=min(33 * 1024, cfg.max_position_embeddings), max_num_seqs=64,
                        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.92,
                        cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 48, 64], dtype="bfloat16", device=args.device,
                        load_format="dummy")
    t0 = time.perf_counter()
    engine = LLMEngine(None, ecfg, model_config=cfg, tokenizer=None)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    results = {"startup_s": time.perf_counter() - t0, "device": device_name}
    parts = args.parts.split(",")
    path = os.path.join(args.out, "step_profile.json")
    simple_parts = {"splits": splits_part, "syncs": syncs_part, "compiles": compiles_part, "gc": gc_freeze_part,
                    "ab_mixed": ab_mixed_part, "host_modules": host_modules_part, "ab_prenorm": ab_prenorm_part}
    for part in parts:
        if part == "decode":
            decode_part(engine, args.out, 1, results)
            decode_part(engine, args.out, 64, results)
        elif part == "prefill":
            prefill_part(engine, args.out, results)
        elif part == "phases":
            phases_part(engine, results)
        elif part.startswith("phases"):  # e.g. phases16384
            phases_part(engine, results, int(part[len("phases"):]))
        elif part == "prefill_batch":
            prefill_batch_part(engine, args.out, results)
        elif part.startswith("prefill_batch"):  # e.g. prefill_batch16: one step of 16 x 1k prompts
            prefill_batch_part(engine, args.out, results, n=int(part[len("prefill_batch"):]))
        elif part == "run_trace":
            run_trace_part(engine, args.out, results)
        elif part == "b1":  # the suite's batch-1 measurement
            from qwen4exp.bench.offline import latency

            r = latency(engine, 1, 128, 128)
            results["decode_b1"] = {k: r[k] for k in ("median_tpot_ms", "latencies_s")}
            log("b1", results["decode_b1"])
        elif part == "prefill_host":
            prefill_host_part(engine, results)
        elif part.startswith("prefill_host"):  # e.g. prefill_host1x128
            n, length = part[len("prefill_host"):].split("x")
            prefill_host_part(engine, results, int(n), int(length))
        elif part in simple_parts:
            simple_parts[part](engine, results)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
