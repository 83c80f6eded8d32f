"""Block-scaled fp8 products (qwen4exp/ops/fp8.py, fp8_triton.py, the fp8 experts of moe_triton.py) at the model's
widths, against the bf16 weights they replace.

  linear   every fp8 projection of the released model: the torch reference (first column: the others' max
           |difference| is from it), the bf16 weight as ops.linear runs it (timed only), the fp8 dispatch, and each fp8
           implementation forced: the CUDA-core GEMV (tuning.FP8_GEMV_MAX_TOKENS), the quantization launch + the
           tensor-core kernel, the quantization launch + torch's block-scaled cuBLAS GEMM (FP8_CUBLAS_MIN_TOKENS),
           and the tensor-core kernel with K in 2, 4 and 8 slices (fp32 partial products, as the blocks' output
           projections run: FP8_OUTPUT_SPLITS); decode and prefill token counts.
  experts  the routed experts with the gated shared expert (fp8 down projection), as the model calls them
           (`moe_experts`), at 512 and 128 experts: the fp8 reference, bf16 experts dispatched (timed only), fp8
           dispatched, and the fp8 pairwise and fused kernels forced (tuning.PAIRWISE_MAX_PAIRS).

Each call reads its own copy of a projection's weight (as each layer does); one layer's experts are read per call.
--sweep adds the kernels' tile choices (fp8_triton.gemv_tiles / gemm_tiles, pairwise_moe_fp8's rows a program) as
further columns at the decode token counts.

    python benchmarks/kernels/bench_fp8.py [--tokens 1,2,4] [--only linear|experts] [--sweep] [--json out.json] [--tiny]
"""

import torch
import triton

from qwen4exp.bench.kernels import NEVER, Variant, around, run, widths, with_tuning
from qwen4exp.ops import fp8, fp8_triton, linear, moe, moe_triton, tuning

DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64]
PREFILL_TOKENS = [128, 512, 1024, 2048, 8192]


def fp8_projections(w) -> list[tuple[str, int, int, int]]:
    """(name, rows, columns, calls a decode step) of the projections the fp8 checkpoint quantizes."""
    attention = [p for p in w.projections() if p[0].startswith("attention")][0]
    gdn = [p for p in w.projections() if p[0].startswith("GDN")][0]
    return [
        gdn,
        attention,
        ("out_proj / o_proj", w.hidden, w.gdn_value_width, w.layers),
        ("PLE key + value", w.hc * w.hidden + w.hidden, w.ple_dim, w.ple_layers),
        ("shared expert gate + up", 2 * w.shared_inter, w.hidden, w.layers),
        ("shared expert down", w.hidden, w.shared_inter, w.layers),
    ]


def quantized_weight(bench, rows, cols):
    return fp8.quantize_weight(bench.weight(rows, cols))


def timing_only(fn):
    """A baseline timed beside the fp8 implementations but not compared with them: its weights are not the fp8
    ones (its column shows no difference)."""
    def call():
        fn()
    return call


def linear_case(bench):
    tokens_list = DECODE_TOKENS + PREFILL_TOKENS + around(tuning.FP8_GEMV_MAX_TOKENS) \
        + around(tuning.FP8_CUBLAS_MIN_TOKENS)
    for name, n, k, calls in fp8_projections(bench.widths):
        bf16 = bench.rotation(bench.copies(lambda: bench.weight(n, k), n * k * 2, calls))
        quantized = bench.rotation(bench.copies(lambda: quantized_weight(bench, n, k), n * k, calls))
        case = f"{name} [{n}, {k}], {calls} a step"
        for tokens in bench.tokens(tokens_list):
            x = bench.randn(tokens, k)

            def op():
                return fp8.linear(x, *quantized.next())

            variants = [
                Variant("fp8 reference", lambda: fp8.linear_ref(x, *quantized.next())),
                Variant("bf16", timing_only(lambda: linear.linear(x, bf16.next()))),
                Variant("fp8", op),
            ]
            if tokens <= 8:
                variants.append(Variant("GEMV", with_tuning(op, FP8_GEMV_MAX_TOKENS=NEVER)))
            variants.append(Variant("quantize + tc", with_tuning(
                op, FP8_GEMV_MAX_TOKENS=0, FP8_CUBLAS_MIN_TOKENS=NEVER)))
            if fp8_triton.cublas_layout(x, *quantized.items[0]) is not None:
                variants.append(Variant("quantize + cuBLAS", with_tuning(
                    op, FP8_GEMV_MAX_TOKENS=0, FP8_CUBLAS_MIN_TOKENS=0)))
            if 1 < tokens <= tuning.PARTIALS_MAX_TOKENS:
                for splits in (2, 4, 8):
                    variants.append(Variant(f"tc, K in {splits} slices", lambda s=splits: fp8.partial_products(
                        x, *quantized.next(), s)))
            if bench.args.sweep and tokens <= 64:
                variants += tile_variants(x, quantized, n, k)
            bench.measure(case, tokens, variants, calls=calls if tokens <= 512 else 4,
                          compare=lambda out, dtype=x.dtype: summed(out, dtype))


