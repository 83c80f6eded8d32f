"""Benchmarks with vLLM's metric names (TTFT, TPOT, ITL, E2E percentiles, output tok/s): `qwen4exp bench
latency|throughput|serve` (cli.py, offline.py, serving.py), the suite behind docs/benchmarks.md (`qwen4exp bench
suite`: suite.py, report.py, agreement.py, train_small.py, roofline.py), and the helpers of the kernel benchmarks
in benchmarks/kernels (kernels.py, timing.py)."""
