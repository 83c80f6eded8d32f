"""One sampler call (qwen4exp/engine/sampler.py: `Sampler.sample(...).to_host()`, the ids on the host) on a batch
of logits at the model's vocabulary, by kind of request: greedy, temperature only, top-p, half greedy / half
sampled, and greedy with 5 logprobs. Host-synchronous, so never in a CUDA graph. A checksum of each kind's first
sampled ids is printed: equal checksums between two code trees mean the same tokens.

    python benchmarks/kernels/bench_sampler.py [--tokens 1,64 (batch sizes)] [--json out.json]
"""

import torch

from qwen4exp.bench.kernels import Variant, run
from qwen4exp.engine.request import Request, SamplingParams
from qwen4exp.engine.sampler import Sampler

KINDS = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "temperature": lambda i: SamplingParams(temperature=1.0),
    "top-p": lambda i: SamplingParams(temperature=0.8, top_p=0.9),
    "half greedy": lambda i: SamplingParams(temperature=0.0 if i % 2 else 1.0),
    "greedy + logprobs": lambda i: SamplingParams(temperature=0.0, logprobs=5),
}


def main(bench):
    vocab = bench.widths.vocab
    for batch in bench.tokens([1, 64]):
        # fp32, as the model's logits; spread like a trained model's (a few logits well above the rest)
        logits = torch.randn(batch, vocab, device=bench.device, generator=bench.generator) * 3
        variants, checksums = [], {}
        for kind, params in KINDS.items():
            requests = [Request(f"r{i}", [1], params(i)) for i in range(batch)]
            sampler = Sampler(bench.device, seed=3)

            def call(sampler=sampler, requests=requests, kind=kind):
                ids = sampler.sample(logits, requests, [[] for _ in requests]).to_host().token_ids
                # of the first call: the sampler's generator was just seeded
                checksums.setdefault(kind, sum((j + 1) * t for j, t in enumerate(ids)) % (1 << 61))
            variants.append(Variant(kind, call, graph=False))
        row = bench.measure(f"sampler, vocabulary {vocab}", batch, variants, calls=1, graph=False)
        row["checksums"] = checksums
        print(f"batch {batch}: checksums {checksums}", flush=True)


if __name__ == "__main__":
    run(main, __doc__, "sampler")
