"""Prometheus metrics of one engine (own registry, vLLM's metric names under the `qwen4exp:` prefix)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("qwen4exp:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("qwen4exp:num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.cache_usage = Gauge("qwen4exp:kv_cache_usage_perc", "Fraction of KV cache pages in use.", registry=r)
        self.prompt_tokens = Counter("qwen4exp:prompt_tokens", "Prefill tokens processed.", registry=r)
        self.generation_tokens = Counter("qwen4exp:generation_tokens", "Tokens generated.", registry=r)
        self.preemptions = Counter("qwen4exp:num_preemptions", "Requests preempted.", registry=r)
        self.finished = Counter("qwen4exp:request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.ttft = Histogram("qwen4exp:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("qwen4exp:inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("qwen4exp:e2e_request_latency_seconds", "Request latency.", buckets=_LATENCY_BUCKETS,
                             registry=r)
