"""In-process benchmarks on an LLMEngine: latency (one batch, TPOT), throughput (many requests), prefill."""

from __future__ import annotations

import random
import time

import numpy as np
import torch

from ..engine.request import SamplingParams, StructuredOutputsParams
from .metrics import RequestTiming, summarize

# The grammar of the structured share of a throughput run: JSON records, one after another without end, so a
# constrained request generates as many tokens as a free one (and its strings take any character, the costly case
# for the bitmask, as JSON strings do).
BENCH_GRAMMAR = r"""root ::= record ",\n" root
record ::= "{\"id\": " [0-9]+ ", \"name\": " string ", \"tags\": [" (string ("," string)*)? "]}"
string ::= "\"" ([^"\\\n] | "\\" ["\\/nt])* "\""
"""


def _sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def spec_decode_stats(before, after) -> dict:
    """vLLM's `bench serve` speculative decoding keys between two `EngineMetrics.spec_decode_totals`: acceptance
    rate (percent of the draft tokens accepted), acceptance length (1 + accepted per draft), drafts, draft and
    accepted tokens, and the acceptance rate of each draft position."""
    drafts, tokens, accepted = (a - b for a, b in zip(after[:3], before[:3]))
    per_pos = [a - b for a, b in zip(after[3], before[3])]
    return {"spec_decode_acceptance_rate": 100.0 * accepted / tokens if tokens else 0.0,
            "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "spec_decode_num_drafts": drafts, "spec_decode_draft_tokens": tokens,
            "spec_decode_accepted_tokens": accepted,
            "spec_decode_per_position_acceptance_rates": [n / drafts if drafts else 0.0 for n in per_pos]}


def run_requests(engine, prompts: list[list[int]], output_len: int, structured_fraction: float = 0.0) -> dict:
    """Submit all prompts at once, step to completion, time every token (ignore_eos, fixed output length).
    `structured_fraction` of the requests, spread evenly, generate under BENCH_GRAMMAR. With speculative decoding,
    its acceptance (spec_decode_stats)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False,
                                 structured_outputs=StructuredOutputsParams(grammar=BENCH_GRAMMAR))
    timings: dict[str, RequestTiming] = {}
    # every run starts from an empty prefix cache, as a fresh server would: a repeated run of the same prompts (the
    # throughput runs) must not find them cached
    engine.reset_prefix_cache()
    spec_before = engine.metrics.spec_decode_totals()
    _sync(engine)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        rid = f"bench-{i}-{t0}"
        structured = int((i + 1) * structured_fraction) > int(i * structured_fraction)
        engine.add_request(rid, {"prompt_token_ids": p}, constrained if structured else params)
        timings[rid] = RequestTiming(arrival=t0, prompt_len=len(p))
    seen = {rid: 0 for rid in timings}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()  # step() returns after the sampled ids are on the host: the step is done
        for out in outs:
            n = len(out.outputs[0].token_ids)
            timings[out.request_id].token_times += [now] * (n - seen[out.request_id])
            seen[out.request_id] = n
    elapsed = time.perf_counter() - t0
    result = summarize(list(timings.values()), elapsed)
    if spec_before is not None:
        result |= spec_decode_stats(spec_before, engine.metrics.spec_decode_totals())
    return result


LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def latency(engine, batch_size: int, input_len: int, output_len: int, iters: int = 3) -> dict:
    """One batch's end-to-end run `iters` times (vLLM's `bench latency`): vLLM's avg_latency, latencies and
    percentiles (seconds), and the run of median latency's summary (TTFT, TPOT, ITL)."""
    vocab = engine.model_config.vocab_size
    run_requests(engine, random_prompts(batch_size, input_len, vocab, seed=99), min(output_len, 8))  # warm-up
    runs = [run_requests(engine, random_prompts(batch_size, input_len, vocab, seed=i), output_len)
            for i in range(iters)]
    latencies = [r["duration_s"] for r in runs]
    med = sorted(runs, key=lambda r: r["duration_s"])[len(runs) // 2]
    med |= {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
            "percentiles": {str(p): float(np.percentile(latencies, p)) for p in LATENCY_PERCENTILES}}
    med["decode_tok_s_per_request"] = 1000.0 / med["median_tpot_ms"] if med.get("median_tpot_ms") else None
    return med


def throughput(engine, num_prompts: int, input_len: int, output_len: int, structured_fraction: float = 0.0) -> dict:
    """`num_prompts` requests at once (vLLM's `bench throughput`): vLLM's elapsed_time, num_requests,
    total_num_tokens, requests_per_second and tokens_per_second (prompt and output tokens), and the run's summary.
    `structured_fraction`: the share of requests under a grammar (see run_requests)."""
    if not 0.0 <= structured_fraction <= 1.0:
        raise ValueError(f"structured_fraction: must be in [0, 1], got {structured_fraction}")
    vocab = engine.model_config.vocab_size
    # the warm-up also builds the grammar compiler and compiles the grammar when some requests are constrained
    run_requests(engine, random_prompts(min(num_prompts, 4), input_len, vocab, seed=98), 4,
                 1.0 if structured_fraction else 0.0)
    r = run_requests(engine, random_prompts(num_prompts, input_len, vocab, seed=7), output_len, structured_fraction)
    return r | {"elapsed_time": r["duration_s"], "num_requests": r["completed"],
                "total_num_tokens": r["total_input_tokens"] + r["total_output_tokens"],
                "requests_per_second": r["request_throughput"], "tokens_per_second": r["total_token_throughput"],
                "num_structured": sum(int((i + 1) * structured_fraction) > int(i * structured_fraction)
                                      for i in range(num_prompts))}


def prefill(engine, input_len: int, iters: int = 3) -> dict:
    """Time to first token of one prompt of input_len tokens (median of iters)."""
    vocab = engine.model_config.vocab_size
    times = []
    for i in range(iters + 1):
        r = run_requests(engine, random_prompts(1, input_len, vocab, seed=50 + i), 1)
        times.append(r["median_ttft_ms"] / 1000)
    times = sorted(times[1:])  # the first run compiles kernels
    med = times[len(times) // 2]
    return {"input_len": input_len, "ttft_s": med, "prefill_tok_s": input_len / med, "ttfts_s": times}


def teacher_forced(llm, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Under teacher forcing, at every prompt position after the first: the logprob of the actual next token and the
    top-1 token id (`llm` is a qwen4exp.LLM). For comparing two configurations of one model position by position."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=1),
                        use_tqdm=False)
    lps, top = [], []
    for o in outs:
        for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:]):
            lps.append(d[t].logprob)
            top.append(min(d, key=lambda k: d[k].rank))
    return torch.tensor(lps), torch.tensor(top)
