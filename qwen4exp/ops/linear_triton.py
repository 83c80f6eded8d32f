"""y = x @ W^T for one token in one Triton launch: the decode fast path of `ops.linear.linear` (F.linear is the
reference). The kernel takes any T; `ops.linear.gemv_max_tokens` says up to which T it is dispatched.

At decode every projection is a matrix-vector product that must stream its whole weight once, and cuBLAS runs the
flash-next widths well below HBM bandwidth (out_proj/o_proj [2560, 6144]: 10.5 us + a 1.7 us split-K reduction
against 7.3 us of bandwidth; the MoE router + shared expert [1416, 2560]: 7.8 us against 1.7 us).

Each program owns BLOCK_N whole rows of W and walks all of K, so there is no split-K reduction: at the dispatched
widths the rows alone give hundreds to thousands of programs (N / BLOCK_N), and each output is one program's
fixed-order sum (deterministic; nothing but the output is written, one launch). The K loop is unrolled (K is a
compile-time constant): Triton does not pipeline loads that feed no tl.dot, whatever num_stages says, but in
straight-line code ptxas issues later chunks' loads ahead of this chunk's FMAs (8-16 vector loads deep in the sm_90
SASS). Measured per call on the H200: see `default_tiles`. Weight loads are evict-first (read once); x is
re-read from L1/L2 by every program. x and W are both loaded at the accumulator's shape [BT, BLOCK_N, BLOCK_K] (x's
rows repeat), so both land in the same vectorised layout: with x loaded as [BT, 1, BLOCK_K], Triton converted the
weight tile through shared memory on every chunk for some tiles.
"""

import torch
import triton
import triton.language as tl

from . import tuning
from ._triton_utils import INTERPRETED, launch_options, pdl_start

# the K loop is unrolled: longer rows would only grow the kernel's code
_MAX_K = 16384
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _gemv_weights(w_ptr, rows3, stride_w, k, N, K):
    return tl.load(w_ptr + rows3 * stride_w + k, mask=(rows3 < N) & (k < K), other=0.0, eviction_policy="evict_first")


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, T, N, stride_x, stride_w, stride_y,
    K: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr,
    PDL: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows3 = rows[None, :, None]
    kk = tl.arange(0, BLOCK_K)[None, None, :]
    # the first PRE chunks of weights before the wait: no kernel writes weights, so under PDL that read overlaps
    # the kernel before this one
    ahead = ()
    for i in tl.static_range(PRE):
        ahead = ahead + (_gemv_weights(w_ptr, rows3, stride_w, i * BLOCK_K + kk, N, K),)
    pdl_start(PDL)
    t = tl.arange(0, BT)
    t3 = t[:, None, None]
    acc = tl.zeros((BT, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k = k0 + kk
        if k0 < PRE * BLOCK_K:
            w = ahead[k0 // BLOCK_K]
        else:
            w = _gemv_weights(w_ptr, rows3, stride_w, k, N, K)
        # x at the full tile shape (its rows repeat, L1 hits): loaded in the weight's layout, nothing to convert
        x = tl.load(x_ptr + t3 * stride_x + rows3 * 0 + k, mask=(t3 < T) & (k < K), other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)
    y = tl.sum(acc, axis=2).to(y_ptr.dtype.element_ty)  # round to nearest even
    tl.store(y_ptr + t[:, None] * stride_y + rows[None, :], y, mask=(t < T)[:, None] & (rows < N)[None, :])


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Unit-stride rows of one float dtype, 16-byte aligned rows (vector loads), int32 offsets."""
    return (x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] and x.shape[1] == weight.shape[1]
            and x.shape[1] <= _MAX_K
            and x.dtype == weight.dtype and x.dtype in _DTYPES and x.stride(1) == 1 and weight.stride(1) == 1
            and weight.stride(0) * weight.element_size() % 16 == 0 and weight.data_ptr() % 16 == 0
            and weight.shape[0] * weight.stride(0) < 2**31)


def default_tiles(tokens: int, n: int, k: int, element_size: int = 2) -> dict:
    """Tiles from static shapes only (a captured graph keeps its kernel). A K chunk of 32 lanes x 16 bytes gives each
    lane of a warp one vector load per row, and the row sum stays within the warp. One row per one-warp program was
    fastest at K = 2560 and four rows per four-warp program with 32-byte loads at K = 6144 (H200, T = 1: router + shared
    expert [1416, 2560] 3.7 us, GDN in_proj [16480, 2560] 20.5 us, attention q/k/v [13952, 2560] 18.2 us, out_proj
    [2560, 6144] 9.4 us; cuBLAS 8.2, 22.9, 20.7, 12.1)."""
    lane_k = 16 // element_size * 32
    if k >= 4096:
        return dict(block_n=4, block_k=min(2 * lane_k, triton.next_power_of_2(k)), num_warps=4)
    return dict(block_n=1, block_k=min(lane_k, triton.next_power_of_2(k)), num_warps=1)


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
         num_warps: int | None = None, steps_ahead: int | None = None) -> torch.Tensor:
    """F.linear(x, weight) for x [T, K], weight [N, K] (any T; `supported` says when it is dispatched). Tiles default
    to `default_tiles`; steps_ahead, the chunks of weights read before the PDL wait, to `tuning.gemv_steps_ahead`."""
    T, K = x.shape
    N = weight.shape[0]
    tiles = default_tiles(T, N, K, x.element_size())
    if INTERPRETED:  # the interpreter runs every program in Python: a few wide ones (the sums are the same)
        tiles["block_n"] = min(64, triton.next_power_of_2(N))
    block_n, block_k = block_n or tiles["block_n"], block_k or tiles["block_k"]
    num_warps = num_warps or tiles["num_warps"]
    programs = triton.cdiv(N, block_n)
    ahead = steps_ahead
    if ahead is None:
        ahead = tuning.gemv_steps_ahead(programs, triton.cdiv(K, block_k), block_n * block_k * x.element_size(),
                                        num_warps)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(programs,)](
        x, weight, y, T, N, x.stride(0), weight.stride(0), y.stride(0),
        K=K, BT=triton.next_power_of_2(T), BLOCK_N=block_n, BLOCK_K=block_k, PRE=ahead,
        num_warps=num_warps, **launch_options(x)
    )
    return y
