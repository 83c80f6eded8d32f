"""Block-scaled fp8 products on the GPU: the fast paths of `ops.fp8.linear` (the rule and its torch reference are in
fp8.py). Weights are float8_e4m3fn [N, K] with one fp32 scale per 128 x 128 block; activations are quantized per token
and 128-column group (s = amax / 448, q = fp8(x / s), nearest even), products summed in fp32 and rounded once.

  gemv            few tokens (decode), CUDA cores: each program owns BLOCK_N weight rows and walks all of K, a few
                  128-column groups a step; it quantizes those groups of x itself (once, in a compact layout, then
                  broadcast over its rows), so there is one launch and no split-K reduction. Programs re-read x from
                  L1/L2; each weight byte is read once (evict-first).
  gemm            tensor cores (tl.dot on fp8 operands, fp32 accumulators): per 128-column group one fp8 dot into a
                  fresh accumulator, scaled by the token's and the weight block's scales and added. At up to 64
                  tokens one row tile holds every token, so the weight is read once. The activations come already
                  quantized (`quantize`).
  quantize        per-token-group quantization as its own launch: the fp8 activations and their scales, laid out
                  for `gemm` or for cuBLAS.
  cublas_gemm     `quantize` + torch's block-scaled cuBLAS GEMM (`torch.nn.functional.scaled_mm`, DeepSeek's 1 x 128
                  activation / 128 x 128 weight scales), for prefill sizes where the library supports it.

Rounding to fp8: on the GPU the cast is cvt.rn.satfinite (nearest even). Triton's interpreter rounds halves away
from zero and flushes e4m3 subnormals, so under TRITON_INTERPRET the value is rounded by hand first (`round_to_fp8`)
and the cast is then exact. Divisions give the IEEE quotient, as torch's do (Triton's `/` is approximate): one
div_rn a group for its scale and the scale's reciprocal, and an exact-rounding multiply-and-correct for each element
(`divide`).

Which path runs at which token count: `ops.fp8.linear` with the thresholds in `ops.tuning`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import tuning
from ._triton_utils import INTERPRETED, launch_options, pdl_start, round_to_bf16

FP8 = torch.float8_e4m3fn
GROUP = 128  # the block edge of the format: activation groups and weight blocks
_GROUP = tl.constexpr(GROUP)  # the same, for kernels
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# Quantization helpers (shared with the MoE kernels)
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def round_to_fp8(x):
    """fp32 -> the nearest float8_e4m3fn value (ties to even), kept in fp32, for |x| up to 448 (larger values clamp
    to 448, as the GPU's saturating cast does). Normal values keep 3 of fp32's 23 mantissa bits, rounded on the
    bits; below 2^-6 the step is the subnormal 2^-9, and adding and removing 2^14 (whose fp32 ulp is 2^-9) rounds
    to it."""
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = (a + 16384.0) - 16384.0
    r = tl.minimum(tl.where(a < 0.015625, subnormal, normal), 448.0)
    return tl.where(x < 0, -r, r)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """fp32 -> dtype, nearest even (EXACT: bf16 rounded by hand first, as the interpreter's cast truncates)."""
    if EXACT and dtype == tl.bfloat16:
        x = round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def divide(x, d, r):
    """x / d rounded to nearest even, given r = 1 / d rounded to nearest even: q = x * r is within an ulp, the
    residual x - q * d is exact in an fma, and q + residual * r rounds to the IEEE quotient (Markstein's theorem;
    only a residual below fp32's normal range, for a group whose amax is under ~1e-20, can leave it an ulp off,
    which no fp8 value then shows). Three instructions an element: div_rn is a division sequence with a subroutine
    call for its slow path, and an element-wise one made the sm_90 build of the GEMV spill its loads to the
    stack."""
    q = x * r
    return tl.fma(tl.fma(-q, d, x), r, q)


@triton.jit
def quantize_groups(x, AXIS: tl.constexpr, EXACT: tl.constexpr):
    """x (fp32, zeros past the data) quantized per group along AXIS (one 128-column group): (fp8 values, scales with
    AXIS kept as size 1). s = amax / 448, 1 for an all-zero group; q = fp8(x / s), both divisions as IEEE divides.
    EXACT: round by hand before the cast (the interpreter's cast does not round to nearest even)."""
    amax = tl.max(tl.abs(x), axis=AXIS, keep_dims=True)
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    v = divide(x, s, tl.math.div_rn(1.0, s))
    if EXACT:
        v = round_to_fp8(v)
    return v.to(tl.float8e4nv), s


@triton.jit(do_not_specialize=["M", "M_OUT"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_qm, stride_sm, stride_sg,
                     BLOCK_M: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_M rows x one 128-column group: q[m, k] and s[m, g]. Rows M..M_OUT-1 are padding: zeros with scale 1."""
    pdl_start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * _GROUP + tl.arange(0, _GROUP)
    col_ok = cols < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    q, s = quantize_groups(x, 1, EXACT)
    out_rows = rows < M_OUT
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=out_rows[:, None] & col_ok[None, :])
    tl.store(s_ptr + rows[:, None] * stride_sm + g * stride_sg, s, mask=out_rows[:, None])


def quantize(x: torch.Tensor, rows: int | None = None, scale_columns: bool = False,
             block_m: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.fp8.quantize_activations` in one launch: x [M, K] -> (xq float8_e4m3fn [rows, K], scale fp32
    [rows, ceil(K/128)]), rows >= M (default M; rows past M are zeros with scale 1). scale_columns: the scales
    column-major (strides (1, rows)), as cuBLAS reads them."""
    m, k = x.shape
    rows = m if rows is None else rows
    groups = triton.cdiv(k, GROUP)
    xq = torch.empty(rows, k, dtype=FP8, device=x.device)
    if scale_columns:
        scale = torch.empty_strided((rows, groups), (1, rows), dtype=torch.float32, device=x.device)
    else:
        scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_kernel[(triton.cdiv(rows, block_m), groups)](
            x, xq, scale, m, rows, k, x.stride(0), xq.stride(0), scale.stride(0), scale.stride(1),
            BLOCK_M=block_m, EXACT=INTERPRETED, num_warps=4, **launch_options(x))
    return xq, scale


# ---------------------------------------------------------------------------------------------------------------------
# Few tokens: the GEMV
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _gemv_weights(w_ptrs, ws_ptrs, k0, rows4, k4, gg, N, K):
    """`_gemv_kernel`'s weights at column k0 ([1, BLOCK_N, G, 128] fp8) and their blocks' scales ([G])."""
    w = tl.load(w_ptrs + k0, mask=(rows4 < N) & (k0 + k4 < K), other=0.0, eviction_policy="evict_first")
    return w, tl.load(ws_ptrs + k0 // _GROUP, mask=k0 + gg * _GROUP < K, other=0.0)


@triton.jit
def _gemv_step(acc, w, ws, x_ptrs, k0, t_ok, k3, gg, K, REDUCE_EACH_STEP: tl.constexpr, EXACT: tl.constexpr):
    """One step of `_gemv_kernel`: the tokens' G groups of x at column k0 quantized, scaled by their own and the
    weight blocks' scales (ws [G]) and multiplied into the rows' weights w [1, BLOCK_N, G, 128]."""
    x = tl.load(x_ptrs + k0, mask=t_ok & (k0 + k3 < K), other=0.0).to(tl.float32)
    q, s = quantize_groups(x, 2, EXACT)
    a = q.to(tl.float32) * (s * ws[None, :, None])  # [BT, G, 128]
    if REDUCE_EACH_STEP:
        acc += tl.sum(tl.sum(a[:, None, :, :] * w.to(tl.float32), axis=3), axis=2)
    else:
        acc += a[:, None, :, :] * w.to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, T, N, K, stride_x, stride_w, stride_ws, stride_y,
    BT: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, PRE: tl.constexpr, HAS_BIAS: tl.constexpr,
    REDUCE_EACH_STEP: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr
):
    """BLOCK_N rows of W (within one 128-row scale block: BLOCK_N divides 128) x all T tokens, G 128-column groups a
    step. A step loads the G groups of weight first (G 16-byte vectors a lane in flight), then quantizes the
    tokens' G groups of x in a compact [BT, G, 128] layout (each element once per program), scales them by their
    own and the weight blocks' scales and broadcasts them over the rows. The accumulator keeps the K lanes
    ([BT, BLOCK_N, G, 128]) and is reduced once at the end; with REDUCE_EACH_STEP it is [BT, BLOCK_N], each step's
    products summed at once (a reduction across lanes a step, for registers left to wider steps). The first PRE
    steps' weights and scales are read before the wait: no kernel writes weights, so under PDL that read overlaps
    the kernel before this one."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    gg = tl.arange(0, G)
    kk = tl.arange(0, _GROUP)
    # the weight at the accumulator's shape, so that its load already has the accumulator's layout
    rows4 = rows[None, :, None, None]
    k4 = gg[None, None, :, None] * _GROUP + kk[None, None, None, :]
    w_ptrs = w_ptr + rows4 * stride_w + k4
    ws_ptrs = ws_ptr + (pid * BLOCK_N // _GROUP) * stride_ws + gg
    ahead = ()
    for i in tl.static_range(PRE):
        ahead = ahead + (_gemv_weights(w_ptrs, ws_ptrs, i * G * _GROUP, rows4, k4, gg, N, K),)
    pdl_start(PDL)
    t = tl.arange(0, BT)
    k3 = gg[None, :, None] * _GROUP + kk[None, None, :]
    x_ptrs = x_ptr + t[:, None, None] * stride_x + k3
    t_ok = (t < T)[:, None, None]
    if REDUCE_EACH_STEP:
        acc = tl.zeros((BT, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BT, BLOCK_N, G, _GROUP), dtype=tl.float32)
    for i in tl.static_range(PRE):
        acc = _gemv_step(acc, ahead[i][0], ahead[i][1], x_ptrs, i * G * _GROUP, t_ok, k3, gg, K, REDUCE_EACH_STEP,
                         EXACT)
    for k0 in range(PRE * G * _GROUP, K, G * _GROUP):
        w, ws = _gemv_weights(w_ptrs, ws_ptrs, k0, rows4, k4, gg, N, K)
        acc = _gemv_step(acc, w, ws, x_ptrs, k0, t_ok, k3, gg, K, REDUCE_EACH_STEP, EXACT)
    if REDUCE_EACH_STEP:
        y = acc
    else:
        y = tl.sum(tl.sum(acc, axis=3), axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + t[:, None] * stride_y + rows[None, :], to_dtype(y, y_ptr.dtype.element_ty, EXACT),
             mask=(t < T)[:, None] & (rows < N)[None, :])


def groups_per_step(width: int, most: int) -> int:
    """The most 128-column groups (a power of two, at most `most`) that divide a row of `width` columns' groups, so
    that steps of that many groups never run past the row's last group."""
    groups, g = triton.cdiv(width, GROUP), most
    while groups % g:
        g //= 2
    return g


def gemv_tiles(tokens: int, n: int, k: int) -> dict:
    """Tiles from static shapes only (a captured graph keeps its kernel). A lane loads 16 fp8 columns of a row as one
    16-byte vector per group. At one token (the decode GEMV, tuning.FP8_GEMV_MAX_TOKENS): 8 rows and 4 groups a step
    on 2 warps where the rows give thousands of programs; matrices of fewer rows (out_proj's 2560, the shared
    expert's) have too few programs to keep HBM busy with small steps, so wide steps with the accumulator reduced
    every step (8 groups on 4 warps, 79 registers; 16 groups of 4 rows on 2 warps for long rows, 167). One H100,
    flash-next widths, us a call (the former 4 rows, 4 groups, 1 warp -> these): GDN in_proj [16480, 2560] 19.69 ->
    16.61, attention q/k/v + indexer [13952, 2560] 18.03 -> 15.51, PLE [12800, 2560] 17.28 -> 14.69, out_proj
    [2560, 6144] 12.65 -> 9.46, shared expert gate + up [1280, 2560] 5.15 -> 4.57, down [2560, 640] 3.85 -> 2.58
    (benchmarks/kernels/bench_fp8.py --only linear --tokens 1 --sweep); flash-next-128e fp8 batch-1 decode 166.8 ->
    173.7 tok/s, one engine after the other in one process. From 2 tokens: 4 rows on one warp, 2 groups a step (1
    from 4 tokens), unmeasured (the tensor-core kernel serves those sizes)."""
    if tokens == 1:
        if n >= 8192:
            return dict(block_n=8, groups_per_step=4, num_warps=2)
        if k >= 4096:
            return dict(block_n=4, groups_per_step=16, num_warps=2, reduce_each_step=True)
        return dict(block_n=8, groups_per_step=8, num_warps=4, reduce_each_step=True)
    return dict(block_n=4, groups_per_step=groups_per_step(k, max(1, 4 // triton.next_power_of_2(tokens))),
                num_warps=1)


def gemv(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
         tiles: dict | None = None) -> torch.Tensor:
    """The block-scaled product of x [T, K] and wq [N, K] / scale (any T; `ops.fp8.linear` dispatches it for few
    tokens), one launch. tiles: `gemv_tiles` by default (block_n a power of two dividing 128; reduce_each_step
    optional, default False; steps_ahead, the steps of weights read before the PDL wait, `tuning.gemv_steps_ahead`
    by default); in the interpreter, where programs run one after another at Python's cost per
    operation, up to 128 rows a program and steps of up to 2^18 products (8192 rows of 256 columns: 14 -> 1 s)."""
    T, K = x.shape
    N = wq.shape[0]
    if tiles is None and INTERPRETED:
        block_n = min(GROUP, triton.next_power_of_2(N))
        most = max(1, 2**18 // (triton.next_power_of_2(T) * block_n * GROUP))
        tiles = dict(block_n=block_n, groups_per_step=min(triton.next_power_of_2(triton.cdiv(K, GROUP)), most),
                     num_warps=4, reduce_each_step=True)
    t = tiles or gemv_tiles(T, N, K)
    assert GROUP % t["block_n"] == 0, "block_n must divide 128: a program's rows share one scale row"
    step = t["groups_per_step"] * GROUP
    programs = triton.cdiv(N, t["block_n"])
    ahead = t.get("steps_ahead")
    if ahead is None:
        ahead = tuning.gemv_steps_ahead(programs, triton.cdiv(K, step), t["block_n"] * step, t["num_warps"])
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(programs,)](
        x, wq, scale, bias if bias is not None else y, y, T, N, K, x.stride(0), wq.stride(0), scale.stride(0),
        y.stride(0), BT=triton.next_power_of_2(T), BLOCK_N=t["block_n"], G=t["groups_per_step"], PRE=ahead,
        HAS_BIAS=bias is not None, REDUCE_EACH_STEP=t.get("reduce_each_step", False), EXACT=INTERPRETED,
        num_warps=t["num_warps"], **launch_options(x))
    return y


# ---------------------------------------------------------------------------------------------------------------------
# Tensor cores: the block-scaled GEMM
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # GROUP_M row tiles sweep the column tiles together, so a weight tile is still in L2 for the next row tile
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit(do_not_specialize=["M", "split_groups"])
def _gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, split_groups,
    stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsg, stride_ym, stride_ys,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr
):
    """One [BLOCK_M, BLOCK_N] output tile over the whole of K, or with SPLIT over the `split_groups` 128-column
    groups of K of its split (program axis 1). Per group: A's fp8 group (`quantize`) and its scales, the weight's
    [128, BLOCK_N] fp8 tile, one fp8 dot into a fresh fp32 accumulator, scaled by the rows' and the columns' block
    scales and added: the per-group sums of the rule, with tensor cores doing each group's products. Each split
    writes its own sum (y's split stride)."""
    pdl_start(PDL)
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if SPLIT:  # (apart, so the whole product's loop keeps its 4 fewer instructions a step)
        first = tl.program_id(1) * split_groups
        last = tl.minimum(first + split_groups, tl.cdiv(K, _GROUP))
        y_ptr += tl.program_id(1).to(tl.int64) * stride_ys
    else:
        first = 0
        last = tl.cdiv(K, _GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, _GROUP)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + first * _GROUP + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + first * _GROUP + offs_k[:, None]
    ws_ptrs = ws_ptr + (offs_n // _GROUP) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(first, last):
        if EVEN_K:
            k_ok = offs_k < _GROUP
        else:
            k_ok = offs_k < K - g * _GROUP
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(as_ptr + offs_m * stride_asm + g * stride_asg, mask=m_ok, other=0.0)[:, None]
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sw = tl.load(ws_ptrs + g * stride_wsg, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * (sa * sw[None, :])
        a_ptrs += _GROUP
        w_ptrs += _GROUP
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             to_dtype(acc, y_ptr.dtype.element_ty, EXACT), mask=m_ok[:, None] & n_ok[None, :])


def gemm_tiles(tokens: int) -> dict:
    """Tiles from static shapes only. Up to 64 tokens one row tile holds them all (the weight is read once), and the
    column tiles are narrow enough to give every SM programs; past that, prefill-shaped tiles with grouped row
    order."""
    if tokens <= 64:
        return dict(block_m=max(16, triton.next_power_of_2(tokens)), block_n=32, group_m=1, num_warps=4, num_stages=4)
    return dict(block_m=64 if tokens <= 256 else 128, block_n=128, group_m=8, num_warps=8 if tokens > 256 else 4,
                num_stages=4)


def gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
         bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, tiles: dict | None = None,
         splits: int | None = None) -> torch.Tensor:
    """The block-scaled product on tensor cores, one launch, of activations already quantized (`quantize`: xq [M, K]
    fp8, x_scale [M, ceil(K/128)]) by wq [N, K] / scale. Returns [M, N] in out_dtype. tiles: `gemm_tiles` by
    default.

    Quantizing the activations inside this kernel instead (one launch less) was slower at every size: each column
    tile repeats the quantization of its rows before its first dot. One H100, 2 tokens, us a call, quantized
    inside / quantize launch + this kernel: [16480, 2560] 26.8 / 18.7, [2560, 6144] 40.5 / 17.4, [1280, 2560]
    19.2 / 8.7; at 16 tokens 22.3 / 19.0, 28.0 / 17.5, 12.7 / 8.7.

    splits: K's 128-column groups cut into that many slices, one program per tile and slice, and the slices' fp32
    sums returned apart, [splits, M, N] (no bias): their sum is the product up to the order of fp32 additions. For
    few rows and few columns, where the tiles alone leave SMs idle."""
    M, K = xq.shape
    N = wq.shape[0]
    out_dtype = torch.float32 if splits else out_dtype
    assert not (splits and bias is not None), "split products are summed by their reader, which adds no bias"
    t = tiles or gemm_tiles(M)
    y = torch.empty(splits or 1, M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return y if splits else y[0]
    groups = triton.cdiv(K, GROUP)
    split_groups = triton.cdiv(groups, splits or 1)
    grid = (triton.cdiv(M, t["block_m"]) * triton.cdiv(N, t["block_n"]), triton.cdiv(groups, split_groups))
    _gemm_kernel[grid](
        xq, x_scale, wq, scale, bias if bias is not None else y, y, M, N, K, split_groups,
        xq.stride(0), x_scale.stride(0), x_scale.stride(1), wq.stride(0), scale.stride(0), scale.stride(1),
        y.stride(1), y.stride(0), BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], GROUP_M=t["group_m"],
        EVEN_K=K % GROUP == 0, HAS_BIAS=bias is not None, SPLIT=bool(splits), EXACT=INTERPRETED,
        num_warps=t["num_warps"], num_stages=t["num_stages"], **launch_options(xq))
    if splits and grid[1] < splits:  # more slices asked for than K has groups: the rest are empty
        y[grid[1]:] = 0
    return y if splits else y[0]


# ---------------------------------------------------------------------------------------------------------------------
# cuBLAS's block-scaled GEMM (prefill)
# ---------------------------------------------------------------------------------------------------------------------

# cuBLAS reads the activations' rows in multiples of this (padding rows are zeros with scale 1): no row count is then
# one it rejects (it has no kernel for a single row)
CUBLAS_ROW_ALIGN = 16
# weight-scale layouts by shape, found by trying each once outside graph capture: "plain" (the [N/128, K/128] scale
# transposed), "padded" (its K/128 padded to a multiple of 4, as some torch versions require), or None (unsupported)
_cublas_layouts: dict[tuple, str | None] = {}


@functools.cache
def _cublas_device_ok(device_index: int) -> bool:
    """torch has the block-scaled scaled_mm and the GPU is one cuBLAS runs it on (Hopper and later)."""
    scaling = getattr(F, "ScalingType", None)
    return (hasattr(F, "scaled_mm") and scaling is not None and hasattr(scaling, "BlockWise128x128")
            and torch.version.cuda is not None and torch.cuda.get_device_capability(device_index)[0] >= 9)


def _weight_scale(scale: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "padded" and scale.shape[1] % 4:
        scale = F.pad(scale, (0, 4 - scale.shape[1] % 4))
    return scale.contiguous().t()


def _scaled_mm(xq, sx, wq, scale, layout, out_dtype):
    return F.scaled_mm(xq, wq.t(), sx, F.ScalingType.BlockWise1x128, _weight_scale(scale, layout),
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def cublas_layout(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor) -> str | None:
    """How cuBLAS's block-scaled GEMM takes this weight on this device, or None where it cannot (not CUDA, no such
    torch API or GPU, shapes it rejects). Each weight shape is tried once, outside CUDA-graph capture; during a
    capture an untried shape answers None (the caller's Triton path then runs)."""
    if not x.is_cuda or x.dtype not in _DTYPES:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    n, k = wq.shape
    if not _cublas_device_ok(index) or k % 16 or n % 8 or wq.stride(1) != 1 or wq.stride(0) % 16:
        return None
    key = (index, n, k, x.dtype)
    if key not in _cublas_layouts:
        if torch.cuda.is_current_stream_capturing():
            return None
        _cublas_layouts[key] = None
        probe = torch.zeros(CUBLAS_ROW_ALIGN, k, dtype=x.dtype, device=x.device)
        xq, sx = quantize(probe, scale_columns=True)
        for layout in ("plain", "padded"):
            try:
                _scaled_mm(xq, sx, wq, scale, layout, x.dtype)
            except (RuntimeError, ValueError, NotImplementedError) as e:
                log.info("cuBLAS block-scaled GEMM rejects [%d, %d] with %s weight scales: %s", n, k, layout, e)
                continue
            _cublas_layouts[key] = layout
            break
    return _cublas_layouts[key]


def cublas_gemm(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, layout: str) -> torch.Tensor:
    """`quantize` (rows padded to CUBLAS_ROW_ALIGN, scales column-major) + cuBLAS's block-scaled GEMM, for a weight
    `cublas_layout` accepted. Returns [M, N] in x's dtype (a view of the padded product's first M rows)."""
    m = x.shape[0]
    xq, sx = quantize(x, rows=triton.cdiv(max(m, 1), CUBLAS_ROW_ALIGN) * CUBLAS_ROW_ALIGN, scale_columns=True)
    return _scaled_mm(xq, sx, wq, scale, layout, x.dtype)[:m]


def supported(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """The kernels' preconditions: x [T, K] of a float dtype with unit-stride rows; wq [N, K] fp8 with unit-stride,
    16-byte aligned rows; scale fp32 [ceil(N/128), ceil(K/128)] with unit-stride rows; bias [N] or None; int32
    weight offsets."""
    if x.dim() != 2 or wq.dim() != 2 or x.dtype not in _DTYPES or wq.dtype != FP8 or x.shape[0] == 0:
        return False
    n, k = wq.shape
    return (x.shape[1] == k and x.stride(1) == 1 and wq.stride(1) == 1 and wq.stride(0) % 16 == 0
            and wq.data_ptr() % 16 == 0 and n * wq.stride(0) < 2**31
            and scale.dtype == torch.float32 and tuple(scale.shape) == (triton.cdiv(n, GROUP), triton.cdiv(k, GROUP))
            and scale.stride(1) == 1
            and (bias is None or (bias.shape == (n,) and bias.stride(0) == 1)))
