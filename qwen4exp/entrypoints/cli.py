"""`qwen4exp` command line: make-random, generate, serve, bench. Also `python -m qwen4exp`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from .. import __version__
from ..bench.cli import add_bench_parser
from ..config import EngineConfig
from ..logger import configure_logging
from .default_model import add_model_option, resolve_model
from .protocol import DEFAULT_MAX_REQUEST_BODY_BYTES
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_PARSERS


def _make_random(args) -> None:
    from ..weights.random_checkpoint import make_random

    make_random(args.dir, args.preset, dtype=args.dtype, seed=args.seed, quantization=args.quantization,
                vision=args.vision, weights=not args.config_only)
    kind = (" fp8" if args.quantization else "") + (" vision-language" if args.vision else "")
    if args.config_only:
        print(f"wrote the{kind} {args.preset} config and tokenizer, without weights, to {args.dir} "
              "(run it with --load-format dummy)")
    else:
        print(f"wrote a random{kind} {args.preset} checkpoint to {args.dir}")


def _generate(args) -> None:
    from .. import LLM, SamplingParams

    config = EngineConfig.from_cli_args(args)  # bad options fail before a default model is built
    llm = LLM(resolve_model(args.model), **asdict(config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=config.seed)
    prompts = args.prompt or ["Hello"]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f"--- prompt: {prompt!r}")
        print(out.outputs[0].text)
        print(f"--- {len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (config.json, safetensors, tokenizer); without it, a random-weight "
                        "tiny model built once into $QWEN4EXP_CACHE_DIR (default ~/.cache/qwen4exp)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may pass as `model` (default: the model path); /v1/models lists them all and "
                        "responses carry the first")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health and /metrics")
    p.add_argument("--max-queued-requests", type=_non_negative_int, default=None,
                   help="answer 503 when more requests than this would wait for a seat in the batch")
    p.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="answer 413 to a larger request body (default: %(default)s)")
    p.add_argument("--chat-template", default=None,
                   help="the chat template: a file, or the template itself (default: the checkpoint's)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat template (`chat_template`, or `chat_template` in "
                        "`chat_template_kwargs`); without it they are refused with a 400")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="write logprob tokens as 'token_id:{id}' unless a request's return_tokens_as_token_ids says "
                        "otherwise")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report the prompt tokens found in the prefix cache as usage.prompt_tokens_details."
                        "cached_tokens (where there are some)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="answer every request with an X-Request-Id header: the request's own, else a random one")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse the model's tool calls when a request has tools and tool_choice \"auto\" (its "
                        "default with tools); needs --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (<tool_call> JSON, Qwen2.5/Qwen3), qwen3_coder "
                        "(<tool_call><function=...> XML, Qwen3-Coder); needed by tool_choice other than \"none\"")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave the tools out of the prompt of a request with tool_choice \"none\"")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the answer's reasoning (<think>...</think>) into message.reasoning: qwen3")
    p.add_argument("--renderer-num-workers", type=_positive_int, default=2,
                   help="processes that render chat templates and tokenize (default: %(default)s)")
    p.add_argument("--renderer-timeout", type=_positive_float, default=30.0,
                   help="seconds one request's template rendering or tokenization may take before its worker is "
                        "killed and the request gets a 400; also the limit on compiling a structured-output "
                        "request's grammar (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=_non_negative_int, default=0,
                   help="on SIGTERM or SIGINT, seconds in-flight requests may run on before they are aborted; "
                        "0 aborts them at once (default: %(default)s)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the stats line (throughput, running and waiting requests, KV cache usage) every "
                        "$QWEN4EXP_LOG_STATS_INTERVAL seconds (default 10) while requests run")
    EngineConfig.add_cli_args(p)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API",
                              description="Serve MODEL through an OpenAI-compatible HTTP API.")
    _add_serve_args(p)
    p.set_defaults(func=serve_main)
    return p


def serve_main(args: argparse.Namespace) -> None:
    from .server import run_server  # FastAPI and uvicorn are imported by `serve` only

    run_server(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwen4exp", description=__doc__)
    p.add_argument("-v", "--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)

    mr = sub.add_parser("make-random", help="write a random-weight checkpoint")
    mr.add_argument("dir")
    mr.add_argument("--preset", default="tiny", choices=["tiny", "small", "flash-next-128e", "flash-next"])
    mr.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    mr.add_argument("--seed", type=int, default=0)
    mr.add_argument("--quantization", default=None, choices=["fp8"],
                    help="write the released FP8 layout: projections and experts as block-scaled e4m3 with their "
                         "weight_scale_inv, the n-gram table in fp8 with its weight_scale")
    mr.add_argument("--vision", action="store_true",
                    help="the multimodal layout: a vision tower (model.visual.*, small for tiny and small, the "
                         "released widths otherwise), the text model under model.language_model.*, the vision "
                         "tokens and a preprocessor_config.json")
    mr.add_argument("--config-only", action="store_true",
                    help="everything but the weights (config, generation config, tokenizer), for engines that make "
                         "random ones in place: --load-format dummy")
    mr.set_defaults(func=_make_random)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_model_option(g)
    g.add_argument("--prompt", action="append", help="may be given several times")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    EngineConfig.add_cli_args(g)
    g.set_defaults(func=_generate)

    add_serve_parser(sub)
    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad options or inputs: one line naming the field, no traceback
        parser.exit(2, f"{parser.prog} {args.command}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
