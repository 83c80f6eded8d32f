"""Time one sampler call (`Sampler.sample(...).to_host()`) on a batch of logits: greedy, temperature-only, top-p and
a half-greedy mix, at the flash-next vocabulary. Prints the median of --rounds calls per kind and a checksum of the
sampled ids (equal checksums between two trees: the same tokens). To compare trees, run it once per tree:

    PYTHONPATH=TREE python bench/sampler.py [--device cuda] [--batch 64]
"""

import argparse
import json
import time

import torch

from qwen4exp.engine.request import Request, SamplingParams
from qwen4exp.engine.sampler import Sampler

KINDS = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature": lambda i: SamplingParams(temperature=1.0),
    "top_p": lambda i: SamplingParams(temperature=0.8, top_p=0.9),
    "half_greedy": lambda i: SamplingParams(temperature=0.0 if i % 2 else 1.0),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dev = torch.device(args.device)
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(dev)
    out = {}
    for kind, params in KINDS.items():
        requests = [Request(f"r{i}", [1], params(i)) for i in range(args.batch)]
        sampler = Sampler(dev, seed=3)
        times, checksum = [], 0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            ids = sampler.sample(logits, requests, [[] for _ in requests]).to_host().token_ids
            times.append((time.perf_counter() - t0) * 1e3)
            checksum = (checksum * 31 + sum(ids)) % (1 << 61)
        out[kind] = {"median_ms": sorted(times)[len(times) // 2], "checksum": checksum}
        print(f"{kind:>12}: {out[kind]['median_ms']:8.2f} ms  checksum {checksum}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
