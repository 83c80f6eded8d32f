"""Benchmarks with vLLM's metric names (TTFT, TPOT, ITL, E2E percentiles, output tok/s)."""
