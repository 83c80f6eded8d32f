"""Host time of one engine step outside the model: scheduling, chunk building, sampling, bookkeeping and outputs.

    python bench/host_overhead.py [--requests 64] [--prompt 1024] [--output 256] [--vocab 512]

The model is replaced by a stub that returns random logits, so the figure is the Python bookkeeping every decode
step pays on the CPU around the GPU work (part of the 64-request H200 run's step wall time minus its kernel time).
The vocabulary is small by default: the sampler's tensor ops run on the CPU here and would otherwise dominate,
where on the GPU they are kernels. Prints the median ms per decode step over the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qwen4exp.config import EngineConfig, load_model_config  # noqa: E402
from qwen4exp.engine.engine import LLMEngine  # noqa: E402
from qwen4exp.engine.request import SamplingParams  # noqa: E402
from qwen4exp.weights.random_checkpoint import preset_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(preset_config("tiny"), f)
    cfg = load_model_config(d)
    engine = LLMEngine(None, EngineConfig(max_model_len=args.prompt + args.output + 16, max_num_seqs=args.requests,
                                          max_num_batched_tokens=8192, dtype="float32", device="cpu",
                                          load_format="dummy"),
                       model_config=cfg, tokenizer=None)
    logits = torch.randn(args.requests, args.vocab)

    def stub(chunks, pending_ids=None, *args):  # one logits row per wanted position, as the runner returns
        rows = sum(len(c.token_ids) - c.logits_from for c in chunks)
        return logits[:rows] if rows <= len(logits) else torch.randn(rows, args.vocab)

    engine.runner.execute = stub
    rng = random.Random(0)
    for i in range(args.requests):
        prompt = [rng.randrange(10, cfg.vocab_size) for _ in range(args.prompt)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True, detokenize=False))
    steps = []
    while engine.has_unfinished_requests():
        decode = not engine.scheduler.waiting and all(r.output_token_ids for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        if decode:
            steps.append(time.perf_counter() - t0)
    steps.sort()
    print(f"{len(steps)} decode steps of {args.requests} requests: median {steps[len(steps) // 2] * 1e3:.2f} ms "
          f"host time per step (vocab {args.vocab})")


if __name__ == "__main__":
    main()
