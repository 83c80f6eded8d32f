"""Hyper-connection mix in Triton: the GPU path of `ops.hyper_connection.hc_mix`, whose inductor-compiled form is
eight kernels (cuBLAS split-K GEMM + its reduction, the RMSNorm written out, elementwise kernels, a second GEMM and
the mix; ~15 us per call at one token, 18.9 us at 64 tokens, 425 us at 8192 on an H200, 96 calls per step).

streams [T, S*H] (S streams of width H), norm weight [S*H], W_down_inject [R (+S) (+padding), S*H], W_up [S*H, R].

One token (`hc_mix_decode`). Both GEMMs are matrix-vector products that must stream 6.5 MB of weights each, so each
is split over hundreds of programs with one (or few) wide loads apiece; a loop of small dependent loads per program
is latency bound (a first version that looped measured 137 us per call).

  `_hc_down_kernel`, grid (row blocks, K chunks): normalises one K chunk (normed = x * rstd * (1 + w), rounded to
      the model dtype as the reference rounds it; the stream's RMS is recomputed from the L2-resident activations)
      and writes BR partial dot products. The last program of a row block to finish (a per-row-block arrival
      counter) sums the chunks' partials, rounds them as the reference's GEMM output, and writes act = silu(d / S)
      for the R down rows and inject = 2 sigmoid(d / S) for the S inject rows, then re-arms the counter.
  `_hc_up_mix_kernel`, grid (hidden blocks): gate = sigmoid(act @ W_up^T) for all S streams, then
      mixed = mean_s gate * normed.

H200, flash-next widths, inside a CUDA graph: 11.1 us per call against the compiled reference's 14.6 us at one
token, but slower from two tokens (17.7 vs 14.8 us; its CUDA-core products scale with T), hence:

Two tokens and up (`hc_mix_batched`): the same two steps as tensor-core GEMMs (tl.dot) over token blocks.

  `_hc_rstd_kernel` (only when the down GEMM's K chunks are narrower than a stream): per-token per-stream rstd.
  `_hc_down_mm_kernel`, grid (row blocks, token blocks, K chunks): normed is formed in the A-operand load and never
      written. Few tokens give few output tiles, so K is split until ~one wave of programs streams W_down (fp32
      partials, the last program of a tile to arrive reduces them as the decode kernel does). From ~1k tokens a
      chunk holds whole streams and computes their rstd itself: a separate pass would read the 168 MB of streams
      (8k tokens) once more.
  `_hc_up_mix_mm_kernel`, grid (hidden blocks, token blocks): per stream a [BM, R] x [R, BH] dot for the gate,
      normed recomputed from the streams and rstd, the mean over streams written in the model dtype.

The batched kernels are verified against the reference under the interpreter (tests/ops/test_triton_hc.py); their
H200 timings and default tiles await a run of `bench/decode_kernels.py --parts hc_batch`.
"""

import os

import torch
import triton
import triton.language as tl

from .triton_moe import _mma

# products held per program (fp32 values): ~64 registers a thread at 4 warps
_BUDGET = 8192


