"""`qwen4exp` command line: make-random, generate, serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys


def _make_random(args) -> None:
    from ..weights.random_checkpoint import make_random

    make_random(args.dir, args.preset, dtype=args.dtype, seed=args.seed)
    print(f"wrote a random {args.preset} checkpoint to {args.dir}")


def _generate(args) -> None:
    from .. import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, seed=args.seed,
              load_format=args.load_format, ple_table_device=args.ple_table_device,
              ple_table_dtype=args.ple_table_dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompts = args.prompt or ["Hello"]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f"--- prompt: {prompt!r}")
        print(out.outputs[0].text)
        print(f"--- {len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}")


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
    g.add_argument("--model", required=True)
    g.add_argument("--prompt", action="append", help="may be given several times")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default=None)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.set_defaults(func=_generate)

    from .serve_cli import add_ple_table_args, add_serve_parser

    add_ple_table_args(g)

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
