"""`qwen4exp serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names.

Also runs standalone: `python -m qwen4exp.entrypoints.serve_cli MODEL --port 8000`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..config import EngineConfig


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (config.json, safetensors, tokenizer); without it, a random-weight "
                        "tiny model built once into $QWEN4EXP_CACHE_DIR (default ~/.cache/qwen4exp)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name clients pass as `model` (default: the model path); the first one is used")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--max-queued-requests", type=_non_negative_int, default=None,
                   help="answer 503 when more requests than this would wait for a seat in the batch")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    EngineConfig.add_cli_args(p)


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