@triton.jit
def _hc_down_kernel(
    x_ptr, nw_ptr, w_ptr, part_ptr, count_ptr, rstd_ptr, act_ptr, inj_ptr,
    T, H, R, NROWS, NCHUNKS, eps,
    stride_x, stride_w, stride_a, stride_i,
    S: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, KC: tl.constexpr, BK: tl.constexpr,
    BS: tl.constexpr, NCP: tl.constexpr, ROUND: tl.constexpr,
):
    rb = tl.program_id(0)
    chunk = tl.program_id(1)
    k_start = chunk * KC
    stream = k_start // H
    t = tl.arange(0, BT)
    t_ok = t < T
    ss = tl.zeros((BT,), dtype=tl.float32)
    for k0 in range(0, H, BS):
        hs = k0 + tl.arange(0, BS)
        x = tl.load(x_ptr + t[:, None] * stride_x + (stream * H + hs)[None, :],
                    mask=t_ok[:, None] & (hs < H)[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    if (rb == 0) & (k_start == stream * H):
        tl.store(rstd_ptr + t * S + stream, rstd, mask=t_ok)

    rows = rb * BR + tl.arange(0, BR)
    r_ok = rows < NROWS
    kk = tl.arange(0, BK)
    acc = tl.zeros((BT, BR, BK), dtype=tl.float32)
    for k0 in range(k_start, k_start + KC, BK):
        x = tl.load(x_ptr + t[:, None] * stride_x + (k0 + kk)[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + k0 + kk).to(tl.float32)
        normed = (x * rstd[:, None] * (1.0 + nw[None, :]))
        normed = normed.to(x_ptr.dtype.element_ty, fp_downcast_rounding=ROUND).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * stride_w + (k0 + kk)[None, :], mask=r_ok[:, None], other=0.0)
        acc += normed[:, None, :] * w.to(tl.float32)[None, :, :]
    part_rows = part_ptr + t[:, None] * NROWS + rows[None, :]
    tl.store(part_rows + chunk * T * NROWS, tl.sum(acc, axis=2), mask=t_ok[:, None] & r_ok[None, :])

    # every thread's partials are written before the release of the arrival count
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel")
    if arrived == NCHUNKS - 1:
        c = tl.arange(0, NCP)
        m = (c < NCHUNKS)[:, None, None] & t_ok[None, :, None] & r_ok[None, None, :]
        d = tl.sum(tl.load(part_rows[None, :, :] + (c * T * NROWS)[:, None, None], mask=m, other=0.0,
                           cache_modifier=".cg"), axis=0)
        dtype = act_ptr.dtype.element_ty
        d = d.to(dtype, fp_downcast_rounding=ROUND).to(tl.float32) / S
        act = d / (1.0 + tl.exp(-d))
        tl.store(act_ptr + t[:, None] * stride_a + rows[None, :], act.to(dtype, fp_downcast_rounding=ROUND),
                 mask=t_ok[:, None] & (rows < R)[None, :])
        inj = 2.0 / (1.0 + tl.exp(-d))
        tl.store(inj_ptr + t[:, None] * stride_i + tl.maximum(rows - R, 0)[None, :],
                 inj.to(dtype, fp_downcast_rounding=ROUND), mask=t_ok[:, None] & ((rows >= R) & r_ok)[None, :])
        tl.atomic_xchg(count_ptr + rb, 0)


@triton.jit
def _hc_up_mix_kernel(
    x_ptr, nw_ptr, wu_ptr, act_ptr, rstd_ptr, out_ptr,
    T, H, R,
    stride_x, stride_wu, stride_a, stride_o,
    S: tl.constexpr, SP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, ROUND: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    t = tl.arange(0, BT)
    t_ok = t < T
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    h_ok = h < H
    s_idx = tl.arange(0, SP)
    s_ok = s_idx < S
    kk = tl.arange(0, BK)
    g = tl.zeros((SP, BT, BH), dtype=tl.float32)
    for k0 in range(0, R, BK):
        k = k0 + kk
        k_ok = k < R
        a = tl.load(act_ptr + t[:, None] * stride_a + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(wu_ptr + (s_idx[:, None, None] * H + h[None, :, None]) * stride_wu + k[None, None, :],
                    mask=s_ok[:, None, None] & h_ok[None, :, None] & k_ok[None, None, :], other=0.0)
        g += tl.sum(a[None, :, None, :] * w.to(tl.float32)[:, None, :, :], axis=3)
    g = g.to(dtype, fp_downcast_rounding=ROUND).to(tl.float32)
    gate = 1.0 / (1.0 + tl.exp(-g))
    rstd = tl.load(rstd_ptr + t[None, :] * S + s_idx[:, None], mask=s_ok[:, None] & t_ok[None, :], other=0.0)
    sh = s_idx[:, None, None] * H + h[None, None, :]
    m = s_ok[:, None, None] & t_ok[None, :, None] & h_ok[None, None, :]
    x = tl.load(x_ptr + t[None, :, None] * stride_x + sh, mask=m, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + sh, mask=s_ok[:, None, None] & h_ok[None, None, :], other=0.0).to(tl.float32)
    normed = (x * rstd[:, :, None] * (1.0 + nw)).to(dtype, fp_downcast_rounding=ROUND).to(tl.float32)
    mixed = tl.sum(gate * normed, axis=0) / S
    tl.store(out_ptr + t[:, None] * stride_o + h[None, :], mixed.to(dtype, fp_downcast_rounding=ROUND),
             mask=t_ok[:, None] & h_ok[None, :])


def _pow2_divisor(n: int, cap: int) -> int:
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


_counters: dict[torch.device, torch.Tensor] = {}
# replaced counter buffers stay allocated: a captured CUDA graph may still point at them
_retired: list[torch.Tensor] = []


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters that every call leaves zeroed again (so a CUDA graph can replay the kernel)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _retired.append(buf)
        buf = _counters[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def supported(streams: torch.Tensor, hc: int) -> bool:
    """At least one token, and a stream width with a power-of-two block of at least 16 (K chunks must not straddle
    streams; tl.dot tiles are >= 16). `hc_mix` picks the kernels by token count."""
    return (streams.shape[0] >= 1 and _pow2_divisor(streams.shape[1] // hc, 1024) >= 16
            and streams.stride(1) == 1 and streams.dtype in (torch.bfloat16, torch.float16, torch.float32))


def hc_mix_decode(streams, norm_weight, w_down_inject, w_up, eps: float, hc: int, rank: int, inject: bool,
                  block_rows: int = 16, chunk: int = 512, block_h: int = 4):
    """Same contract as `ops.hyper_connection.hc_mix` (dispatched to for one token; correct for any T).

    block_rows x chunk: the W_down_inject tile of one down program (chunk is cut to a power of two dividing the
    stream width); block_h: hidden columns (of every stream) of one up program. Defaults: within noise of the
    fastest of the tiles `bench/decode_kernels.py` sweeps at flash-next widths on an H200.
    """
    T, width = streams.shape
    H = width // hc
    rows = rank + (hc if inject else 0)
    dtype, dev = streams.dtype, streams.device
    bt = triton.next_power_of_2(T)
    kc = _pow2_divisor(H, triton.next_power_of_2(chunk))
    bk = min(kc, max(16, _BUDGET // (bt * block_rows)))
    n_chunks = width // kc
    row_blocks = triton.cdiv(rows, block_rows)
    part = torch.empty(n_chunks, T, rows, dtype=torch.float32, device=dev)
    rstd = torch.empty(T, hc, dtype=torch.float32, device=dev)
    act = torch.empty(T, rank, dtype=dtype, device=dev)
    inj = torch.empty(T, hc, dtype=dtype, device=dev)
    out = torch.empty(T, H, dtype=dtype, device=dev)
    round_mode = "rtne" if dtype != torch.float32 else None  # explicit: the interpreter truncates by default
    _hc_down_kernel[(row_blocks, n_chunks)](
        streams, norm_weight, w_down_inject, part, _arrival_counters(dev, row_blocks), rstd, act, inj,
        T, H, rank, rows, n_chunks, eps,
        streams.stride(0), w_down_inject.stride(0), act.stride(0), inj.stride(0),
        S=hc, BT=bt, BR=block_rows, KC=kc, BK=bk, BS=min(triton.next_power_of_2(H), max(16, _BUDGET // (2 * bt))),
        NCP=triton.next_power_of_2(n_chunks), ROUND=round_mode, num_warps=4,
    )
    sp = triton.next_power_of_2(hc)
    _hc_up_mix_kernel[(triton.cdiv(H, block_h),)](
        streams, norm_weight, w_up, act, rstd, out,
        T, H, rank,
        streams.stride(0), w_up.stride(0), act.stride(0), out.stride(0),
        S=hc, SP=sp, BT=bt, BH=block_h, BK=min(triton.next_power_of_2(rank), max(16, _BUDGET // (sp * bt * block_h))),
        ROUND=round_mode, num_warps=4,
    )
    return out, (inj if inject else None)


# ----- batched path (T >= 2): tensor-core GEMMs ---------------------------------------------------------------------

# Enough programs to cover the H200's 132 SMs once; below it the down GEMM splits K (see `_batched_tiles`).
_TARGET_PROGRAMS = 132


@triton.jit(do_not_specialize=["T"])
def _hc_rstd_kernel(x_ptr, rstd_ptr, T, H, eps, stride_x, S: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    s = tl.program_id(1)
    kk = tl.arange(0, BK)
    rows = x_ptr + t.to(tl.int64)[:, None] * stride_x + s * H
    ss = tl.zeros((BT,), dtype=tl.float32)
    for k0 in range(0, H, BK):
        x = tl.load(rows + (k0 + kk)[None, :], mask=t_ok[:, None] & (k0 + kk < H)[None, :], other=0.0)
        ss += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
    tl.store(rstd_ptr + t * S + s, 1.0 / tl.sqrt(ss / H + eps), mask=t_ok)


@triton.jit
def _act_inject_store(d, t, t_ok, rows, r_ok, R, act_ptr, inj_ptr, stride_a, stride_i,
                      S: tl.constexpr, ROUND: tl.constexpr):
    # d: fp32 sums of the down/inject GEMM, rounded first as F.linear's output is
    dtype = act_ptr.dtype.element_ty
    d = d.to(dtype, fp_downcast_rounding=ROUND).to(tl.float32) / S
    t64 = t.to(tl.int64)
    act = d / (1.0 + tl.exp(-d))
    tl.store(act_ptr + t64[:, None] * stride_a + rows[None, :], act.to(dtype, fp_downcast_rounding=ROUND),
             mask=t_ok[:, None] & (rows < R)[None, :])
    inj = 2.0 / (1.0 + tl.exp(-d))
    tl.store(inj_ptr + t64[:, None] * stride_i + tl.maximum(rows - R, 0)[None, :],
             inj.to(dtype, fp_downcast_rounding=ROUND), mask=t_ok[:, None] & ((rows >= R) & r_ok)[None, :])


@triton.jit(do_not_specialize=["T", "KC", "NCHUNKS"])
def _hc_down_mm_kernel(
    x_ptr, nw_ptr, w_ptr, rstd_ptr, part_ptr, count_ptr, act_ptr, inj_ptr,
    T, H, R, NROWS, KC, NCHUNKS, eps,
    stride_x, stride_w, stride_a, stride_i,
    S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    FUSE_RSTD: tl.constexpr, SPLIT: tl.constexpr, ROUND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # row blocks vary fastest, so the programs sharing one token block's A tiles run together and find them in L2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    chunk = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    t = pid_m * BM + tl.arange(0, BM)
    t_ok = t < T
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_x
    rows = pid_n * BN + tl.arange(0, BN)
    r_ok = rows < NROWS
    kk = tl.arange(0, BK)
    k_lo = chunk * KC
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # a K chunk is either part of one stream or whole streams, so each K step has one stream's rstd
    for s in range(k_lo // H, (k_lo + KC - 1) // H + 1):
        if FUSE_RSTD:
            # the chunk covers the whole stream: its sum of squares reads the tiles the GEMM then re-reads from
            # L1/L2, cheaper than a separate pass over streams at prefill sizes
            ss = tl.zeros((BM,), dtype=tl.float32)
            for k0 in range(s * H, s * H + H, BK):
                x = tl.load(x_rows + (k0 + kk)[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
                ss += tl.sum(x * x, axis=1)
            rstd = 1.0 / tl.sqrt(ss / H + eps)
            if pid_n == 0:
                tl.store(rstd_ptr + t * S + s, rstd, mask=t_ok)
        else:
            rstd = tl.load(rstd_ptr + t * S + s, mask=t_ok, other=0.0)
        for k0 in range(tl.maximum(k_lo, s * H), tl.minimum(k_lo + KC, s * H + H), BK):
            x = tl.load(x_rows + (k0 + kk)[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + k0 + kk).to(tl.float32)
            # normed as the reference's RMSNorm returns it (rounded to the model dtype), never written out
            a = (x * rstd[:, None] * (1.0 + nw[None, :])).to(dtype, fp_downcast_rounding=ROUND)
            w = tl.load(w_ptr + rows[None, :] * stride_w + (k0 + kk)[:, None], mask=r_ok[None, :], other=0.0)
            acc = _mma(a, w, acc, PRECISION, UPCAST)

    if SPLIT:
        tile = pid_m * tl.num_programs(0) + pid_n
        part = part_ptr + t.to(tl.int64)[:, None] * NROWS + rows[None, :]
        m = t_ok[:, None] & r_ok[None, :]
        # offsets within the partials buffer (n_chunks * T * rows elements) fit in int32
        tl.store(part + chunk * T * NROWS, acc, mask=m)
        # every thread's partials are written before the release of the arrival count
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == NCHUNKS - 1:
            # the last program of this output tile sums the chunks in a fixed order (deterministic)
            d = tl.zeros((BM, BN), dtype=tl.float32)
            for c in range(0, NCHUNKS):
                d += tl.load(part + c * T * NROWS, mask=m, other=0.0, cache_modifier=".cg")
            _act_inject_store(d, t, t_ok, rows, r_ok, R, act_ptr, inj_ptr, stride_a, stride_i, S, ROUND)
            tl.atomic_xchg(count_ptr + tile, 0)
    else:
        _act_inject_store(acc, t, t_ok, rows, r_ok, R, act_ptr, inj_ptr, stride_a, stride_i, S, ROUND)


@triton.jit(do_not_specialize=["T"])
def _hc_up_mix_mm_kernel(
    x_ptr, nw_ptr, wu_ptr, act_ptr, rstd_ptr, out_ptr,
    T, H, R,
    stride_x, stride_wu, stride_a, stride_o,
    S: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, ROUND: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    h_ok = h < H
    t = tl.program_id(1) * BM + tl.arange(0, BM)
    t_ok = t < T
    t64 = t.to(tl.int64)
    m = t_ok[:, None] & h_ok[None, :]
    kk = tl.arange(0, BK)
    mixed = tl.zeros((BM, BH), dtype=tl.float32)
    for s in tl.static_range(S):
        g = tl.zeros((BM, BH), dtype=tl.float32)
        for k0 in range(0, R, BK):
            k = k0 + kk
            k_ok = k < R
            a = tl.load(act_ptr + t64[:, None] * stride_a + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(wu_ptr + (s * H + h)[None, :] * stride_wu + k[:, None], mask=k_ok[:, None] & h_ok[None, :],
                        other=0.0)
            g = _mma(a, w, g, PRECISION, UPCAST)
        gate = tl.sigmoid(g.to(dtype, fp_downcast_rounding=ROUND).to(tl.float32))
        # normed recomputed from the streams (a second read, ~L2 at decode sizes) rather than stored by the down GEMM
        rstd = tl.load(rstd_ptr + t * S + s, mask=t_ok, other=0.0)
        x = tl.load(x_ptr + t64[:, None] * stride_x + (s * H + h)[None, :], mask=m, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + s * H + h, mask=h_ok, other=0.0).to(tl.float32)
        normed = (x * rstd[:, None] * (1.0 + nw[None, :])).to(dtype, fp_downcast_rounding=ROUND).to(tl.float32)
        mixed += gate * normed
    tl.store(out_ptr + t64[:, None] * stride_o + h[None, :], (mixed / S).to(dtype, fp_downcast_rounding=ROUND),
             mask=m)


def _batched_tiles(T: int, H: int, hc: int, rows: int, block_m=None, block_n=None, chunk=None, block_h=None) -> dict:
    """Tiles of `hc_mix_batched` (overrides win). They change only at a few token counts (`batched_variants`), so
    serving compiles a handful of kernel variants; the K chunk is a runtime argument."""
    width = H * hc
    bm = block_m or (16 if T <= 16 else 32 if T <= 32 else 64)
    # wider row blocks re-read the A tiles fewer times; narrow ones give small T more programs to stream W_down
    bn = block_n or (64 if T <= 256 else 128)
    bh = block_h or (16 if T <= 64 else 32 if T <= 512 else 64)
    bk = min(64, _pow2_divisor(H, 64))
    programs = triton.cdiv(rows, bn) * triton.cdiv(T, bm)
    if chunk is None:
        want = triton.cdiv(_TARGET_PROGRAMS, programs)
        if want <= hc:
            # whole streams per chunk: rstd is fused into the GEMM
            chunk = width // next(d for d in range(want, hc + 1) if hc % d == 0)
        else:
            # the largest power of two dividing H within width / want: at least `want` chunks
            chunk = max(16, _pow2_divisor(H, 1 << ((width // want).bit_length() - 1)))
    if chunk % H == 0:
        assert width % chunk == 0, f"chunk {chunk} must divide the width {width}"
    else:
        assert H % chunk == 0, f"chunk {chunk} must divide the stream width {H} or be a multiple of it"
        bk = min(bk, _pow2_divisor(chunk, 64))
    assert min(bm, bn, bh, bk) >= 16, "tl.dot needs tile dims >= 16"
    return dict(block_m=bm, block_n=bn, block_h=bh, block_k=bk, chunk=chunk, n_chunks=width // chunk,
                fuse_rstd=chunk % H == 0)


def batched_variants(max_tokens: int, H: int, hc: int, rows: int) -> list[int]:
    """The smallest token count (>= 2) of each kernel variant of `hc_mix_batched` up to max_tokens: one call at each
    compiles them all (serving warm-up)."""
    first = {}
    for n in range(2, max_tokens + 1):
        t = _batched_tiles(n, H, hc, rows)
        key = (t["block_m"], t["block_n"], t["block_h"], t["block_k"], t["fuse_rstd"], t["n_chunks"] > 1)
        first.setdefault(key, n)
    return sorted(first.values())


def hc_mix_batched(streams, norm_weight, w_down_inject, w_up, eps: float, hc: int, rank: int, inject: bool,
                   block_m: int | None = None, block_n: int | None = None, chunk: int | None = None,
                   block_h: int | None = None, num_warps: int | None = None):
    """Same contract as `ops.hyper_connection.hc_mix_ref`, for T >= 2 (correct for any T >= 1).

    block_m: tokens of a program (both kernels); block_n: W_down_inject rows of a down program; chunk: its K range
    (a power of two dividing the stream width, or whole streams); block_h: hidden columns (of every stream) of an up
    program. Defaults (`_batched_tiles`) depend on T only.
    """
    T, width = streams.shape
    H = width // hc
    rows = rank + (hc if inject else 0)
    dtype, dev = streams.dtype, streams.device
    tiles = _batched_tiles(T, H, hc, rows, block_m, block_n, chunk, block_h)
    bm, bn, bk, kc, n_chunks = tiles["block_m"], tiles["block_n"], tiles["block_k"], tiles["chunk"], tiles["n_chunks"]
    round_mode = "rtne" if dtype != torch.float32 else None  # explicit: the interpreter truncates by default
    # fp32 callers expect fp32 results (TF32 would lose ~3 digits against the reference)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    upcast = dtype != torch.float32 and os.environ.get("TRITON_INTERPRET", "0") == "1"
    split = n_chunks > 1
    rstd = torch.empty(T, hc, dtype=torch.float32, device=dev)
    act = torch.empty(T, rank, dtype=dtype, device=dev)
    inj = torch.empty(T, hc, dtype=dtype, device=dev)
    out = torch.empty(T, H, dtype=dtype, device=dev)
    row_blocks, token_blocks = triton.cdiv(rows, bn), triton.cdiv(T, bm)
    if not tiles["fuse_rstd"]:
        bt = 16
        _hc_rstd_kernel[(triton.cdiv(T, bt), hc)](streams, rstd, T, H, eps, streams.stride(0), S=hc, BT=bt,
                                                   BK=min(triton.next_power_of_2(H), 256), num_warps=4)
    # without a split the partials and counters are never touched (rstd stands in for both pointers)
    part = torch.empty(n_chunks, T, rows, dtype=torch.float32, device=dev) if split else rstd
    counters = _arrival_counters(dev, row_blocks * token_blocks) if split else rstd
    _hc_down_mm_kernel[(row_blocks, token_blocks, n_chunks)](
        streams, norm_weight, w_down_inject, rstd, part, counters, act, inj,
        T, H, rank, rows, kc, n_chunks, eps,
        streams.stride(0), w_down_inject.stride(0), act.stride(0), inj.stride(0),
        S=hc, BM=bm, BN=bn, BK=bk, FUSE_RSTD=tiles["fuse_rstd"], SPLIT=split, ROUND=round_mode,
        PRECISION=precision, UPCAST=upcast, num_warps=num_warps or (8 if bm * bn >= 8192 else 4),
    )
    bh = tiles["block_h"]
    _hc_up_mix_mm_kernel[(triton.cdiv(H, bh), token_blocks)](
        streams, norm_weight, w_up, act, rstd, out,
        T, H, rank,
        streams.stride(0), w_up.stride(0), act.stride(0), out.stride(0),
        S=hc, BM=bm, BH=bh, BK=min(64, max(16, triton.next_power_of_2(rank))), ROUND=round_mode,
        PRECISION=precision, UPCAST=upcast, num_warps=num_warps or (8 if bm * bh >= 8192 else 4),
    )
    return out, (inj if inject else None)
