"""`qwen4exp bench latency|throughput|serve` (vLLM's flag and metric names; results as JSON), `qwen4exp bench
multi-turn` (prefix caching on a chat workload, on and off) and `qwen4exp bench suite` (the figures of
docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os

from ..config import EngineConfig
from ..entrypoints.default_model import add_model_option, resolve_model
from . import suite
from .serving import PERCENTILE_METRICS


def _engine(args):
    from ..engine.engine import LLMEngine

    config = EngineConfig.from_cli_args(args)
    return LLMEngine(resolve_model(args.model), config)


def _emit(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


def _latency(args) -> None:
    from .offline import latency

    result = latency(_engine(args), args.batch_size, args.input_len, args.output_len, args.num_iters)
    _emit({"model_id": args.model} | result, args.output_json)


def _throughput(args) -> None:
    from .offline import throughput

    result = throughput(_engine(args), args.num_prompts, args.input_len, args.output_len, args.structured_fraction)
    _emit({"model_id": args.model} | result, args.output_json)


def _multi_turn(args) -> None:
    from .multi_turn import multi_turn

    result = multi_turn(_engine(args), args.num_conversations, args.num_turns, args.system_len, args.turn_len,
                        args.output_len)
    _emit({"model_id": args.model} | result, args.output_json)


def _serve(args) -> None:
    from .serving import run

    metrics = args.percentile_metrics.split(",")
    unknown = sorted(set(metrics) - set(PERCENTILE_METRICS))
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)} (choose from "
                         f"{', '.join(PERCENTILE_METRICS)})")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        percentiles = []
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles: expected numbers in [0, 100] separated by commas, got "
                         f"{args.metric_percentiles!r}")
    url = args.base_url or f"http://{args.host}:{args.port}"
    result = run(url, args.model, args.num_prompts, args.input_len, args.output_len, args.max_concurrency,
                 args.request_rate, metrics, percentiles, save_detailed=args.save_detailed)
    _emit(result, args.output_json or _result_file(args, result))


def _result_file(args, result: dict) -> str | None:
    """vLLM's: --result-filename, else openai-{rate}qps[-concurrency{N}]-{model}-{date}.json; in --result-dir."""
    if not (args.save_result or args.result_filename or args.result_dir):
        return None
    name = args.result_filename or (f"openai-{args.request_rate}qps-concurrency{args.max_concurrency}-"
                                    f"{result['model_id'].rstrip('/').split('/')[-1]}-{result['date']}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


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
    p = bench.add_parser("multi-turn", help="conversations on a shared system prompt, turn after turn, with the prefix "
                                            "cache on and off in one process: TTFT and duration per turn")
    add_model_option(p)
    p.add_argument("--num-conversations", type=int, default=16)
    p.add_argument("--num-turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=2000, help="tokens of the shared system prompt")
    p.add_argument("--turn-len", type=int, default=200, help="tokens of each user message")
    p.add_argument("--output-len", type=int, default=200, help="tokens of each reply")
    p.add_argument("--output-json", default=None)
    EngineConfig.add_cli_args(p)
    p.set_defaults(func=_multi_turn)
    p = bench.add_parser("serve", help="load test a running server (OpenAI completions API)")
    p.add_argument("--base-url", default=None, help="the server's URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS),
                   help="metrics whose mean, median, std and percentiles are reported (default: %(default)s)")
    p.add_argument("--metric-percentiles", default="99",
                   help="percentiles of those metrics, e.g. 25,50,75 (default: %(default)s)")
    p.add_argument("--save-result", action="store_true", help="write the results JSON (see --result-filename)")
    p.add_argument("--save-detailed", action="store_true",
                   help="add the per-request lists: input_lens, output_lens, ttfts, itls, latencies, "
                        "generated_texts, errors")
    p.add_argument("--result-dir", default=None, help="directory of the results JSON (implies --save-result)")
    p.add_argument("--result-filename", default=None,
                   help="name of the results JSON (default: openai-{request_rate}qps-concurrency{max_concurrency}-"
                        "{model}-{date}.json)")
    p.add_argument("--output-json", default=None, help="path of the results JSON (instead of the above)")
    p.set_defaults(func=_serve)
    p = bench.add_parser("suite", help="the H200 suite behind docs/benchmarks.md: qwen4exp (and transformers on the "
                                       "same weights) on flash-next-128e random weights; results JSON, page and plot",
                         description=suite.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    suite.add_suite_arguments(p)
    p.set_defaults(func=suite.run)
