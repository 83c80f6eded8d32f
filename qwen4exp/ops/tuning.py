"""Size thresholds between the implementations of an op on the GPU, each with the measurement that set it (one
H200, bf16, flash-next widths: 2560 hidden, 4 streams, 128 experts of 640, top-10). Every number here is a choice
between two correct implementations: moving one changes speed, never results beyond rounding. The kernel benchmarks
re-measure them: `python benchmarks/kernels/bench_<op>.py`.
"""

# ---- projections (ops.linear) ----

# Tokens up to which a bias-free projection runs as the Triton GEMV (linear_triton.gemv) instead of cuBLAS.
# At 1 token, us a call (GEMV / cuBLAS): router + shared expert [1416, 2560] 3.7 / 8.2, GDN in_proj [16480, 2560]
# 20.5 / 22.9, attention q/k/v + indexer [13952, 2560] 18.2 / 20.7, out_proj [2560, 6144] 9.4 / 12.1. From 2 tokens
# cuBLAS was faster at every one of these shapes.
GEMV_MAX_TOKENS = 1
# ... except projections of at most GEMV_SMALL_WEIGHT elements (flash-next's smallest, [1416, 2560], has 3.6M), which
# the GEMV runs ahead of cuBLAS's fixed cost up to GEMV_SMALL_MAX_TOKENS tokens. One H100, the `small` preset
# (`bench_linear.py --preset small`), us a call GEMV / cuBLAS at 2 tokens: out_proj [512, 512] 2.00 / 3.48, router +
# shared expert [792, 512] 2.27 / 3.70, GDN in_proj [1552, 512] 2.88 / 3.64, attention q/k/v + indexer [1600, 512]
# 5.01 / 5.16; at 4 tokens 2.16 / 3.54, 2.32 / 3.67, 2.86 / 3.70, 6.58 / 6.83. A speculative step's verification
# (2 tokens a request at k = 1) runs its projections at these sizes.
GEMV_SMALL_WEIGHT = 1 << 21
GEMV_SMALL_MAX_TOKENS = 4

# Tokens (from 2) up to which a projection whose reader can sum fp32 partial products over slices of K produces
# them (one batched GEMM, `linear.partial_products`) instead of cuBLAS's split-K GEMM plus its reduce kernel.
PARTIALS_MAX_TOKENS = 128
# The blocks' output projections (GDN out_proj, attention o_proj, [2560, 6144]) as this many partials, summed by
# the next hyper-connection mix's combine + norm pass; us for out_proj + that pass: 2 tokens 13.23 -> 12.89,
# 64: 15.36 -> 14.91, 128: 17.09 -> 15.60.
OUTPUT_SPLITS = 2
# The hyper-connection mix's down projection ([328, 10240]) as this many partials, summed by its activation; us for
# the whole mix after its norm (one GEMM + reduce / 16 partials): 2 tokens 12.81 / 11.02, 64: 14.12 / 12.40,
# 128: 15.83 / 14.47 (8 and 32 partials were slower at 64 tokens: 12.83, 12.77).
DOWN_SPLITS = 16

# ---- block-scaled fp8 projections (ops.fp8) ----
# Each is a choice between implementations that agree with the reference, so only speed depends on them
# (`python benchmarks/kernels/bench_fp8.py --only linear` times each forced).

