"""`qwen4exp bench latency|throughput|serve` (vLLM's flag and metric names; results as JSON) and `qwen4exp bench
suite` (the figures of docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json

from ..config import EngineConfig
from ..entrypoints.default_model import add_model_option, resolve_model
from . import suite


def _engine(args):
    from ..engine.engine import LLMEngine

    config = EngineConfig.from_cli_args(args)
    return LLMEngine(resolve_model(args.model), config)


def _emit(args, result: dict) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)


def _latency(args) -> None:
    from .offline import latency

    _emit(args, latency(_engine(args), args.batch_size, args.input_len, args.output_len, args.num_iters))


def _throughput(args) -> None:
    from .offline import throughput

    _emit(args, throughput(_engine(args), args.num_prompts, args.input_len, args.output_len,
                           args.structured_fraction))


def _serve(args) -> None:
    from .serving import run

    _emit(args, run(args.base_url, args.model, args.num_prompts, args.input_len, args.output_len,
                    args.max_concurrency, args.request_rate))


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for name, fn in (("latency", _latency), ("throughput", _throughput)):
        p = bench.add_parser(name)
        add_model_option(p)
        p.add_argument("--input-len", type=int, default=32)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--output-json", default=None)
        if name == "latency":
            p.add_argument("--batch-size", type=int, default=1)
            p.add_argument("--num-iters", type=int, default=3)
        else:
            p.add_argument("--num-prompts", type=int, default=64)
            p.add_argument("--structured-fraction", type=float, default=0.0,
                           help="the share of requests that generate under a grammar (structured output), spread "
                                "evenly over the batch (default: %(default)s)")
        EngineConfig.add_cli_args(p)
        p.set_defaults(func=fn)
    p = bench.add_parser("serve", help="load test a running server (OpenAI completions API)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=_serve)
    p = bench.add_parser("suite", help="the H200 suite behind docs/benchmarks.md: qwen4exp (and transformers on the "
                                       "same weights) on flash-next-128e random weights; results JSON, page and plot",
                         description=suite.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    suite.add_suite_arguments(p)
    p.set_defaults(func=suite.run)
