"""Prometheus metrics of one engine, as vLLM 0.33 exports them: its names, help texts, bucket boundaries and labels
(`model_name`, the first served model name, and `engine`, always "0": one engine per server), in the engine's own
registry. Dashboards and alerts written for vLLM read them unchanged.

Per step the engine updates the gauges and the token counters and observes the per-token latencies; the per-request
histograms are observed once per finished sequence (aborted ones are not counted, as in vLLM). The request phases
come from the timestamps a Request carries (engine/request.py):

    arrival -> queued (the scheduler's queue) -> first scheduled -> first token -> last token (= finish)

queue = first scheduled - queued, prefill = first token - first scheduled, decode = last token - first token,
inference = last token - first scheduled, e2e = finish - arrival.

`vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` count the prompt tokens of the requests admitted with a
prefix cache lookup and those of them found cached (engine/prefix_cache.py); they stay 0 without prefix caching.

With speculative decoding, vLLM's `vllm:spec_decode_*` counters: verified requests with drafts (num_drafts), their
drafts (num_draft_tokens), the accepted ones (num_accepted_tokens) and those by draft position
(num_accepted_tokens_per_pos, label `position`). Acceptance rate = accepted / draft tokens; mean acceptance length =
1 + accepted / drafts.

`StatsLogger` is vLLM's periodic "Avg prompt throughput: ..." line, read from these metrics.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger("qwen4exp")

# vLLM's bucket families (vllm/v1/metrics/buckets.py)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                               20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# every finish reason vLLM labels request_success with, so each series exists from the start
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class EngineMetrics:
    """The metric families in `registry`, each bound to this engine's labels."""

    def __init__(self, model_name: str, max_model_len: int, cache_config_info: dict[str, str] | None = None,
                 num_speculative_tokens: int = 0):
        """num_speculative_tokens: with speculative decoding, vLLM's spec_decode counters (one per-position series
        per draft position)."""
        self.model_name = model_name
        self.labels = {"model_name": model_name, "engine": "0"}
        self.registry = r = CollectorRegistry()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name, doc):
            return Gauge(name, doc, names, registry=r).labels(*values)

        def counter(name, doc):
            return Counter(name, doc, names, registry=r).labels(*values)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*values)

        # scheduler state
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # counters
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=r)
        self.finished = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        # histograms of counts
        tokens = request_tokens_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               tokens)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", ITERATION_TOKENS_BUCKETS)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.request_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                          REQUEST_PARAMS_N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens)
        # histograms of timing intervals
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.spec_decode = None
        if num_speculative_tokens:
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              names + ["position"], registry=r)
            self.spec_decode = dict(
                num_drafts=counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                num_draft_tokens=counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                num_accepted_tokens=counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                per_pos=[per_pos.labels(*values, str(i)) for i in range(num_speculative_tokens)],
            )
        if cache_config_info is not None:
            # an info metric as vLLM writes it: a gauge at 1, labelled with the cache config (and no model_name)
            info = {**cache_config_info, "engine": "0"}
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
                  registry=r).labels(**info).set(1)

    def record_step(self, prompt_tokens: int, generation_tokens: int) -> None:
        """One completed step: the prompts whose first token it sampled and the tokens it generated."""
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
        self.iteration_tokens.observe(prompt_tokens + generation_tokens)

    def record_spec_decode(self, stats) -> None:
        """One step's speculative decoding counters (spec_decode.SpecDecodeStats)."""
        m = self.spec_decode
        m["num_drafts"].inc(stats.num_drafts)
        m["num_draft_tokens"].inc(stats.num_draft_tokens)
        m["num_accepted_tokens"].inc(stats.num_accepted_tokens)
        for counter, n in zip(m["per_pos"], stats.num_accepted_tokens_per_pos):
            counter.inc(n)

    def record_finished(self, req, now: float) -> None:
        """A sequence that finished (stop or length) at `now`; its timestamps are set (it has a token)."""
        self.finished[req.finish_reason].inc()
        self.e2e.observe(now - req.arrival_time)
        self.queue_time.observe(req.first_scheduled_time - req.queued_time)
        self.prefill_time.observe(req.first_token_time - req.first_scheduled_time)
        decode = req.last_token_time - req.first_token_time
        self.decode_time.observe(decode)
        self.inference_time.observe(req.last_token_time - req.first_scheduled_time)
        n = len(req.output_token_ids)
        self.tpot.observe(decode / (n - 1) if n > 1 else 0.0)
        self.request_prompt_tokens.observe(req.num_prompt_tokens)
        self.request_generation_tokens.observe(n)
        self.request_num_preemptions.observe(req.num_preemptions)
        self.request_params_max_tokens.observe(req.max_tokens)  # as vLLM: unset, the room max_model_len leaves

    def record_parent_finished(self, n: int, max_generation_tokens: int) -> None:
        """A client request whose n sequences all finished."""
        self.request_params_n.observe(n)
        self.request_max_num_generation_tokens.observe(max_generation_tokens)

    def spec_decode_totals(self) -> tuple[int, int, int, list[int]] | None:
        """(drafts, draft tokens, accepted tokens, accepted tokens per position) so far; None without speculation."""
        m = self.spec_decode
        if m is None:
            return None
        return (int(m["num_drafts"]._value.get()), int(m["num_draft_tokens"]._value.get()),
                int(m["num_accepted_tokens"]._value.get()), [int(c._value.get()) for c in m["per_pos"]])

    def total(self, name: str) -> float:
        """A sample's value, e.g. total("vllm:generation_tokens_total")."""
        return self.registry.get_sample_value(name, self.labels) or 0.0


