"""The RMSNorm variants (qwen4exp/ops/norm.py, qwen4exp/ops/rotary.py) as the model calls them.

  GDN output norm  the gated norm of GDN's [T, heads, D] output, the gate a strided view of the in_proj output:
                   the compiled reference against the Triton pass, around tuning.TRITON_NORM_MIN_TOKENS.
  grouped norm     the per-stream norm of [T, streams x hidden] (the PLE layer's): the same two, same threshold.
  norm + rope      attention's per-head norm and partial rotation of the query (a view of q_proj's packed heads),
                   the key and the indexer's query: the compiled norm then the compiled rotation against the one
                   Triton pass the dispatch takes at every size.

    python benchmarks/kernels/bench_norm.py [--tokens 64,256,8192] [--json out.json]
"""

import torch

from qwen4exp.bench.kernels import NEVER, Variant, around, run, with_tuning
from qwen4exp.ops import norm, rotary, tuning


def gdn_norm(bench):
    w = bench.widths
    hv, dv = w.gdn_value_heads, w.gdn_value_dim
    weight = bench.randn(dv).abs() + 0.5
    case = f"GDN output norm, [T, {hv}, {dv}], {w.gdn_layers} a step"
    for tokens in bench.tokens([1, 64] + around(tuning.TRITON_NORM_MIN_TOKENS) + [8192]):
        x = bench.randn(tokens, hv, dv)
        proj = bench.randn(tokens, w.conv_dim + w.gdn_value_width + 2 * hv)
        gate = proj[:, w.conv_dim: w.conv_dim + w.gdn_value_width].reshape(tokens, hv, dv)  # a strided view

        def op():
            return norm.gated_rms_norm_op(x, gate, weight, w.eps, "sigmoid")
        bench.measure(case, tokens, [
            Variant("compiled", with_tuning(op, TRITON_NORM_MIN_TOKENS=NEVER)),
            Variant("Triton", with_tuning(op, TRITON_NORM_MIN_TOKENS=0)),
            Variant("dispatched", op),
        ], calls=w.gdn_layers if tokens <= 512 else 8)


def grouped_norm(bench):
    w = bench.widths
    width = w.hc * w.hidden
    weight = bench.randn(width, scale=0.1)
    case = f"grouped norm, [T, {w.hc} x {w.hidden}]"
    for tokens in bench.tokens([1, 64] + around(tuning.TRITON_NORM_MIN_TOKENS) + [8192]):
        x = bench.randn(tokens, width)

        def op():
            return norm.rms_norm_op(x, weight, w.eps, w.hidden)
        bench.measure(case, tokens, [
            Variant("compiled", with_tuning(op, TRITON_NORM_MIN_TOKENS=NEVER)),
            Variant("Triton", with_tuning(op, TRITON_NORM_MIN_TOKENS=0)),
            Variant("dispatched", op),
        ], calls=8)


def norm_rope(bench):
    w = bench.widths
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, w.rotary_dim, 2, dtype=torch.float, device=bench.device)
                              / w.rotary_dim))
    for name, heads, dim, packed in (("query", w.heads, w.head_dim, 2), ("key", w.kv_heads, w.head_dim, 1),
                                     ("indexer query", w.index_heads, w.index_dim, 1)):
        weight = bench.randn(dim, scale=0.1)
        case = f"norm + rope, {name} [T, {heads}, {dim}], {w.rotary_dim} rotated, {w.attention_layers} a step"
        for tokens in bench.tokens([1, 64, 8192]):
            cos, sin = rotary.rope_cos_sin(torch.arange(tokens, device=bench.device), inv_freq, bench.dtype)
            x = bench.randn(tokens, heads, packed * dim)[..., :dim]
            bench.measure(case, tokens, [
                Variant("compiled", lambda: rotary.apply_rope(norm.rms_norm(x, weight, w.eps), cos, sin)),
                Variant("dispatched", lambda: rotary.norm_rope(x, weight, w.eps, cos, sin)),
            ], calls=w.attention_layers if tokens <= 512 else 8)


def main(bench):
    gdn_norm(bench)
    grouped_norm(bench)
    norm_rope(bench)


if __name__ == "__main__":
    run(main, __doc__, "norm")