# Tokens up to which an fp8 projection runs as the CUDA-core GEMV (fp8_triton.gemv, x quantized in the kernel)
# instead of the quantization launch + the tensor-core kernel. One H100, us a call, GEMV / tensor cores: GDN in_proj
# [16480, 2560] at 1 token 16.6 / (27.6 quantized inside the tensor-core kernel), at 2 tokens 24.6 / 18.7; out_proj
# [2560, 6144] at 2 tokens 19.6 / 17.4 (its accumulator doubles at 2 tokens, on CUDA cores).
FP8_GEMV_MAX_TOKENS = 1
# Weights a decode GEMV (fp8_triton.gemv, linear_triton.gemv) reads before the PDL wait, overlapping the kernel
# before it (`gemv_steps_ahead`): every step of a program's row where a thread's share fits GEMV_AHEAD_REGISTERS,
# else the first step; none where the grid has more than GEMV_AHEAD_MAX_PROGRAMS programs. One H100, one token at
# flash-next widths, a CUDA graph of one GEMV repeated, us a call, none ahead -> this rule, alternating twice: fp8
# shared expert gate + up [1280, 2560] (160 programs, 3 steps) 4.69 -> 4.12, down [2560, 640] (320, 1 step) 2.60 ->
# 2.10, out_proj [2560, 6144] (640, 1 of 6 steps) 9.53 -> 9.56; bf16 router + shared gate [513, 2560] (513, all 10
# chunks) 4.15 -> 4.05, out_proj [2560, 6144] (640, 1 of 12) 15.05 -> 14.57, shared expert gate + up [1280, 2560]
# (1280, all 10) 3.94 -> 3.74. Where the grid is larger the programs that wait hold registers and slots the kernel
# before them needs: bf16 GDN in_proj [16480, 2560] 28.6 -> 29.7 and shared expert down [2560, 640] (2560 programs)
# 3.48 -> 4.11 with every chunk ahead, fp8 attention q/k/v [13952, 2560] (1744) 15.8 -> 16.0 with one step.
GEMV_AHEAD_REGISTERS = 48
GEMV_AHEAD_MAX_PROGRAMS = 1280


