"""The gated delta rule (qwen4exp/ops/gated_delta.py) as the model calls it (`gated_delta_rule_raw`, from the gate
projections b and a), at the model's GDN widths, against the torch reference.

  decode   one-token requests: the recurrent kernel with the gates computed inside it (CUDA graph). Each call
           updates its own copy of the states, as each layer has its own.
  prefill  whole prompts: eagerly fla's chunk kernel (without fla-core installed, the reference, with a warning);
           in a CUDA graph (mixed steps of up to 512 tokens) the recurrent kernel token by token.

    python benchmarks/kernels/bench_gated_delta.py [--tokens 1,64 (decode batch sizes)] [--json out.json]
"""

import torch

from qwen4exp.bench.kernels import Variant, reference, run
from qwen4exp.bench.timing import in_graph
from qwen4exp.ops import gated_delta


def inputs(bench, tokens: int):
    """q, k, v [T, H, D] as views of the conv's output and b, a [T, Hv] as views of the merged in_proj's output,
    as in the model; A_log and dt_bias (fp32, as the loader keeps them)."""
    w = bench.widths
    hk, hv, dk, dv = w.gdn_key_heads, w.gdn_value_heads, w.gdn_key_dim, w.gdn_value_dim
    qkv = bench.randn(tokens, w.conv_dim)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], -1)
    proj = bench.randn(tokens, w.conv_dim + hv * dv + 2 * hv)
    b, a = proj[:, w.conv_dim + hv * dv:].split([hv, hv], -1)
    A_log = torch.rand(hv, device=bench.device, generator=bench.generator) * 2.7  # decay rates 1 .. 15
    dt_bias = torch.randn(hv, device=bench.device, generator=bench.generator)
    return q.reshape(tokens, hk, dk), k.reshape(tokens, hk, dk), v.reshape(tokens, hv, dv), b, a, A_log, dt_bias


def measure(bench, case: str, requests: list[tuple[int, int]], graph: bool):
    w = bench.widths
    tokens = sum(n for n, _ in requests)
    meta, _ = bench.step(requests, graph=graph)
    q, k, v, b, a, A_log, dt_bias = inputs(bench, tokens)
    shape = (len(requests) + 1, w.gdn_value_heads, w.gdn_key_dim, w.gdn_value_dim)
    initial = bench.copies(lambda: torch.randn(shape, device=bench.device, generator=bench.generator) * 0.05,
                           4 * shape[0] * shape[1] * shape[2] * shape[3], w.gdn_layers)

    def op(states):
        return lambda: gated_delta.gated_delta_rule_raw(q, k, v, b, a, A_log, dt_bias, states.next(), meta)

    # every variant updates states of its own, from the same values
    bench.measure(case, tokens, [
        Variant("reference", reference(op(bench.rotation([s.clone() for s in initial])))),
        Variant("dispatched", op(bench.rotation([s.clone() for s in initial]))),
    ], calls=w.gdn_layers if tokens <= 512 else 4, graph=graph)


def main(bench):
    w = bench.widths
    heads = f"{w.gdn_key_heads} key / {w.gdn_value_heads} value heads of {w.gdn_key_dim} x {w.gdn_value_dim}"
    for batch in bench.tokens([1, 8, 64]):
        measure(bench, f"decode, {heads}, context 1000", [(1, 1000)] * batch, graph=in_graph(batch))
    # (requests, tokens each) of prefill steps from scratch
    for n, tokens in ((1, 8), (2, 8)) if bench.tiny else ((1, 512), (8, 1024), (1, 8192)):
        requests = [(tokens, 0)] * n
        if in_graph(n * tokens):
            measure(bench, f"prefill {n} x {tokens}, in a CUDA graph (recurrent kernel)", requests, graph=True)
        measure(bench, f"prefill {n} x {tokens}, eager (fla chunk)", requests, graph=False)

if __name__ == "__main__":
    run(main, __doc__, "gated_delta")
