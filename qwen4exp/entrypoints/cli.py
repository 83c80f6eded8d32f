"""`qwen4exp` command line: make-random, generate, serve, bench. Also `python -m qwen4exp`."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import asdict

from ..config import EngineConfig

logger = logging.getLogger("qwen4exp")


def resolve_model(model: str | None) -> str:
    """`model`, or without one a random-weight `tiny` checkpoint, built on first use into $QWEN4EXP_CACHE_DIR
    (default ~/.cache/qwen4exp) and reused afterwards, so that `serve` and `generate` run on a fresh machine."""
    if model is not None:
        return model
    root = os.environ.get("QWEN4EXP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qwen4exp")
    path = os.path.join(root, "tiny-random")
    action = "using the"
    if not os.path.isdir(path):
        from ..weights.random_checkpoint import make_random

        os.makedirs(root, exist_ok=True)
        # built beside its final place and renamed into it, so an interrupted build leaves no partial checkpoint
        tmp = tempfile.mkdtemp(prefix=".tiny-random-", dir=root)
        try:
            make_random(tmp, "tiny", dtype="float32")  # float32 runs on the CPU too
            os.rename(tmp, path)
            action = "built a"
        except OSError:
            if not os.path.isdir(path):  # else another process built it first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("no model given: %s random-weight tiny model in %s (its output is gibberish); pass a checkpoint "
                "directory (`qwen4exp serve MODEL`, `qwen4exp generate --model MODEL`) to run a real one", action, path)
    return path


def _make_random(args) -> None:
    from ..weights.random_checkpoint import make_random

    make_random(args.dir, args.preset, dtype=args.dtype, seed=args.seed)
    print(f"wrote a random {args.preset} checkpoint to {args.dir}")


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


def add_model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: a random-weight tiny model, built once into "
                        "$QWEN4EXP_CACHE_DIR, default ~/.cache/qwen4exp)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qwen4exp", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    mr = sub.add_parser("make-random", help="write a random-weight checkpoint")
    mr.add_argument("dir")
    mr.add_argument("--preset", default="tiny", choices=["tiny", "small", "flash-next-128e", "flash-next"])
    mr.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    mr.add_argument("--seed", type=int, default=0)
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

    from .serve_cli import add_serve_parser

    add_serve_parser(sub)
    from ..bench.cli import add_bench_parser

    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad options or inputs: one line naming the field, no traceback
        parser.exit(2, f"{parser.prog} {args.command}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
