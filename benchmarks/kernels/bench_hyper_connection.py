"""The hyper-connection mix (qwen4exp/ops/hyper_connection.py) as the model calls it: the pending combine of the
previous block's output, the per-stream norm, the low-rank gate and the stream mean, two mixes a layer.

Variants: the compiled reference (the combine, then `hc_mix_ref`); the dispatch; the one-token Triton kernels
(`hc_mix_decode`, tuning.HC_DECODE_MAX_TOKENS moved up); the norm pass with the down projection through cuBLAS
(tuning.PARTIALS_MAX_TOKENS moved down) and as tuning.DOWN_SPLITS fp32 partial products (moved up). Each call reads
its own copy of the mix's weights. --sweep adds the decode kernels at other tiles than the defaults (rows of
W_down_inject a down program, the columns of its K chunk, the hidden columns of an up program and the width of its
W_up tiles), up to 2 tokens.

    python benchmarks/kernels/bench_hyper_connection.py [--tokens 1,2,64] [--sweep] [--json out.json]
"""

import itertools

from qwen4exp.bench.kernels import NEVER, Variant, around, run, with_tuning
from qwen4exp.model.merged_linear import ROW_ALIGN
from qwen4exp.ops import hyper_connection as hc_ops
from qwen4exp.ops import tuning
from qwen4exp.ops._dispatch import HAS_TRITON

if HAS_TRITON:
    from qwen4exp.ops import hyper_connection_triton as hc_triton


def main(bench):
    w = bench.widths
    hc, hidden, rank = w.hc, w.hidden, w.hc_rank
    width = hc * hidden
    calls = 2 * w.layers
    rows = rank + hc + (-(rank + hc)) % ROW_ALIGN  # W_down then W_inject, padded as the model lays them out

    def weight_set():
        down_inject = bench.weight(rows, width)
        down_inject[rank + hc:] = 0
        return bench.randn(width, scale=0.1), down_inject, bench.weight(width, rank)
    weights = bench.rotation(bench.copies(weight_set, (rows * width + width * rank) * 2, calls))
    case = f"combine + mix, [T, {hc} x {hidden}] streams, rank {rank}, {calls} a step"
    tokens_list = around(tuning.HC_DECODE_MAX_TOKENS) + [4] + around(tuning.PARTIALS_MAX_TOKENS) + [8192]
    for tokens in bench.tokens(tokens_list):
        streams = bench.randn(tokens, width)
        block_out = bench.randn(tokens, hidden)
        inject = bench.randn(tokens, hc).abs()

        def op():
            norm, down_inject, up = weights.next()
            return hc_ops.hc_mix(streams, norm, down_inject, up, w.eps, hc, rank, True, block_out, inject)

        def ref():
            norm, down_inject, up = weights.next()
            combined = hc_ops.hc_combine(streams, block_out, inject)
            return (combined, *hc_ops.hc_mix_ref(combined, norm, down_inject, up, w.eps, hc, rank, True))

        variants = [Variant("reference", ref), Variant("dispatched", op)]
        if tokens <= 16:  # the decode kernels' cost grows with the tokens: they are for one
            variants.append(Variant("decode kernels", with_tuning(op, HC_DECODE_MAX_TOKENS=NEVER)))
        variants += [
            Variant("norm pass + GEMM", with_tuning(op, HC_DECODE_MAX_TOKENS=0, HC_DECODE_SMALL_MAX_TOKENS=0,
                                                       PARTIALS_MAX_TOKENS=0)),
            Variant(f"norm pass + {tuning.DOWN_SPLITS} partials",
                    with_tuning(op, HC_DECODE_MAX_TOKENS=0, HC_DECODE_SMALL_MAX_TOKENS=0, PARTIALS_MAX_TOKENS=NEVER)),
        ]
        if bench.args.sweep and HAS_TRITON and tokens <= 2:
            tiles = [(r, c, b, None) for r, c, b in itertools.product((8, 16, 32), (128, 256, 512), (2, 4, 8))]
            tiles += [(16, 512, b, k) for b, k in itertools.product((2, 4, 8), (64, 128))]
            for rows_, chunk, block_h, up_chunk in tiles:
                def tiled(r=rows_, c=chunk, b=block_h, k=up_chunk):
                    norm, down_inject, up = weights.next()
                    return hc_triton.hc_mix_decode(streams, norm, down_inject, up, w.eps, hc, rank, True, block_out,
                                                   inject, block_rows=r, chunk=c, block_h=b, up_chunk=k)
                variants.append(Variant(f"decode {rows_}r{chunk}c{block_h}h" + (f"{up_chunk}k" if up_chunk else ""),
                                        tiled))
        bench.measure(case, tokens, variants, calls=calls if tokens <= 512 else 8)


def arguments(p):
    p.add_argument("--sweep", action="store_true", help="also time the decode kernels at other tiles")


if __name__ == "__main__":
    run(main, __doc__, "hyper_connection", arguments=arguments)
