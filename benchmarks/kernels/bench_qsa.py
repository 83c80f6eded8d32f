"""QSA's block selection (qwen4exp/ops/qsa.py) at the model's indexer widths: every query scores the complete blocks
it sees and keeps the top budget / C of them plus its incomplete tail.

  block scores  the Triton kernel against its torch form (`qsa_block_scores_torch`), both reading the paged block
                keys in place.
  selection     the dispatch (`qsa_select`: scores, top-k and packing on the device, CUDA-graph capturable)
                against the torch reference (a loop over requests, eager: it reads positions on the host).

    python benchmarks/kernels/bench_qsa.py [--tokens 1,64 (decode batch sizes)] [--json out.json]
"""

from qwen4exp.bench.kernels import Variant, reference, run
from qwen4exp.bench.timing import in_graph
from qwen4exp.ops import qsa, qsa_triton


def measure(bench, what: str, requests: list[tuple[int, int]], graph: bool):
    w = bench.widths
    C = w.compress_ratio
    tokens = sum(n for n, _ in requests)
    meta, pages = bench.step(requests, graph=graph)
    # positive queries and keys: no block scores 0 (relu), so no ties, which either side may break its own way
    block_key = bench.randn(pages, 16 // C, w.index_dim).abs()
    index_q = bench.randn(tokens, w.index_heads, w.index_dim).abs()
    max_blocks = max(1, meta.max_seq_len // C)
    calls = w.attention_layers if tokens <= 512 else 4

    def scores(fn):
        return lambda: fn(index_q, block_key, meta.block_tables, meta.token_req, meta.token_pos, C, max_blocks)

    bench.measure(f"block scores, {what}", tokens, [
        Variant("torch", scores(qsa.qsa_block_scores_torch)),
        Variant("Triton", scores(qsa_triton.qsa_block_scores_triton)),
    ], calls=calls, graph=graph)

    def select():
        return qsa.qsa_select(index_q, block_key, meta, w.index_budget, C)

    # the same tokens, in another order
    bench.measure(f"selection, {what}", tokens, [
        # a loop over requests and visible-block counts: seconds a call for a long prompt
        Variant("reference", reference(select), graph=False, once=tokens > 512),
        Variant("dispatched", select),
    ], calls=calls, graph=graph, compare=lambda selected: selected.sort(-1).values)


def main(bench):
    w = bench.widths
    heads = f"{w.index_heads} heads of {w.index_dim}, budget {w.index_budget}, blocks of {w.compress_ratio}"
    context = 8 * w.index_budget if bench.tiny else 32768
    for batch in bench.tokens([1, 8, 64]):
        measure(bench, f"decode, {heads}, context {context}", [(1, context)] * batch, graph=in_graph(batch))
    prompt = 32 if bench.tiny else 8192
    measure(bench, f"prefill of one {prompt}-token prompt, {heads}", [(prompt, 0)], graph=False)


if __name__ == "__main__":
    run(main, __doc__, "qsa")