def summed(out, dtype):
    """Partial products [T, S, N] (`fp8.partial_products`) as the product their reader makes of them."""
    return out.sum(1).to(dtype) if out.dim() == 3 else out


def tile_variants(x, quantized, n, k):
    """The GEMV (up to 4 tokens) and the tensor-core kernel at other tiles than the defaults."""
    tokens = x.shape[0]
    variants = []
    if tokens <= 4:
        # (rows, warps, groups a step, the accumulator reduced each step: "s"). Registers a thread (sm_90, triton 3.6,
        # from the cubin): 4/4g/1w (the former default) 159, 4/2g/1w 89, 8/4g/2w 127, 16/4g/4w 151; reduced each
        # step 4/8g/1w 168, 8/8g/2w 124, 8/8g/4w 79, 8/16g/4w 128, 16/8g/4w 128, 16/16g/8w 128, 4/16g/2w 167
        # (keeping the K lanes instead, 8 groups a step take 250 registers and more).
        for block_n, warps, g, each in ((4, 1, 4, False), (4, 1, 2, False), (8, 2, 4, False), (16, 4, 4, False),
                                        (4, 1, 8, True), (8, 2, 8, True), (8, 4, 8, True), (8, 4, 16, True),
                                        (16, 4, 8, True), (16, 8, 16, True), (4, 2, 16, True)):
            if g <= 2 * triton.cdiv(k, 128):
                tiles = dict(block_n=block_n, groups_per_step=g, num_warps=warps, reduce_each_step=each)
                variants.append(Variant(f"GEMV {block_n}r{g}g{warps}w{'s' if each else ''}",
                                        lambda t=tiles: fp8_triton.gemv(x, *quantized.next(), tiles=t)))
        # the default tiles with none, 1, 2 and every step of weights read before the PDL wait (tuning.gemv_steps_ahead)
        default = fp8_triton.gemv_tiles(tokens, n, k)
        steps = triton.cdiv(k, default["groups_per_step"] * 128)
        for ahead in sorted({0, 1, min(2, steps), steps}):
            tiles = default | dict(steps_ahead=ahead)
            variants.append(Variant(f"GEMV default, {ahead} ahead",
                                    lambda t=tiles: fp8_triton.gemv(x, *quantized.next(), tiles=t)))
    xq, sx = fp8_triton.quantize(x)  # (the quantization launch, apart from the tiles timed)
    block_m = max(16, triton.next_power_of_2(tokens))
    for block_n in (16, 32, 64, 128):
        for stages in (3, 4, 6):
            tiles = dict(block_m=block_m, block_n=block_n, group_m=1, num_warps=4, num_stages=stages)
            variants.append(Variant(f"tc {block_n}c{stages}s", lambda t=tiles: fp8_triton.gemm(
                xq, sx, *quantized.next(), out_dtype=x.dtype, tiles=t)))
    return variants


