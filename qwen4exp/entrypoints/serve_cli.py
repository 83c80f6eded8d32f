"""`qwen4exp serve MODEL`: the OpenAI-compatible server, with vLLM's flag names.

Also runs standalone: `python -m qwen4exp.entrypoints.serve_cli MODEL --port 8000`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..config import EngineConfig

_DEFAULTS = EngineConfig()


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name clients pass as `model` (default: the model path); the first one is used")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS.max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default, as vLLM's server: 8192 on GPUs of 70-160 GiB but A100s, 16384 "
                        "from 160 GiB, else 2048)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 503 when more requests than this would wait for a seat in the batch")
    p.add_argument("--page-size", type=int, default=_DEFAULTS.page_size)
    p.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS.gpu_memory_utilization)
    p.add_argument("--cpu-cache-bytes", type=int, default=_DEFAULTS.cpu_cache_bytes,
                   help="KV cache and state budget when running on the CPU")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--enforce-eager", action="store_true")
    add_async_scheduling_arg(p)
    add_ple_table_args(p)
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def add_async_scheduling_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous step's sampled ids are read, overlapping the host's "
                        "bookkeeping with the GPU (default: on for CUDA)")


def add_ple_table_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ple-table-device", default="auto", choices=["auto", "gpu", "cpu"],
                   help="where the PLE n-gram tables live: with the model on the GPU, or in page-locked host memory "
                        "read row by row (auto: the GPU when all weights leave 10%% of the memory budget free)")
    p.add_argument("--ple-table-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32", "fp8"],
                   help="n-gram table storage; fp8 is e4m3 with one scale per table (auto: the checkpoint's fp8, "
                        "else the model dtype)")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API",
                              description="Serve MODEL through an OpenAI-compatible HTTP API.")
    _add_serve_args(p)
    p.set_defaults(func=serve_main)
    return p


def serve_main(args: argparse.Namespace) -> None:
    from .server import run_server

    run_server(args)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="qwen4exp serve", description="Serve MODEL through an OpenAI-compatible API.")
    _add_serve_args(p)
    serve_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