class StatsLogger:
    """vLLM's periodic stats line: every `interval` seconds, the prompt and generation throughput since the last
    line, the running and waiting requests, preemptions (when there were some), the cache usage and, with prefix
    caching, the prefix cache hit rate (cached / queried prompt tokens since the metrics started); at DEBUG level
    while the engine stays idle. With speculative decoding, vLLM's "SpecDecoding metrics" line follows where the
    interval verified drafts. Called from the engine thread (AsyncEngine's loop), which owns `engine`."""

    def __init__(self, engine, interval: float = 10.0):
        self.engine, self.interval = engine, interval
        self.cache_device = "GPU" if engine.device.type == "cuda" else engine.device.type.upper()
        self._last_time = time.monotonic()
        self._last_metrics = None
        self._last_totals = (0.0, 0.0, 0.0)
        self._last_throughput = (0.0, 0.0)
        self._last_spec = None

    def maybe_log(self, now: float) -> None:
        if now - self._last_time >= self.interval:
            self.log(now)

    def log(self, now: float) -> None:
        metrics = self.engine.metrics
        totals = (metrics.total("vllm:prompt_tokens_total"), metrics.total("vllm:generation_tokens_total"),
                  metrics.total("vllm:num_preemptions_total"))
        if metrics is not self._last_metrics:  # reset (warm-up, a new served name): count from zero
            self._last_metrics, self._last_totals, self._last_spec = metrics, (0.0, 0.0, 0.0), None
        elapsed = max(now - self._last_time, 1e-9)
        prompt, generation, preemptions = (t - last for t, last in zip(totals, self._last_totals))
        throughput = (prompt / elapsed, generation / elapsed)
        idle = not any(throughput + self._last_throughput)
        self._last_time, self._last_totals, self._last_throughput = now, totals, throughput
        sched = self.engine.scheduler
        parts = ["Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
                 "Running: %d reqs", "Waiting: %d reqs"]
        args = [*throughput, len(sched.running), len(sched.waiting)]
        if preemptions > 0:
            parts.append("Preemptions: %d")
            args.append(preemptions)
        parts.append("%s KV cache usage: %.1f%%")
        args += [self.cache_device, self.engine.cache.usage * 100]
        if self.engine.cache.prefix is not None:
            queries = metrics.total("vllm:prefix_cache_queries_total")
            parts.append("Prefix cache hit rate: %.1f%%")
            args.append(100 * metrics.total("vllm:prefix_cache_hits_total") / queries if queries else 0.0)
        (logger.debug if idle else logger.info)(", ".join(parts), *args)
        spec = metrics.spec_decode_totals()
        if spec is not None:
            last = self._last_spec or (0, 0, 0, [0] * len(spec[3]))
            self._last_spec = spec
            drafts, drafted, accepted = (a - b for a, b in zip(spec[:3], last[:3]))
            if drafts:
                rates = ", ".join(f"{(a - b) / drafts:.3f}" for a, b in zip(spec[3], last[3]))
                logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                            1 + accepted / drafts, accepted / elapsed, drafted / elapsed, accepted, drafted, rates,
                            100 * accepted / drafted)
