"""`qwen4exp bench multi-turn`: a chat workload for prefix caching, run with and without it in one process.

Conversations share a system prompt; each turn appends a user message to every conversation and generates a reply,
all conversations at once, and the next turn's prompt is the conversation so far (replies included). The same
conversations run twice on one engine, with the prefix cache on (emptied first) and with it off, and the result
gives each turn's median time to first token and duration both ways, the tokens found cached, and the single-request
decode speed both ways (prefix caching must leave decode steps unchanged).
"""

from __future__ import annotations

import random
import time

import numpy as np

from ..engine.request import SamplingParams
from .offline import _sync, latency


def _conversations(engine, system: list[int], messages: list[list[list[int]]], output_len: int) -> list[dict]:
    """Runs every turn of every conversation; per turn: median and max TTFT (ms), duration (s), prompt and cached
    tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    history = [list(system) for _ in messages]
    turns = []
    for turn in range(len(messages[0])):
        _sync(engine)
        t0 = time.perf_counter()
        first, cached, prompt_tokens = {}, 0, 0
        for i, conv in enumerate(messages):
            history[i] += conv[turn]
            prompt_tokens += len(history[i])
            engine.add_request(f"conv-{i}-{turn}-{t0}", {"prompt_token_ids": list(history[i])}, params)
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                first.setdefault(out.request_id, now)
                if out.finished:
                    i = int(out.request_id.split("-")[1])
                    history[i] += out.outputs[0].token_ids
                    cached += out.num_cached_tokens
        ttfts = [1000 * (t - t0) for t in first.values()]
        turns.append({"turn": turn + 1, "median_ttft_ms": float(np.median(ttfts)), "max_ttft_ms": max(ttfts),
                      "duration_s": time.perf_counter() - t0, "prompt_tokens": prompt_tokens,
                      "cached_tokens": cached})
    return turns


def multi_turn(engine, num_conversations: int = 16, num_turns: int = 8, system_len: int = 2000, turn_len: int = 200,
               output_len: int = 200, decode_output_len: int = 128) -> dict:
    """The conversations with the prefix cache on, then off (see the module docstring); needs an engine built with
    prefix caching. `turn_len`: tokens of each user message."""
    prefix = engine.scheduler.prefix
    if prefix is None:
        raise ValueError("enable_prefix_caching: the multi-turn benchmark compares the prefix cache on and off, so "
                         "the engine needs it on (not with speculative decoding)")
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    system = [rng.randrange(10, vocab) for _ in range(system_len)]
    messages = [[[rng.randrange(10, vocab) for _ in range(turn_len)] for _ in range(num_turns)]
                for _ in range(num_conversations)]
    result = {"num_conversations": num_conversations, "num_turns": num_turns, "system_len": system_len,
              "turn_len": turn_len, "output_len": output_len}
    try:
        engine.reset_prefix_cache()
        result["cached"] = _conversations(engine, system, messages, output_len)
        result["decode_cached"] = latency(engine, 1, 32, decode_output_len)["decode_tok_s_per_request"]
        engine.scheduler.prefix = None
        result["uncached"] = _conversations(engine, system, messages, output_len)
        result["decode_uncached"] = latency(engine, 1, 32, decode_output_len)["decode_tok_s_per_request"]
    finally:
        engine.scheduler.prefix = prefix
    on, off = result["cached"][-1], result["uncached"][-1]
    result["last_turn_ttft_speedup"] = off["median_ttft_ms"] / on["median_ttft_ms"]
    result["total_speedup"] = (sum(t["duration_s"] for t in result["uncached"])
                               / sum(t["duration_s"] for t in result["cached"]))
    result["hit_rate"] = (sum(t["cached_tokens"] for t in result["cached"])
                          / sum(t["prompt_tokens"] for t in result["cached"]))
    return result