def gemv_steps_ahead(programs: int, steps: int, weight_bytes_per_step: int, num_warps: int) -> int:
    """Steps of weights each of a GEMV's `programs` reads before the PDL wait: none if they are more than
    GEMV_AHEAD_MAX_PROGRAMS, all `steps` if a thread's share of them fits GEMV_AHEAD_REGISTERS, else one."""
    if programs > GEMV_AHEAD_MAX_PROGRAMS:
        return 0
    registers = -(-weight_bytes_per_step // (32 * num_warps * 4))
    return steps if steps * registers <= GEMV_AHEAD_REGISTERS else min(steps, 1)


# Tokens from which the quantization launch feeds torch's block-scaled cuBLAS GEMM instead of fp8_triton.gemm.
# 1024: cuBLAS ran [4096, 2560] at 23-26 us for 8-64 tokens (10% of HBM bandwidth) and at 137.5 us for 8192
# (1,250 TFLOP/s). One H100, us a call, cuBLAS / fp8_triton.gemm (each after the quantization launch): the wide
# projections are faster through cuBLAS from 32 tokens (GDN in_proj [16480, 2560]: 32 tokens 20.5 / 25.0,
# 64 20.9 / 21.0, 128 21.7 / 24.8), the narrow ones slower (shared expert [1280, 2560] 11.5 / 10.4 at 32 tokens;
# [2560, 640] 8.4 / 4.8): one threshold for all widths does not fit both.
FP8_CUBLAS_MIN_TOKENS = 1024

# Slices of K in which the blocks' fp8 output projections (GDN out_proj, attention o_proj, [2560, 6144]) run from
# FP8_GEMV_MAX_TOKENS + 1 to PARTIALS_MAX_TOKENS tokens, as fp32 partial products the next mix's combine sums
# (`fp8.partial_products`); 1: one whole product. Their 2560 rows make 80 column tiles of 32, fewer programs than
# SMs. One H100 (`bench_fp8.py --only linear`), us a call, whole / 2 / 4 / 8 slices: 2 tokens 17.4 / 11.5 / 10.0 /
# 10.6, 16 tokens 17.5 / 11.7 / 10.1 / 11.0, 32 tokens 25.7 / 20.8 / 14.1 / 11.5, 64 tokens 27.0 / 18.9 / 12.5 /
# 12.2, 128 tokens 40.9 / 23.4 / 16.3 / 18.4. flash-next-128e fp8 decode step (graphs, one H100), 4 slices with
# the activations quantized in a launch of their own, against whole products quantizing up to 16 tokens inside the
# kernel: 2 requests 7.30 / 10.78 ms, 32 requests 18.86 / 19.20 ms.
FP8_OUTPUT_SPLITS = 4

# ---- hyper-connections (ops.hyper_connection) ----

# Tokens up to which the mix runs as two Triton launches (hyper_connection_triton.hc_mix_decode) instead of the
# compiled form: 1 token 11.1 / 14.6 us a call, 2 tokens 17.7 / 14.8.
HC_DECODE_MAX_TOKENS = 1
# ... except mixes of at most HC_DECODE_SMALL_WIDTH stream columns (the `small` preset's 4 x 512 = 2048; flash-next's
# are 10240), whose two launches run ahead of the norm pass's five up to HC_DECODE_SMALL_MAX_TOKENS tokens (a
# speculative step's verification runs 2 tokens a request at k = 1). One H100, `bench_hyper_connection.py --preset
# small`, us a combine + mix, decode kernels / norm pass + partials: 2 tokens 7.32 / 7.89, 4 tokens 10.49 / 7.93.
HC_DECODE_SMALL_WIDTH = 4096
HC_DECODE_SMALL_MAX_TOKENS = 2
# Rows of W_down_inject a down program of the decode kernels takes: (wider mixes, those of at most
# HC_DECODE_SMALL_WIDTH columns). One H100, 27 tiles (rows x chunk x block_h) at the small preset's widths, us a
# combine + mix, 16 / 8 rows: 1 token 5.81 / 5.42, 2 tokens 7.39 / 6.24 (the fastest tile within 3% at each). At
# flash-next's widths, one token, the default tile (16 rows, 512-column chunks, 4 hidden columns an up program) is
# the fastest of 34, 12.4 us (the next: 12.8).
HC_DECODE_BLOCK_ROWS = (16, 8)

# ---- norms (ops.norm) ----

# Tokens from which the GDN output norm and the grouped (per-stream) norms run as one Triton pass instead of
# inductor's compiled reduction. At 8k tokens the compiled gated norm took 238 us a layer (~70 at bandwidth) and
# the grouped norm 97 + 533 us a call (~80). At 256 tokens, compiled / Triton: gated norm 4.40 / 4.84 us, grouped
# norm 6.06 / 3.88; below it the compiled forms run at launch latency.
TRITON_NORM_MIN_TOKENS = 256

# ---- attention (ops.attention) ----

# Tokens from which a dense step with prefill chunks runs the flash-style prefill kernel
# (attention_triton.prefill_paged_attention) instead of the per-token split-K kernel: 4.3x faster at 8 x 1024 new
# tokens, 6.1x at 1 x 8192 (24 query heads, 2 kv heads, head dim 256).
PREFILL_ATTN_MIN_TOKENS = 512

# ---- routed experts (ops.moe) ----

# (token, expert) pairs up to which each pair is one GEMV-style program (moe_triton.pairwise_moe: no sort, three
# launches) instead of the sorted-pairs fused kernels: at decode batch sizes experts are rarely shared, and the sort
# is a dozen small launches a layer. 96 pairs is batch 9 at top-10. fp8 experts (moe_triton.pairwise_moe_fp8) use
# the same threshold; past it the fused fp8 kernels won on one H100 (`bench_fp8.py --only experts`, flash-next widths
# with the shared expert, us a layer, fused / pairwise): 512 experts at 16, 32 tokens 269.8 / 291.4, 434.8 / 522.9;
# 128 experts 192.0 / 242.9, 229.5 / 443.0.
PAIRWISE_MAX_PAIRS = 96
# Pairs from which the experts run through torch's grouped GEMM (CUTLASS, bf16, Hopper) over the pairs sorted by
# expert instead of the fused Triton kernels. 4096 pairs is 410 tokens at top-10. (fp8 experts have no grouped GEMM:
# the fused kernels serve them at every size past the pairwise ones.)
GROUPED_MM_MIN_PAIRS = 4096
