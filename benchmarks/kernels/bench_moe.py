"""The sparse MoE block's router and experts (qwen4exp/ops/moe.py) at the model's widths.

  router   softmax + top-k + renormalisation: the compiled reference against the dispatch (one Triton launch).
  experts  the routed experts with the gated shared expert, as the model calls them (`moe_experts`): the torch
           reference (a loop over experts, eager: it reads the expert ids on the host), the dispatch, and each
           tier forced: one program per (token, expert) pair (tuning.PAIRWISE_MAX_PAIRS), the sorted-pairs fused
           kernels, torch's grouped GEMM (tuning.GROUPED_MM_MIN_PAIRS); around both thresholds.

One layer's experts (all of them) are read per call: more than L2 holds, so they are not cycled.

    python benchmarks/kernels/bench_moe.py [--tokens 1,9,10,64] [--json out.json]
"""

import torch
import torch.nn.functional as F

from qwen4exp.bench.kernels import NEVER, Variant, around, run, with_tuning
from qwen4exp.ops import moe, tuning


def routing_ids(bench, tokens: int) -> torch.Tensor:
    """Each token's top-k distinct experts, uniformly at random (as random weights route)."""
    w = bench.widths
    scores = torch.rand(tokens, w.experts, device=bench.device, generator=bench.generator)
    return scores.argsort(-1)[:, :w.top_k]


def router(bench):
    w = bench.widths
    case = f"router, {w.experts} experts, top-{w.top_k}, {w.layers} a step"
    for tokens in bench.tokens([1, 64, 4096, 16384]):
        # distinct values, exact in bf16: which of two equal probabilities top-k takes is unspecified
        logits = (torch.rand(tokens, w.experts, device=bench.device, generator=bench.generator).argsort(-1)
                  / 16 - 3).to(bench.dtype)
        bench.measure(case, tokens, [
            Variant("reference", lambda: moe.route_ref(logits, w.top_k, True)),
            Variant("dispatched", lambda: moe.route(logits, w.top_k, True)),
        ], calls=w.layers)


def experts(bench):
    w = bench.widths
    H, inter, shared_inter = w.hidden, w.moe_inter, w.shared_inter
    gate_up = torch.stack([bench.weight(2 * inter, H) for _ in range(w.experts)])
    down = torch.stack([bench.weight(H, inter) for _ in range(w.experts)])
    shared_down = bench.weight(H, shared_inter)
    case = f"experts, {w.experts} x [{2 * inter}, {H}] + [{H}, {inter}], top-{w.top_k}, with the shared expert"
    pairwise_last = tuning.PAIRWISE_MAX_PAIRS // w.top_k
    tokens_list = [1] + around(tuning.PAIRWISE_MAX_PAIRS, w.top_k) + [64] + around(tuning.GROUPED_MM_MIN_PAIRS,
                                                                                     w.top_k) + [8192]
    for tokens in bench.tokens(tokens_list):
        x = bench.randn(tokens, H)
        ids = routing_ids(bench, tokens)
        weights = torch.softmax(bench.randn(tokens, w.top_k, dtype=torch.float32), -1).to(bench.dtype)
        shared_gate, shared_up = bench.randn(tokens, shared_inter), bench.randn(tokens, shared_inter)
        logit = bench.randn(tokens, 1)

        def op():
            return moe.moe_experts(x, gate_up, down, ids, weights, (shared_gate, shared_up, shared_down, logit))

        def ref():
            shared = F.linear(moe.silu_mul.eager(shared_gate, shared_up), shared_down)
            return moe.moe_block_ref(x, gate_up, down, ids, weights, (shared, logit))

        variants = [Variant("reference", ref, graph=False), Variant("dispatched", op)]
        if tokens <= 4 * pairwise_last:  # one program per pair re-reads shared experts: for small steps only
            variants.append(Variant("pairwise", with_tuning(op, PAIRWISE_MAX_PAIRS=NEVER, GROUPED_MM_MIN_PAIRS=NEVER)))
        variants.append(Variant("fused", with_tuning(op, PAIRWISE_MAX_PAIRS=0, GROUPED_MM_MIN_PAIRS=NEVER)))
        if tokens > pairwise_last and moe.grouped_mm_available(x):
            variants.append(Variant("grouped GEMM", with_tuning(op, PAIRWISE_MAX_PAIRS=0, GROUPED_MM_MIN_PAIRS=0)))
        bench.measure(case, tokens, variants, calls=w.layers if tokens <= 512 else 8)


def main(bench):
    router(bench)
    experts(bench)


if __name__ == "__main__":
    run(main, __doc__, "moe")
