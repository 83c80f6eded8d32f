"""Paged (sparse) gated-GQA attention (qwen4exp/ops/attention.py `paged_attention`) at the model's widths, against
the torch reference.

  decode   one query per request over its paged cache: dense (a context within the QSA budget) and over the QSA
           selection (a 32k context); the split-K kernel, in a CUDA graph.
  prefill  whole prompts, eager: the per-token split-K kernel and the flash-style prefill kernel, around
           tuning.PREFILL_ATTN_MIN_TOKENS (steps in CUDA graphs always take the split-K kernel).

Pages are shuffled over the cache, as a running engine leaves them.

    python benchmarks/kernels/bench_attention.py [--tokens 1,64 (decode batch sizes)] [--json out.json]
"""

from qwen4exp.bench.kernels import NEVER, Variant, around, reference, run, with_tuning
from qwen4exp.bench.timing import in_graph
from qwen4exp.ops import attention, qsa, tuning


def measure(bench, case: str, requests: list[tuple[int, int]], graph: bool, sparse: bool = False,
            prefill: bool = False):
    w = bench.widths
    tokens = sum(n for n, _ in requests)
    meta, pages = bench.step(requests, graph=graph)
    key = bench.randn(pages, 16, w.kv_heads, w.head_dim)
    value = bench.randn(pages, 16, w.kv_heads, w.head_dim)
    q = bench.randn(tokens, w.heads, w.head_dim)  # norm_rope's output
    selected = None
    if sparse:  # the indexer's choice for random queries and block keys
        block_key = bench.randn(pages, 16 // w.compress_ratio, w.index_dim)
        index_q = bench.randn(tokens, w.index_heads, w.index_dim)
        selected = qsa.qsa_select(index_q, block_key, meta, w.index_budget, w.compress_ratio)
    scale = w.head_dim ** -0.5

    def op():
        return attention.paged_attention(q, key, value, meta, scale, selected)

    variants = [Variant("reference", reference(op))] if tokens <= 2048 else []
    variants.append(Variant("dispatched", op))
    if prefill:
        variants += [Variant("split-K", with_tuning(op, PREFILL_ATTN_MIN_TOKENS=NEVER)),
                     Variant("prefill kernel", with_tuning(op, PREFILL_ATTN_MIN_TOKENS=0))]
    bench.measure(case, tokens, variants, calls=w.attention_layers if tokens <= 512 else 4, graph=graph)


def main(bench):
    w = bench.widths
    heads = f"{w.heads} query / {w.kv_heads} kv heads of {w.head_dim}"
    dense_context = w.index_budget  # every block is selected: the dense path
    sparse_context = 8 * w.index_budget if bench.tiny else 32768
    for batch in bench.tokens([1, 8, 64]):
        measure(bench, f"decode, {heads}, dense, context {dense_context}", [(1, dense_context)] * batch,
                graph=in_graph(batch))
        measure(bench, f"decode, {heads}, QSA selection of {w.index_budget}, context {sparse_context}",
                [(1, sparse_context)] * batch, graph=in_graph(batch), sparse=True)
    for tokens in [8] if bench.tiny else around(tuning.PREFILL_ATTN_MIN_TOKENS):
        measure(bench, f"prefill of one prompt, {heads}", [(tokens, 0)], graph=False, prefill=True)
    for n, tokens in ((2, 8),) if bench.tiny else ((8, 1024), (1, 8192)):
        measure(bench, f"prefill {n} x {tokens}, {heads}", [(tokens, 0)] * n, graph=False, prefill=True)


if __name__ == "__main__":
    run(main, __doc__, "attention")
