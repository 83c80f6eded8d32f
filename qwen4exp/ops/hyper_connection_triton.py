"""Hyper-connection kernels: the mix of one token in two Triton launches (the batch-1 decode fast path of
`ops.hyper_connection.hc_mix`, whose compiled form is eight kernels (cuBLAS split-K GEMV + its reduction, two
GEMVs' worth of fused elementwise kernels; ~15 us per call, 96 calls per decode step).

streams [T, S*H] (S streams of width H), norm weight [S*H], W_down_inject [R (+S) (+padding), S*H], W_up [S*H, R].
Both GEMMs are matrix-vector products at decode that must stream 6.5 MB of weights each, so each is split over
hundreds of programs with one (or few) wide loads apiece; a loop of small dependent loads per program is latency
bound (137 us per call measured for such a loop).

  `_hc_down_kernel`, grid (row blocks, K chunks): applies the previous block's pending combine to one K chunk (the
      first row block stores the combined streams), normalises it (normed = x * rstd * (1 + w), rounded to the
      model dtype as the reference rounds it; the stream's RMS is recomputed from the L2-resident activations)
      and writes BR partial dot products. The last program of a row block to finish (a per-row-block arrival
      counter) sums the chunks' partials, rounds them as the reference's GEMM output, and writes act = silu(d / S)
      for the R down rows and inject = 2 sigmoid(d / S) for the S inject rows, then re-arms the counter.
      (Programs that take whole streams, with no counter and the up kernel summing the S partials of its rows,
      measured 12.56 against 12.4 us a mix at flash-next's widths on an H100: faster only at narrow widths.)
  `_hc_up_mix_kernel`, grid (hidden blocks): gate = sigmoid(act @ W_up^T) for all S streams, then
      mixed = mean_s gate * normed.

Both kernels load weights before `pdl_start` (the down kernel its first tile, the up kernel its first four):
weights are written by no kernel, so under PDL that read overlaps the kernel before. The up kernel holds its tiles
in registers, not in a loop over tiles: 80 registers a thread instead of 128, so its 640 programs at flash-next's
widths are resident at once (one H100, one token: 13.9 -> 12.4 us a mix). It wins only at one token
(`ops.tuning.HC_DECODE_MAX_TOKENS`).

From two tokens on, `hc_prenorm` is the mix's first pass instead: the pending combine of the previous block (if any)
and the per-stream RMSNorm in one launch over the streams, which inductor compiles into three kernels (combine,
sum of squares, normalise), each reading the [T, S*H] streams. The GEMMs and gates then run compiled
(`ops.hyper_connection.hc_mix_normed`, or `hc_mix_partials` from the down projection's fp32 partial products).
"""

import torch
import triton
import triton.language as tl

from . import tuning
from ._triton_utils import INTERPRETED, launch_options, pdl_start, round_to, rounding

# products held per program (fp32 values): ~64 registers a thread at 4 warps
_BUDGET = 8192