def fp8_experts(bench, experts: int, hidden: int, inter: int):
    """fp8 experts as the checkpoint holds them (gate rows, then up rows, each padded to a multiple of 128), quantized
    a few experts at a time."""
    padded = -(-inter // 128) * 128
    gate_up = torch.empty(experts, 2 * padded, hidden, dtype=fp8.FP8, device=bench.device)
    gate_up_scale = torch.empty(experts, 2 * padded // 128, -(-hidden // 128), device=bench.device)
    down = torch.empty(experts, hidden, inter, dtype=fp8.FP8, device=bench.device)
    down_scale = torch.empty(experts, -(-hidden // 128), -(-inter // 128), device=bench.device)
    for e in range(experts):
        w = torch.zeros(2 * padded, hidden, device=bench.device)
        w[:inter], w[padded:padded + inter] = bench.weight(inter, hidden), bench.weight(inter, hidden)
        gate_up[e], gate_up_scale[e] = fp8.quantize_weight(w)
        down[e], down_scale[e] = fp8.quantize_weight(bench.weight(hidden, inter))
    return gate_up, gate_up_scale, down, down_scale


def experts_case(bench):
    w = bench.widths
    H, inter, shared_inter = w.hidden, w.moe_inter, w.shared_inter
    counts = (w.experts,) if bench.tiny else (widths("flash-next").experts, w.experts)
    shared_down = fp8.quantize_weight(bench.weight(H, shared_inter))
    shared_down_bf16 = fp8.dequantize_weight(*shared_down, bench.dtype)
    pairwise_last = tuning.PAIRWISE_MAX_PAIRS // w.top_k
    for experts in counts:
        gate_up, gate_up_scale, down, down_scale = fp8_experts(bench, experts, H, inter)
        bf16_gate_up = torch.stack([bench.weight(2 * inter, H) for _ in range(experts)])
        bf16_down = torch.stack([bench.weight(H, inter) for _ in range(experts)])
        case = (f"fp8 experts, {experts} x [{2 * inter}, {H}] + [{H}, {inter}], top-{w.top_k}, "
                f"with the shared expert (fp8 down)")
        for tokens in bench.tokens([1, 8, 64, 4096, 8192] + around(tuning.PAIRWISE_MAX_PAIRS, w.top_k)):
            x = bench.randn(tokens, H)
            scores = torch.rand(tokens, experts, device=bench.device, generator=bench.generator)
            ids = scores.argsort(-1)[:, :w.top_k]
            weights = torch.softmax(bench.randn(tokens, w.top_k, dtype=torch.float32), -1).to(bench.dtype)
            gate, up, logit = (bench.randn(tokens, shared_inter), bench.randn(tokens, shared_inter),
                               bench.randn(tokens, 1))
            shared = (gate, up, shared_down[0], logit, shared_down[1])

            def op():
                return moe.moe_experts(x, gate_up, down, ids, weights, shared, gate_up_scale, down_scale)

            def shared_out():
                return fp8.linear(moe.silu_mul(gate, up), *shared_down)

            def ref():
                shared_out = fp8.linear_ref(moe.silu_mul.eager(gate, up), *shared_down)
                return moe.moe_block_ref(x, gate_up, down, ids, weights, (shared_out, logit), gate_up_scale,
                                         down_scale)

            variants = [
                Variant("fp8 reference", ref, graph=False, once=tokens > 512),
                Variant("bf16", timing_only(lambda: moe.moe_experts(x, bf16_gate_up, bf16_down, ids, weights,
                                                                    (gate, up, shared_down_bf16, logit)))),
                Variant("fp8", op),
            ]
            if tokens <= 4 * pairwise_last:
                variants.append(Variant("fp8 pairwise", with_tuning(op, PAIRWISE_MAX_PAIRS=NEVER)))
                if bench.args.sweep:
                    for rows, down_rows, warps in ((4, 4, 1), (8, 8, 1), (8, 16, 2), (16, 32, 4)):
                        variants.append(Variant(
                            f"pairwise {rows}/{down_rows}r{warps}w",
                            lambda r=rows, d=down_rows, nw=warps: moe_triton.pairwise_moe_fp8(
                                x, gate_up, gate_up_scale, down, down_scale, ids, weights, shared, block_n=r,
                                down_block_n=d, num_warps=nw)))
            variants.append(Variant("fp8 fused", with_tuning(op, PAIRWISE_MAX_PAIRS=0)))
            if bench.args.sweep and 1 < tokens <= 64:
                base = moe_triton.get_fp8_config(tokens, experts, w.top_k)
                # (gate-up warps, stages; down columns, warps, stages) of the fused kernels, the defaults first (the
                # shared expert computed before them in each)
                default = (base.gate_up.num_warps, base.gate_up.num_stages, base.down.block_n, base.down.num_warps,
                           base.down.num_stages)
                # (fewer gate-up stages leave room for a second program an SM: ~35 KB of tiles a stage)
                for gw, gs, dn, dw, ds in (default, (8, 4, 64, 4, 4), (4, 3, 64, 4, 4), (4, 5, 64, 4, 4),
                                           (4, 2, 64, 4, 4), (8, 3, 64, 4, 4), (4, 4, 32, 4, 4), (4, 4, 64, 4, 3),
                                           (4, 4, 64, 4, 6), (4, 4, 128, 4, 4), (4, 4, 128, 8, 4), (4, 4, 64, 2, 4)):
                    config = moe_triton.MoEConfig(
                        block_m=base.block_m,
                        gate_up=moe_triton.Tile(block_n=128, block_k=128, group_m=base.gate_up.group_m, num_warps=gw,
                                                num_stages=gs),
                        down=moe_triton.Tile(block_n=dn, block_k=128, group_m=base.down.group_m, num_warps=dw,
                                             num_stages=ds))
                    variants.append(Variant(
                        f"fused {gw}w{gs}s/{dn}c{dw}w{ds}s", lambda c=config: moe_triton.fused_moe_fp8(
                            x, gate_up, gate_up_scale, down, down_scale, ids, weights, config=c,
                            shared=(shared_out(), logit))))
            bench.measure(case, tokens, variants, calls=w.layers if tokens <= 512 else 4)


def arguments(p):
    p.add_argument("--only", choices=("linear", "experts"), default=None, help="one of the two cases")
    p.add_argument("--sweep", action="store_true", help="also time the kernels at other tiles than the defaults")


def main(bench):
    if bench.args.only in (None, "linear"):
        linear_case(bench)
    if bench.args.only in (None, "experts"):
        experts_case(bench)


if __name__ == "__main__":
    run(main, __doc__, "fp8", arguments=arguments)
