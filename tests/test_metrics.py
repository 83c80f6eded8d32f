"""The engine's Prometheus metrics (vLLM's names, buckets and labels) and the periodic stats line, checked against
what the requests did: token counts equal the outputs, one histogram sample per finished sequence, the request
phases add up, preemptions and n > 1 counted as vLLM counts them."""

import asyncio
import logging
import re
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qwen4exp import LLM, SamplingParams
from qwen4exp.engine.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    StatsLogger,
    request_tokens_buckets,
)
from qwen4exp.entrypoints.async_engine import AsyncEngine
from qwen4exp.weights.random_checkpoint import make_random

MAX_LEN = 256


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=2)


def make_llm(tiny_dir, **kw) -> LLM:
    args = dict(max_model_len=MAX_LEN, num_pages=64, page_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    return LLM(tiny_dir, dtype="float32", device="cpu", **(args | kw))


def samples(engine) -> dict:
    """{(name, frozenset(labels)): value} of the engine's exposition, parsed as Prometheus parses it."""
    text = generate_latest(engine.metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(engine, name: str, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, engine.metrics.labels | labels)


def bucket_bounds(engine, name: str) -> list[float]:
    return sorted(float(dict(labels)["le"]) for (n, labels) in samples(engine) if n == f"{name}_bucket"
                  if dict(labels)["le"] != "+Inf")


def test_names_labels_and_buckets_are_vllms(tiny_dir):
    engine = make_llm(tiny_dir).llm_engine
    got = samples(engine)
    names = {n for n, _ in got}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:request_success_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:cache_config_info"):
        assert name in names, name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_params_n", "request_max_num_generation_tokens",
                 "iteration_tokens_total", "request_num_preemptions"):
        assert {f"vllm:{name}_bucket", f"vllm:{name}_sum", f"vllm:{name}_count"} <= names, name
    assert not any(n.startswith("qwen4exp:") for n in names)
    model = {("model_name", tiny_dir), ("engine", "0")}
    for (name, labels) in got:
        if name == "vllm:cache_config_info":  # vLLM's info metric: the cache config and the engine, no model name
            assert "model_name" not in dict(labels) and ("engine", "0") in labels
            assert dict(labels)["block_size"] == "8" and dict(labels)["enable_prefix_caching"] == "True"
            assert dict(labels)["num_gpu_blocks"] == str(engine.cache.pages.num_usable)
        else:
            assert model <= labels, (name, labels)
    assert {dict(labels)["finished_reason"] for (n, labels) in got if n == "vllm:request_success_total"} == {
        "stop", "length", "abort", "error", "repetition"}
    assert bucket_bounds(engine, "vllm:time_to_first_token_seconds") == list(TIME_TO_FIRST_TOKEN_BUCKETS)
    assert bucket_bounds(engine, "vllm:inter_token_latency_seconds") == list(INTER_TOKEN_LATENCY_BUCKETS)
    assert bucket_bounds(engine, "vllm:e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert bucket_bounds(engine, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200]
    assert bucket_bounds(engine, "vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                                                    4096, 8192, 16384]
    assert request_tokens_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert value(engine, "vllm:prefix_cache_queries_total") == 0 and value(engine, "vllm:prefix_cache_hits_total") == 0


def test_values_follow_the_requests(tiny_dir):
    engine = make_llm(tiny_dir).llm_engine
    prompts = [[5 + i for i in range(n)] for n in (3, 40, 90)]  # 90 tokens: two chunks of the 64-token budget
    for i, (prompt, max_tokens) in enumerate(zip(prompts, (1, 6, 11))):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    outs, steps = [], 0
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        steps += 1
    prompt_tokens = sum(len(p) for p in prompts)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == 1 + 6 + 11
    assert value(engine, "vllm:prompt_tokens_total") == prompt_tokens
    assert value(engine, "vllm:generation_tokens_total") == generated
    # vLLM's tokens per engine step: the prompts a step completed and the tokens it generated; one sample a step
    assert value(engine, "vllm:iteration_tokens_total_sum") == prompt_tokens + generated
    assert value(engine, "vllm:iteration_tokens_total_count") == steps
    assert value(engine, "vllm:request_success_total", finished_reason="length") == 3
    assert value(engine, "vllm:request_success_total", finished_reason="stop") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_params_n", "request_max_num_generation_tokens",
                 "request_num_preemptions"):
        assert value(engine, f"vllm:{name}_count") == 3, name
    assert value(engine, "vllm:inter_token_latency_seconds_count") == generated - 3  # all tokens but the first
    assert value(engine, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(engine, "vllm:request_generation_tokens_sum") == generated
    assert value(engine, "vllm:request_params_max_tokens_sum") == 1 + 6 + 11
    assert value(engine, "vllm:request_params_n_sum") == 3
    assert value(engine, "vllm:request_prompt_tokens_bucket", le="50.0") == 2  # 3 and 40 tokens, not 90
    # the phases: inference = prefill + decode, and queue + inference fit in the end-to-end latency
    prefill, decode = value(engine, "vllm:request_prefill_time_seconds_sum"), value(
        engine, "vllm:request_decode_time_seconds_sum")
    inference = value(engine, "vllm:request_inference_time_seconds_sum")
    assert inference == pytest.approx(prefill + decode, rel=1e-9, abs=1e-9) and decode > 0
    assert value(engine, "vllm:request_queue_time_seconds_sum") + inference <= value(
        engine, "vllm:e2e_request_latency_seconds_sum")
    assert value(engine, "vllm:num_requests_running") == 0 and value(engine, "vllm:kv_cache_usage_perc") == 0


def test_request_timestamps_are_set_where_the_phases_begin(tiny_dir):
    engine = make_llm(tiny_dir, max_num_seqs=1).llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(2):
        engine.add_request(str(i), {"prompt_token_ids": [7, 8, 9]}, params)
    first, second = engine.scheduler.waiting
    assert first.arrival_time <= first.queued_time and first.first_scheduled_time is None
    engine.step()
    assert first.first_scheduled_time is not None and second.first_scheduled_time is None  # one seat
    assert first.first_token_time is not None
    while engine.has_unfinished_requests():
        engine.step()
    for req in (first, second):
        assert (req.arrival_time <= req.queued_time <= req.first_scheduled_time <= req.first_token_time
                <= req.last_token_time)
    assert second.first_scheduled_time >= first.last_token_time  # it waited for the seat


def test_preempted_sequences_count_their_prompt_once(tiny_dir):
    # too few pages for everyone: the newest running requests are preempted and recomputed
    llm = make_llm(tiny_dir, max_model_len=32, num_pages=7, max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.llm_engine
    prompts = [[3 + (7 * i + j) % 300 for j in range(12)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    preemptions = value(engine, "vllm:num_preemptions_total")
    assert preemptions > 0, "the test must exercise preemption"
    assert preemptions == sum(o.metrics["num_preemptions"] for o in outs)
    assert value(engine, "vllm:request_num_preemptions_sum") == preemptions
    assert value(engine, "vllm:prompt_tokens_total") == 4 * 12
    assert value(engine, "vllm:generation_tokens_total") == 4 * 12
    assert value(engine, "vllm:iteration_tokens_total_sum") == 4 * 12 + 4 * 12


def test_n_sequences_are_counted_each_and_the_parameters_once(tiny_dir):
    llm = make_llm(tiny_dir)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": [4, 5, 6, 7]}], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5,
                                                                      ignore_eos=True), use_tqdm=False)
    assert value(engine, "vllm:request_success_total", finished_reason="length") == 3
    assert value(engine, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(engine, "vllm:prompt_tokens_total") == 3 * 4  # each sequence computes the prompt
    assert value(engine, "vllm:request_params_n_count") == 1 and value(engine, "vllm:request_params_n_sum") == 3
    assert value(engine, "vllm:request_max_num_generation_tokens_sum") == 5


def test_warm_up_reset_and_a_new_served_name_start_from_zero(tiny_dir):
    llm = make_llm(tiny_dir)
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": [4, 5, 6]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert value(engine, "vllm:generation_tokens_total") > 0
    engine.reset_metrics("served-name")
    assert engine.metrics.labels == {"model_name": "served-name", "engine": "0"}
    assert value(engine, "vllm:generation_tokens_total") == 0


STATS_LINE = re.compile(r"^Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d tokens/s, "
                        r"Running: (\d+) reqs, Waiting: (\d+) reqs, CPU KV cache usage: \d+\.\d%, "
                        r"Prefix cache hit rate: \d+\.\d%$")


def test_stats_line_reports_the_interval_and_goes_quiet_when_idle(tiny_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="qwen4exp")
    llm = make_llm(tiny_dir)
    engine = llm.llm_engine
    stats = StatsLogger(engine, interval=10.0)
    start = time.monotonic()
    llm.generate([{"prompt_token_ids": [4, 5, 6, 7]}], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    caplog.clear()
    stats.maybe_log(start + 5.0)
    assert not caplog.records  # not yet: every 10 s
    caplog.clear()
    stats.log(start + 10.0)  # 4 prompt and 8 generated tokens in 10 s
    (record,) = caplog.records
    assert record.levelno == logging.INFO and STATS_LINE.match(record.getMessage())
    assert "Avg prompt throughput: 0.4 tokens/s, Avg generation throughput: 0.8 tokens/s" in record.getMessage()
    caplog.clear()
    stats.log(start + 20.0)  # nothing new, but the last interval had work
    assert caplog.records[-1].levelno == logging.INFO
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s" in caplog.text
    caplog.clear()
    stats.log(start + 30.0)  # idle twice: DEBUG, as vLLM
    assert caplog.records[-1].levelno == logging.DEBUG


def test_serving_loop_logs_the_stats_line_while_requests_run(tiny_dir, caplog):
    caplog.set_level(logging.INFO, logger="qwen4exp")
    engine = make_llm(tiny_dir).llm_engine
    async_engine = AsyncEngine(engine, log_stats=True, log_stats_interval=0.05).start()
    try:
        async def run():
            async for out in async_engine.generate({"prompt_token_ids": [4, 5, 6]},
                                                   SamplingParams(max_tokens=40, ignore_eos=True), "r"):
                last = out
            return last

        assert asyncio.run(run()).finished
        deadline = time.monotonic() + 10
        while not any(STATS_LINE.match(r.getMessage()) for r in caplog.records):
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
    finally:
        async_engine.shutdown()