@triton.jit
def _stream_values(x_ptr, o_ptr, inj_ptr, t, t_ok, cols, stream, H, stride_x, stride_o, stride_i,
                   COMBINE: tl.constexpr, BF16: tl.constexpr):
    """The streams' values at columns `cols` of one stream, in fp32: with COMBINE, after the pending combine
    (x + o * inject_stream, the product rounded to the model dtype, then the sum, as the eager combine rounds)."""
    m = t_ok[:, None] & (cols < (stream + 1) * H)[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)
    if COMBINE:
        dtype = x_ptr.dtype.element_ty
        o = tl.load(o_ptr + t[:, None] * stride_o + (cols - stream * H)[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(inj_ptr + t * stride_i + stream, mask=t_ok, other=0.0).to(tl.float32)
        x = round_to(x + round_to(o * w[:, None], dtype, BF16), dtype, BF16)
    return x


@triton.jit
def _hc_down_kernel(
    x_ptr, o_ptr, inj_in_ptr, new_ptr, nw_ptr, w_ptr, part_ptr, count_ptr, rstd_ptr, act_ptr, inj_ptr,
    T, H, R, NROWS, NCHUNKS, eps,
    stride_x, stride_o, stride_ii, stride_new, stride_w, stride_a, stride_i,
    S: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, KC: tl.constexpr, BK: tl.constexpr,
    BS: tl.constexpr, NCP: tl.constexpr, COMBINE: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr,
    PDL: tl.constexpr
):
    rb = tl.program_id(0)
    chunk = tl.program_id(1)
    k_start = chunk * KC
    stream = k_start // H
    rows = rb * BR + tl.arange(0, BR)
    r_ok = rows < NROWS
    kk = tl.arange(0, BK)
    # the first weight tile before the wait: no kernel writes weights, so under PDL its read overlaps the kernel
    # before this one
    w_first = tl.load(w_ptr + rows[:, None] * stride_w + (k_start + kk)[None, :], mask=r_ok[:, None], other=0.0)
    pdl_start(PDL)
    t = tl.arange(0, BT)
    t_ok = t < T
    ss = tl.zeros((BT,), dtype=tl.float32)
    for k0 in range(0, H, BS):
        x = _stream_values(x_ptr, o_ptr, inj_in_ptr, t, t_ok, stream * H + k0 + tl.arange(0, BS), stream, H,
                           stride_x, stride_o, stride_ii, COMBINE, BF16)
        ss += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    if (rb == 0) & (k_start == stream * H):
        tl.store(rstd_ptr + t * S + stream, rstd, mask=t_ok)

    acc = tl.zeros((BT, BR, BK), dtype=tl.float32)
    for k0 in range(k_start, k_start + KC, BK):
        if k0 == k_start:
            w = w_first
        else:
            w = tl.load(w_ptr + rows[:, None] * stride_w + (k0 + kk)[None, :], mask=r_ok[:, None], other=0.0)
        x = _stream_values(x_ptr, o_ptr, inj_in_ptr, t, t_ok, k0 + kk, stream, H, stride_x, stride_o, stride_ii,
                           COMBINE, BF16)
        if COMBINE:
            if rb == 0:  # one row block writes the combined streams
                tl.store(new_ptr + t[:, None] * stride_new + (k0 + kk)[None, :],
                         x.to(new_ptr.dtype.element_ty), mask=t_ok[:, None])
        nw = tl.load(nw_ptr + k0 + kk).to(tl.float32)
        normed = (x * rstd[:, None] * (1.0 + nw[None, :]))
        normed = normed.to(x_ptr.dtype.element_ty, fp_downcast_rounding=ROUND).to(tl.float32)
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
def _up_tile(wu_rows, wu_ok, k, R):
    return tl.load(wu_rows + k[None, None, :], mask=wu_ok & (k < R)[None, None, :], other=0.0)


@triton.jit
def _hc_up_mix_kernel(
    x_ptr, nw_ptr, wu_ptr, act_ptr, rstd_ptr, out_ptr,
    T, H, R,
    stride_x, stride_wu, stride_a, stride_o,
    S: tl.constexpr, SP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    ROUND: tl.constexpr, PDL: tl.constexpr,
):
    h = tl.program_id(0) * BH + tl.arange(0, BH)
    h_ok = h < H
    s_idx = tl.arange(0, SP)
    s_ok = s_idx < S
    kk = tl.arange(0, BK)
    wu_rows = wu_ptr + (s_idx[:, None, None] * H + h[None, :, None]) * stride_wu
    wu_ok = s_ok[:, None, None] & h_ok[None, :, None]
    # the program's NK column tiles of W_up (up to 4 of them) before the wait
    w0 = _up_tile(wu_rows, wu_ok, kk, R)
    if NK > 1:
        w1 = _up_tile(wu_rows, wu_ok, BK + kk, R)
    if NK > 2:
        w2 = _up_tile(wu_rows, wu_ok, 2 * BK + kk, R)
    if NK > 3:
        w3 = _up_tile(wu_rows, wu_ok, 3 * BK + kk, R)
    pdl_start(PDL)
    dtype = out_ptr.dtype.element_ty
    t = tl.arange(0, BT)
    t_ok = t < T
    g = tl.zeros((SP, BT, BH), dtype=tl.float32)
    for i in tl.static_range(NK):
        k = i * BK + kk
        a = tl.load(act_ptr + t[:, None] * stride_a + k[None, :], mask=t_ok[:, None] & (k < R)[None, :],
                    other=0.0).to(tl.float32)
        if i == 0:
            w = w0
        elif i == 1:
            w = w1
        elif i == 2:
            w = w2
        elif i == 3:
            w = w3
        else:
            w = _up_tile(wu_rows, wu_ok, k, R)
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


@triton.jit
def _hc_prenorm_kernel(
    s_ptr, o_ptr, inj_ptr, nw_ptr, new_ptr, normed_ptr,
    T, H, eps,
    stride_s, stride_o, stride_op, stride_i, stride_new, stride_n,
    COMBINE: tl.constexpr, PARTS: tl.constexpr, BT: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
    S: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    # one flat grid, a token block's S streams adjacent: programs that run side by side read a token's row whole
    # (with a (tokens, streams) grid it was read in S parts far apart in time; H200, 8192 tokens: 166.9 -> 134.7 us)
    t = (tl.program_id(0) // S).to(tl.int64) * BT + tl.arange(0, BT)
    stream = tl.program_id(0) % S
    dtype = normed_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK)
    if BT == 1:  # the grid holds exactly T tokens: no mask (its compare cost the GPU's one-token programs ~1.5%)
        t_ok = tl.full([BT], 1, tl.int1)
    else:
        t_ok = t < T
    m = t_ok[:, None] & (h < H)[None, :]
    x = tl.load(s_ptr + t[:, None] * stride_s + stream * H + h[None, :], mask=m, other=0.0).to(tl.float32)
    if COMBINE:
        # as the eager combine rounds: the product to the model dtype, then the sum
        o_at = o_ptr + t[:, None] * stride_o + h[None, :]
        if PARTS:  # fp32 partial products of the block output, summed and rounded as the projection's output
            o = tl.load(o_at, mask=m, other=0.0)
            for p in tl.static_range(1, PARTS):
                o += tl.load(o_at + p * stride_op, mask=m, other=0.0)
            o = o.to(dtype, fp_downcast_rounding=ROUND).to(tl.float32)
        else:
            o = tl.load(o_at, mask=m, other=0.0).to(tl.float32)
        w = tl.load(inj_ptr + t * stride_i + stream, mask=t_ok, other=0.0).to(tl.float32)
        x = x + (o * w[:, None]).to(dtype, fp_downcast_rounding=ROUND).to(tl.float32)
        x = x.to(dtype, fp_downcast_rounding=ROUND)
        tl.store(new_ptr + t[:, None] * stride_new + stream * H + h[None, :], x, mask=m)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
    nw = tl.load(nw_ptr + stream * H + h, mask=h < H, other=0.0).to(tl.float32)
    normed = x * rstd[:, None] * (1.0 + nw[None, :])
    tl.store(normed_ptr + t[:, None] * stride_n + stream * H + h[None, :],
             normed.to(dtype, fp_downcast_rounding=ROUND), mask=m)


def prenorm_supported(streams: torch.Tensor, hc: int) -> bool:
    """A stream of at most 16384 values fits one program's registers."""
    return streams.dim() == 2 and streams.stride(1) == 1 and streams.shape[1] % hc == 0 and (
        streams.shape[1] // hc <= 16384)


def hc_prenorm(streams, norm_weight, eps: float, hc: int, block_out=None, inject=None, block_tokens=None):
    """(streams + block_out * inject_s on every stream s when block_out is given, else streams; and that tensor's
    per-stream RMSNorm rms_norm(., norm_weight, eps, group_size=H)), rounded as the eager reference rounds them.
    streams [T, hc*H]; block_out [T, H], or fp32 partial products of it [T, P, H] (rounded to the streams' dtype
    after their sum, as the product's GEMM rounds it); inject [T, hc].

    block_tokens: the tokens of one program (one stream of each). Default: one on the GPU; in the interpreter, where
    programs run one after another at Python's cost per operation, up to 65,536 values' worth (64 tokens of width
    64, four streams: 1016 -> 34 ms)."""
    T, width = streams.shape
    H = width // hc
    combine = block_out is not None
    parts = block_out.shape[1] if combine and block_out.dim() == 3 else 0
    if parts:
        assert block_out.dtype == torch.float32 and block_out.stride(2) == 1, "partials: fp32, unit stride in H"
    new = torch.empty_like(streams) if combine else streams
    normed = torch.empty_like(streams)
    if T:
        block = triton.next_power_of_2(H)
        bt = block_tokens or (min(triton.next_power_of_2(T), max(1, 65536 // block)) if INTERPRETED else 1)
        _hc_prenorm_kernel[(triton.cdiv(T, bt) * hc,)](
            streams, block_out if combine else streams, inject if combine else streams, norm_weight, new, normed,
            T, H, eps,
            streams.stride(0), block_out.stride(0) if combine else 0, parts and block_out.stride(1),
            inject.stride(0) if combine else 0, new.stride(0), normed.stride(0),
            COMBINE=combine, PARTS=parts, BT=bt, BLOCK=block, ROUND=rounding(streams.dtype),
            S=hc,
            num_warps=max(1, min(8, block // 512)),
            # else the product and the sum become one bf16 FMA (one rounding where the eager combine has two)
            enable_fp_fusion=False, **launch_options(streams)
        )
    return new, normed


def _pow2_divisor(n: int, cap: int) -> int:
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


_counters: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters that every call leaves zeroed again (so a CUDA graph can replay the kernel)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = _counters[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def supported(streams: torch.Tensor, hc: int) -> bool:
    """A stream width with a power-of-two block of at least 16 (K chunks must not straddle streams); any T."""
    return _pow2_divisor(streams.shape[1] // hc, 1024) >= 16 and streams.stride(1) == 1


def hc_mix_decode(streams, norm_weight, w_down_inject, w_up, eps: float, hc: int, rank: int, inject: bool,
                  block_out=None, block_inject=None, block_rows: int | None = None, chunk: int = 512,
                  block_h: int | None = None, up_chunk: int | None = None):
    """Same contract as `ops.hyper_connection.hc_mix` with block_out [T, H] or None (dispatched to for `supported`
    inputs; correct for any T): returns (streams after the pending combine, block input, injection weights or None).

    block_rows x chunk: the W_down_inject tile of one down program (chunk is cut to a power of two dividing the
    stream width); block_h: hidden columns (of every stream) of one up program, which reads its W_up rows in tiles of
    up_chunk columns (a power of two; default: as many as its register budget holds), its first four tiles before
    the wait for the down kernel (smaller tiles: fewer registers, more programs resident at once). Defaults on the
    GPU: block_h 4, block_rows tuning.HC_DECODE_BLOCK_ROWS by width (`bench_hyper_connection.py --sweep`). In
    the interpreter, where programs run one after another and each costs Python's overhead per operation, the
    defaults are one row block and one up program (the tiny preset, one token: 227 -> 63 ms a mix).
    """
    T, width = streams.shape
    H = width // hc
    rows = rank + (hc if inject else 0)
    if block_rows is None:
        block_rows = (triton.next_power_of_2(rows) if INTERPRETED
                      else tuning.HC_DECODE_BLOCK_ROWS[width <= tuning.HC_DECODE_SMALL_WIDTH])
    if block_h is None:
        block_h = triton.next_power_of_2(H) if INTERPRETED else 4
    dtype, dev = streams.dtype, streams.device
    combine = block_out is not None
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
    new = torch.empty_like(streams) if combine else streams
    _hc_down_kernel[(row_blocks, n_chunks)](
        streams, block_out if combine else streams, block_inject if combine else streams, new, norm_weight,
        w_down_inject, part, _arrival_counters(dev, row_blocks), rstd, act, inj,
        T, H, rank, rows, n_chunks, eps,
        streams.stride(0), block_out.stride(0) if combine else 0, block_inject.stride(0) if combine else 0,
        new.stride(0), w_down_inject.stride(0), act.stride(0), inj.stride(0),
        S=hc, BT=bt, BR=block_rows, KC=kc, BK=bk, BS=min(triton.next_power_of_2(H), max(16, _BUDGET // (2 * bt))),
        NCP=triton.next_power_of_2(n_chunks), COMBINE=combine, BF16=dtype == torch.bfloat16, ROUND=rounding(dtype),
        num_warps=4,
        # else the combine's product and sum become one FMA (one rounding where the eager combine has two)
        enable_fp_fusion=not combine, **launch_options(streams)
    )
    sp = triton.next_power_of_2(hc)
    up_k = up_chunk or min(triton.next_power_of_2(rank), max(16, _BUDGET // (sp * bt * block_h)))
    _hc_up_mix_kernel[(triton.cdiv(H, block_h),)](
        new, norm_weight, w_up, act, rstd, out,
        T, H, rank,
        new.stride(0), w_up.stride(0), act.stride(0), out.stride(0),
        S=hc, SP=sp, BT=bt, BH=block_h, BK=up_k, NK=triton.cdiv(rank, up_k),
        ROUND=rounding(dtype), num_warps=4, **launch_options(streams)
    )
    return new, out, (inj if inject else None)
