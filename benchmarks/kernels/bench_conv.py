"""GDN's causal depthwise conv (qwen4exp/ops/conv.py) as the model calls it: the q, k, v channels of the merged
in_proj's output in, the three parts out, against the torch reference.

  decode   one-token requests: the update kernel (CUDA graph). Each call updates its own copy of the states.
  prefill  whole prompts: the varlen kernel (eager; in a CUDA graph for mixed steps of up to 512 tokens).

    python benchmarks/kernels/bench_conv.py [--tokens 1,64 (decode batch sizes)] [--json out.json]
"""

from qwen4exp.bench.kernels import Variant, reference, run
from qwen4exp.bench.timing import in_graph
from qwen4exp.ops import conv


def measure(bench, case: str, requests: list[tuple[int, int]], graph: bool):
    w = bench.widths
    C, K = w.conv_dim, w.conv_kernel
    key, value = w.gdn_key_heads * w.gdn_key_dim, w.gdn_value_width
    tokens = sum(n for n, _ in requests)
    meta, _ = bench.step(requests, graph=graph)
    x = bench.randn(tokens, C + value + 2 * w.gdn_value_heads)[:, :C]  # the merged in_proj's output, as a view
    weight = bench.randn(C, 1, K, scale=0.5)[:, 0, :]  # the Conv1d weight's [C, K] view
    shape = (len(requests) + 1, C, K - 1)
    initial = bench.copies(lambda: bench.randn(*shape), 2 * shape[0] * shape[1] * shape[2], w.gdn_layers)

    def op(states):
        return lambda: conv.causal_conv1d(x, weight, states.next(), meta, split=(key, key, value))

    bench.measure(case, tokens, [
        Variant("reference", reference(op(bench.rotation([s.clone() for s in initial])))),
        Variant("dispatched", op(bench.rotation([s.clone() for s in initial]))),
    ], calls=w.gdn_layers if tokens <= 512 else 8, graph=graph)


def main(bench):
    w = bench.widths
    for batch in bench.tokens([1, 8, 64]):
        measure(bench, f"decode, {w.conv_dim} channels, {w.conv_kernel} taps", [(1, 1000)] * batch,
                graph=in_graph(batch))
    for n, tokens in ((1, 8), (2, 8)) if bench.tiny else ((1, 512), (8, 1024), (1, 8192)):
        requests = [(tokens, 0)] * n
        if in_graph(n * tokens):
            measure(bench, f"prefill {n} x {tokens}, in a CUDA graph", requests, graph=True)
        measure(bench, f"prefill {n} x {tokens}, eager", requests, graph=False)


if __name__ == "__main__":
    run(main, __doc__, "conv")
