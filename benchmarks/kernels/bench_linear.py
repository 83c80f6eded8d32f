"""Projections (qwen4exp/ops/linear.py) at the model's widths: the decode GEMV and the output projections'
partial products.

  gemv       every projection the model runs through ops.linear (merged weights as laid out), cuBLAS (F.linear,
             the reference) against the Triton GEMV, around tuning.GEMV_MAX_TOKENS and GEMV_SMALL_MAX_TOKENS (the
             GEMV's reach for weights of at most GEMV_SMALL_WEIGHT elements, e.g. `--preset small`'s).
  partials   a block's output projection and the next mix's combine + norm pass that reads it (hc_prenorm):
             cuBLAS's product against tuning.OUTPUT_SPLITS fp32 partial products summed by the combine, around
             tuning.PARTIALS_MAX_TOKENS.

Each call reads its own copy of the weight, as each layer does, so no call finds it in L2. --sweep adds the GEMV at
one token with none, 1, 2 and every chunk of weights read before the PDL wait (tuning.gemv_steps_ahead picks one).

    python benchmarks/kernels/bench_linear.py [--tokens 1,2,4] [--sweep] [--json out.json]
"""

import torch.nn.functional as F
import triton

from qwen4exp.bench.kernels import NEVER, Variant, around, run, with_tuning
from qwen4exp.ops import hyper_connection_triton, linear, linear_triton, tuning


def gemv(bench):
    for name, n, k, calls in bench.widths.projections():
        weights = bench.rotation(bench.copies(lambda: bench.weight(n, k), n * k * 2, calls))
        case = f"{name} [{n}, {k}], {calls} a step"
        for tokens in bench.tokens(around(tuning.GEMV_MAX_TOKENS) + around(tuning.GEMV_SMALL_MAX_TOKENS)):
            x = bench.randn(tokens, k)

            def op():
                return linear.linear(x, weights.next())
            variants = [
                Variant("cuBLAS", lambda: F.linear(x, weights.next())),
                Variant("GEMV", with_tuning(op, GEMV_MAX_TOKENS=NEVER)),
                Variant("dispatched", op),
            ]
            if bench.args.sweep and tokens == 1:
                steps = triton.cdiv(k, linear_triton.default_tiles(tokens, n, k, x.element_size())["block_k"])
                for ahead in sorted({0, 1, min(2, steps), steps}):
                    variants.append(Variant(f"GEMV, {ahead} ahead", lambda a=ahead: linear_triton.gemv(
                        x, weights.next(), steps_ahead=a)))
            bench.measure(case, tokens, variants, calls=calls)


def partials(bench):
    w = bench.widths
    n, k, calls = w.hidden, w.gdn_value_width, w.layers
    weights = bench.rotation(bench.copies(lambda: bench.weight(n, k), n * k * 2, calls))
    norm_weight = bench.randn(w.hc * w.hidden, scale=0.1)
    case = f"output projection [{n}, {k}] + the next combine and norm, {calls} a step"
    for tokens in bench.tokens([2] + around(tuning.PARTIALS_MAX_TOKENS)):
        x = bench.randn(tokens, k)
        streams = bench.randn(tokens, w.hc * w.hidden)
        inject = bench.randn(tokens, w.hc).abs()

        def op():
            out = linear.output_linear(x, weights.next())
            return hyper_connection_triton.hc_prenorm(streams, norm_weight, w.eps, w.hc, out, inject)[1]
        bench.measure(case, tokens, [
            Variant("cuBLAS", with_tuning(op, PARTIALS_MAX_TOKENS=0)),
            Variant(f"{tuning.OUTPUT_SPLITS} partials", with_tuning(op, PARTIALS_MAX_TOKENS=NEVER)),
            Variant("dispatched", op),
        ], calls=calls)


def main(bench):
    gemv(bench)
    partials(bench)


def arguments(p):
    p.add_argument("--sweep", action="store_true", help="also time the GEMV with other steps of weights ahead")


if __name__ == "__main__":
    run(main, __doc__, "linear", arguments=arguments)
