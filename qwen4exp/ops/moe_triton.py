"""Fused MoE experts (SwiGLU) in Triton: the fast path of `qwen4exp.ops.moe.moe_experts`.

Computes, for every token n,

    out[n] = sum_j  w[n, j] * down_e (silu(gate_e x[n]) * up_e x[n]),   e = topk_ids[n, j]

with gate_e = gate_up[e, :I] and up_e = gate_up[e, I:].

Shapes / dtypes:
    x             [N, H]      bf16 (fp16 / fp32 also work; fp32 uses IEEE dots so it matches the reference)
    gate_up       [E, 2I, H]  x's dtype (gate rows first)
    down          [E, H, I]   x's dtype
    topk_ids      [N, k]      int64 or int32
    topk_weights  [N, k]      any float dtype (applied in fp32)
    returns       [N, H]      x's dtype

Pipeline (all steps have static shapes and never sync with the host, so it can be captured in a CUDA graph):
    1. `moe_align` sorts the N*k (token, slot) pairs by expert and pads each expert's run to a multiple of BLOCK_M,
       so every BLOCK_M-row block belongs to exactly one expert.
    2. `_gate_up_kernel`: per block, gathers the x rows and computes silu(gate) * up with both halves in fp32
       accumulators, writing the activation [padded pairs, I] in sorted order (so kernel 2 reads it contiguously).
    3. `_down_kernel`: per block, down projection with the routing weight folded into the epilogue; rows are
       scattered back to their pair index n*k + j of an [N*k, H] buffer.
    4. `sum_pairs`: the k rows of each token are summed in fp32 (deterministic, no atomics), with the gated shared
       expert added in the same pass when given.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import fp8_triton
from ._triton_utils import INTERPRETED, launch_options, pdl_start, round_to, rounding
from .fp8_triton import groups_per_step, quantize_groups, to_dtype

# the activations' dtype as the fp8 kernels name it (they round to it by hand where the interpreter would truncate)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# ---------------------------------------------------------------------------------------------------------------------
# Alignment
# ---------------------------------------------------------------------------------------------------------------------


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of `block_m`.

    topk_ids: [N, k] int64/int32. With M = N*k, returns
        sorted_token_ids [num_blocks * block_m] int32: pair index n*k + j in expert order; padding holds M.
        expert_ids       [num_blocks] int32: expert of each block; -1 for blocks at or past the padded count.
        num_tokens_post_padded [1] int32: number of rows in use (a multiple of block_m), on the device.
    num_blocks = min(M, (M + E*(block_m - 1)) // block_m) is the worst case, fixed by the shapes alone: each used
    block holds at least one real pair, and each expert adds less than one block of padding. Pairs of one expert keep
    their original order (stable sort).
    """
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    num_blocks = min(num_pairs, (num_pairs + num_experts * (block_m - 1)) // block_m)
    flat = topk_ids.reshape(-1).to(torch.int64)

    # scatter_add instead of bincount: bincount's output size depends on the data, so it syncs on CUDA.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    starts = torch.cumsum(counts, 0) - counts

    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_pairs, device=device) - starts[sorted_experts]
    dest = padded_starts[sorted_experts] + rank

    sorted_token_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))

    # Experts with no pairs have an empty run, so right=True skips past them to the expert that owns the block.
    block_starts = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True, out_int32=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    num_tokens_post_padded = padded_ends[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


@triton.jit(do_not_specialize=["P", "NUM_BLOCKS", "TAIL"])
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr, P, E, NUM_BLOCKS,
                      BLOCK_M: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr, NBB: tl.constexpr,
                      TAIL, PDL: tl.constexpr):
    """moe_align with one program per expert. Every program histograms all pairs (cheap at decode sizes) to find
    where its expert's padded run starts, then writes its pairs in their original order (a running count), pads
    its run and names its blocks; program 0 also writes the unused tail and the padded total. Nothing has to be
    filled beforehand."""
    pdl_start(PDL)
    e = tl.program_id(0)
    i = tl.arange(0, PB)
    x = tl.arange(0, EB)
    expert = tl.load(ids_ptr + i, mask=i < P, other=E).to(tl.int32)  # padding pairs land in bin E, never used
    counts = tl.where(x < E, tl.histogram(expert, EB), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, axis=0)
    start = tl.sum(tl.where(x == e, padded_ends - padded, 0), axis=0)
    count = tl.sum(tl.where(x == e, counts, 0), axis=0)
    run = tl.sum(tl.where(x == e, padded, 0), axis=0)
    mine = expert == e
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    tl.store(sorted_ptr + start + rank, i, mask=mine)
    m = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + count + m, tl.zeros([BLOCK_M], dtype=tl.int32) + P, mask=count + m < run)
    b = tl.arange(0, NBB)
    tl.store(expert_ids_ptr + b, tl.zeros([NBB], dtype=tl.int32) + e,
             mask=(b * BLOCK_M >= start) & (b * BLOCK_M < start + run))
    if e == 0:
        total = tl.sum(padded, axis=0)
        tl.store(expert_ids_ptr + b, tl.full([NBB], -1, dtype=tl.int32), mask=(b * BLOCK_M >= total)
                 & (b < NUM_BLOCKS))
        r = tl.arange(0, 1024)
        for off in range(0, TAIL, 1024):
            tl.store(sorted_ptr + total + off + r, tl.zeros([1024], dtype=tl.int32) + P,
                     mask=total + off + r < NUM_BLOCKS * BLOCK_M)
        tl.store(post_pad_ptr, total)


# every program holds all pairs (and its blocks' expert ids) in registers
ALIGN_KERNEL_MAX_PAIRS = 4096
ALIGN_KERNEL_SMALL_PAIRS = 1024


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Same contract as moe_align, in one launch of one program per expert instead of about a dozen torch ops with
    a radix sort. For up to ALIGN_KERNEL_MAX_PAIRS pairs."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    assert num_pairs <= ALIGN_KERNEL_MAX_PAIRS
    num_blocks = min(num_pairs, (num_pairs + num_experts * (block_m - 1)) // block_m)
    flat = topk_ids.reshape(-1)
    sorted_token_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_tokens_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    # the padded total is at least num_pairs, so the tail past it is shorter than the expert padding, E*(block_m-1)
    tail = min(num_blocks * block_m, num_experts * (block_m - 1))
    # Two register widths only (each width is a compiled variant): decode batches, and everything up to the limit.
    pb = ALIGN_KERNEL_SMALL_PAIRS if num_pairs <= ALIGN_KERNEL_SMALL_PAIRS else ALIGN_KERNEL_MAX_PAIRS
    max_blocks = min(pb, (pb + num_experts * (block_m - 1)) // block_m)
    _moe_align_kernel[(num_experts,)](flat, sorted_token_ids, expert_ids, num_tokens_post_padded, num_pairs,
                                      num_experts, num_blocks, BLOCK_M=block_m, PB=pb,
                                      EB=triton.next_power_of_2(num_experts + 1),
                                      NBB=triton.next_power_of_2(max_blocks), TAIL=tail, num_warps=4,
                                      **launch_options(flat))
    return sorted_token_ids, expert_ids, num_tokens_post_padded


# ---------------------------------------------------------------------------------------------------------------------
# Expert order of the grouped path (prefill): a stable counting sort in three launches
# ---------------------------------------------------------------------------------------------------------------------

# pairs a program of the count and place launches takes; the place launch ranks them SORT_SUB at a time
SORT_BLOCK = 1024
SORT_SUB = 64


@triton.jit(do_not_specialize=["P"])  # varies with the step's tokens
def _sort_count_kernel(ids_ptr, counts_ptr, P, E, BLOCK: tl.constexpr, EB: tl.constexpr, PDL: tl.constexpr):
    """counts[b, e]: pairs of block b routed to expert e."""
    pdl_start(PDL)
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + i, mask=i < P, other=E).to(tl.int32)  # past the end: bin E, never stored
    x = tl.arange(0, EB)
    tl.store(counts_ptr + b * E + x, tl.histogram(expert, EB), mask=x < E)


@triton.jit(do_not_specialize=["NB"])  # varies with the step's tokens
def _sort_base_kernel(counts_ptr, base_ptr, offs_ptr, NB, E, RB: tl.constexpr, EB: tl.constexpr, PDL: tl.constexpr):
    """One program: offs[e] = pairs of experts <= e (the grouped GEMM's group ends); base[b, e] = where block b's
    first pair of expert e goes (pairs of experts < e, then of expert e in blocks < b)."""
    pdl_start(PDL)
    x = tl.arange(0, EB)
    r = tl.arange(0, RB)
    x_ok = x < E
    totals = tl.zeros([EB], dtype=tl.int32)
    for b0 in range(0, NB, RB):
        m = ((b0 + r) < NB)[:, None] & x_ok[None, :]
        totals += tl.sum(tl.load(counts_ptr + (b0 + r)[:, None] * E + x[None, :], mask=m, other=0), axis=0)
    ends = tl.cumsum(totals, axis=0)
    tl.store(offs_ptr + x, ends, mask=x_ok)
    carry = ends - totals
    for b0 in range(0, NB, RB):
        m = ((b0 + r) < NB)[:, None] & x_ok[None, :]
        tile = tl.load(counts_ptr + (b0 + r)[:, None] * E + x[None, :], mask=m, other=0)
        tl.store(base_ptr + (b0 + r)[:, None] * E + x[None, :], carry[None, :] + tl.cumsum(tile, axis=0) - tile,
                 mask=m)
        carry += tl.sum(tile, axis=0)


@triton.jit(do_not_specialize=["P"])  # varies with the step's tokens
def _sort_place_kernel(ids_ptr, base_ptr, order_ptr, rows_ptr, P, E, BLOCK: tl.constexpr, SUB: tl.constexpr,
                       EB: tl.constexpr, PDL: tl.constexpr):
    """Each pair's sorted position: its block's base for its expert plus the pairs of the same expert before it in
    the block (a running count per expert, then a cumulative sum over SUB pairs at a time). rows[pair] = position,
    order[position] = pair."""
    pdl_start(PDL)
    b = tl.program_id(0)
    x = tl.arange(0, EB)
    running = tl.load(base_ptr + b * E + x, mask=x < E, other=0)
    for s in range(0, BLOCK, SUB):
        i = b * BLOCK + s + tl.arange(0, SUB)
        ok = i < P
        expert = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
        onehot = ((expert[:, None] == x[None, :]) & ok[:, None]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs ahead of it in this chunk
        pos = tl.sum(onehot * (running[None, :] + before), axis=1)
        tl.store(rows_ptr + i, pos.to(tl.int64), mask=ok)
        tl.store(order_ptr + pos, i.to(tl.int64), mask=ok)
        running += tl.sum(onehot, axis=0)


def sort_pairs(topk_ids: torch.Tensor, num_experts: int):
    """The N*k (token, slot) pairs of topk_ids [N, k] in expert order, ties in pair order (stable), in three launches
    (block histograms, one scan program, placement) instead of torch's radix sort, scatter_add, cumsum and
    inverse-permutation scatter (~14 kernels). Returns order [N*k] int64 (the pair at each sorted position), offs [E]
    int32 (the end of each expert's run: the grouped GEMM's offsets) and rows [N*k] int64 (each pair's sorted
    position, the inverse of order)."""
    flat = topk_ids.reshape(-1)
    P, dev = flat.numel(), flat.device
    nb = triton.cdiv(P, SORT_BLOCK)
    eb = triton.next_power_of_2(num_experts)
    order = torch.empty(P, dtype=torch.int64, device=dev)
    rows = torch.empty(P, dtype=torch.int64, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    if P == 0:
        offs.zero_()
        return order, offs, rows
    counts = torch.empty(nb, num_experts, dtype=torch.int32, device=dev)
    base = torch.empty(nb, num_experts, dtype=torch.int32, device=dev)
    _sort_count_kernel[(nb,)](flat, counts, P, num_experts, BLOCK=SORT_BLOCK,
                              EB=triton.next_power_of_2(num_experts + 1), num_warps=4, **launch_options(flat))
    _sort_base_kernel[(1,)](counts, base, offs, nb, num_experts, RB=16, EB=eb, num_warps=4, **launch_options(counts))
    _sort_place_kernel[(nb,)](flat, base, order, rows, P, num_experts, BLOCK=SORT_BLOCK, SUB=SORT_SUB, EB=eb,
                              num_warps=4, **launch_options(flat))
    return order, offs, rows


@triton.jit
def _spread_rows_kernel(x_ptr, rows_ptr, out_ptr, hidden, stride_x, stride_o,
                        TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    v = tl.load(x_ptr + token * stride_x + offs, mask=ok)
    for j in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + token * TOP_K + j).to(tl.int64)
        tl.store(out_ptr + row * stride_o + offs, v, mask=ok)


def spread_rows(x: torch.Tensor, rows: torch.Tensor, top_k: int, block: int = 4096) -> torch.Tensor:
    """The grouped GEMM's input in expert order: out[rows[n*k + j]] = x[n], i.e. `x[order // top_k]` for sort_pairs'
    order. Each token's row is read once and written k times, where the gather reads a token's row again for each
    of its k sorted positions (H200, k = 10, H = 2560: 16k tokens 475.6 -> 253.8 us, 8k 222.3 -> 126.7; a whole row
    a program was the best of 256-4096 columns, by ~3%)."""
    num_tokens, hidden = x.shape
    assert rows.numel() == num_tokens * top_k and x.stride(1) == 1
    out = torch.empty(rows.numel(), hidden, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(block, triton.next_power_of_2(hidden))
        _spread_rows_kernel[(num_tokens, triton.cdiv(hidden, block))](
            x, rows.reshape(-1), out, hidden, x.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
            num_warps=4, **launch_options(x))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # shared by both kernels: it is the alignment of the sorted pairs
    gate_up: Tile
    down: Tile


def get_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int) -> MoEConfig:
    """Hopper-oriented defaults chosen from the static problem shape (so the choice is fixed inside a graph).

    BLOCK_M follows the mean number of rows per expert: with fewer rows than the block, the extra rows are wasted
    MMA work, and decode is bound by reading expert weights anyway. Small problems use narrow N tiles so that the
    few active experts are still split over enough programs to keep HBM busy.
    """
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        return MoEConfig(
            block_m=16,
            gate_up=Tile(block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4),
            down=Tile(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4),
        )
    if rows_per_expert <= 48:
        # H200, swept at 256 tokens: 324.5 us a layer against 343.4 for 64 x 64 tiles in groups
        # of 4 M blocks at 4 warps; at 400 tokens 357.8 against 366.2 (outputs bitwise equal)
        return MoEConfig(
            block_m=32,
            gate_up=Tile(block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3),
            down=Tile(block_n=64, block_k=64, group_m=1, num_warps=2, num_stages=4),
        )
    if rows_per_expert <= 256:
        return MoEConfig(
            block_m=64,
            gate_up=Tile(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
            down=Tile(block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
        )
    return MoEConfig(
        block_m=128,
        gate_up=Tile(block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3),
        down=Tile(block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4),
    )


def fused_variant(num_tokens: int, num_experts: int, top_k: int) -> tuple:
    """What `fused_moe` compiles for num_tokens tokens: its tile config and the align kernel's register width."""
    pairs = num_tokens * top_k
    config = get_config(num_tokens, num_experts, top_k, 0, 0)
    return ("fused", config, pairs <= ALIGN_KERNEL_SMALL_PAIRS)


# ---------------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(num_pid_m, n_out, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M consecutive M blocks (mostly one expert in prefill) sweep the N tiles together, so an
    # expert's weight tiles are still in L2 when the next block of the same expert needs them.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(n_out, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # The Triton interpreter multiplies bf16 tiles as their raw uint16 storage (3.9 `create_dot`), so under
    # TRITON_INTERPRET the operands are widened to fp32 first; compiled kernels keep the native tensor-core dot.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_pid_m", "num_pairs"])
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    num_pid_m, num_pairs, top_k, H, I,
    stride_xm, stride_xk,
    stride_we, stride_wn, stride_wk,
    stride_am, stride_an,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    pid_m, pid_n = _tile_ids(num_pid_m, I, BLOCK_N, GROUP_M)
    # The grid is sized for the worst case; blocks past the real padded count have nothing to do.
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + I * stride_wn

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_mask[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < H - k * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc_g = _mma(a, g, acc_g, DOT_PRECISION, DOT_UPCAST)
        acc_u = _mma(a, u, acc_u, DOT_PRECISION, DOT_UPCAST)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk

    h = acc_g * tl.sigmoid(acc_g) * acc_u
    # Padding rows are written too (as zeros): kernel 2 reads whole blocks and only masks its own store.
    act_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_an
    tl.store(act_ptrs, h.to(act_ptr.dtype.element_ty), mask=n_mask[None, :])


@triton.jit(do_not_specialize=["num_pid_m", "num_pairs"])
def _down_kernel(
    act_ptr, w_ptr, out_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    num_pid_m, num_pairs, H, I,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    pid_m, pid_n = _tile_ids(num_pid_m, H, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(I, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < I - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _mma(a, b, acc, DOT_PRECISION, DOT_UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_wk

    weight = tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


# ---------------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _pair_gate_up_kernel(
    x_ptr, w_ptr, ids_ptr, act_ptr, top_k, hidden, inter,
    stride_xn, stride_we, stride_wr, stride_an,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr
):
    """One (token, expert) pair x one tile of the intermediate: silu(gate_e x) * up_e x."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    token = pair // top_k
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < inter
    # 2-D accumulators reduced once at the end: a cross-thread reduction per K step would serialise the loads
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, hidden, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < hidden
        x = tl.load(x_ptr + token * stride_xn + cols, mask=col_ok, other=0.0).to(tl.float32)
        m = row_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_base + rows[:, None] * stride_wr + cols[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w_base + (rows[:, None] + inter) * stride_wr + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += wg * x[None, :]
        acc_u += wu * x[None, :]
    g = tl.sum(acc_g, axis=1)
    h = g * tl.sigmoid(g) * tl.sum(acc_u, axis=1)
    tl.store(act_ptr + pair * stride_an + rows, h.to(act_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _pair_down_kernel(
    act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr, hidden, inter, num_pairs,
    stride_an, stride_we, stride_wr, stride_on,
    sg_ptr, su_ptr, sw_ptr, shared_inter, stride_sg, stride_su, stride_sw,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr
):
    """One pair x one tile of the hidden dim: routing weight * down_e(act). With HAS_SHARED, programs past the
    pairs compute row num_pairs + n = down_shared(silu(gate_n) * up_n) for token n (unweighted), its activation
    formed here from the router GEMM's output rather than by two more launches."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < hidden
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if pair < num_pairs:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w_base = w_ptr + expert * stride_we
        for k0 in range(0, inter, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < inter
            a = tl.load(act_ptr + pair * stride_an + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_base + rows[:, None] * stride_wr + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += w * a[None, :]
        out = tl.sum(acc, axis=1) * tl.load(wts_ptr + pair).to(tl.float32)
    else:
        if HAS_SHARED:
            token = (pair - num_pairs).to(tl.int64)
            for k0 in range(0, shared_inter, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_ok = cols < shared_inter
                g = tl.load(sg_ptr + token * stride_sg + cols, mask=col_ok, other=0.0).to(tl.float32)
                u = tl.load(su_ptr + token * stride_su + cols, mask=col_ok, other=0.0).to(tl.float32)
                # rounded to the activations' dtype, as the unfused shared expert's input is
                a = (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty, fp_downcast_rounding=ROUND).to(tl.float32)
                w = tl.load(sw_ptr + rows[:, None] * stride_sw + cols[None, :],
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                acc += w * a[None, :]
        out = tl.sum(acc, axis=1)
    tl.store(out_ptr + pair * stride_on + rows, out.to(out_ptr.dtype.element_ty, fp_downcast_rounding=ROUND),
             mask=row_ok)


def pairwise_moe(x, gate_up, down, topk_ids, topk_weights, shared=None, shared_expert=None,
                 block_n: int | None = None, block_k: int = 256, down_block_n: int | None = None,
                 down_block_k: int = 256, num_warps: int = 4) -> torch.Tensor:
    """Same contract as fused_moe, for small batches: no sorting, three launches. `shared_expert` = (gate [N, Is],
    up [N, Is], down weight [H, Is], gate logit [N, 1]) computes the gated shared expert in the same launches
    (instead of `shared`, its precomputed output). block_* / num_warps: the tiles of one program (rows of the
    weight x columns per step) of the gate-up and down launches; rows default to 16 and 32, and in the interpreter
    (programs one after another at Python's pace) to whole weights."""
    num_tokens, hidden = x.shape
    inter = down.shape[2]
    if block_n is None:
        block_n = triton.next_power_of_2(inter) if INTERPRETED else 16
    if down_block_n is None:
        down_block_n = triton.next_power_of_2(hidden) if INTERPRETED else 32
    top_k = topk_ids.shape[1]
    pairs = num_tokens * top_k
    ids = topk_ids.reshape(-1)
    wts = topk_weights.reshape(-1).contiguous()
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _pair_gate_up_kernel[(pairs, triton.cdiv(inter, block_n))](
        x, gate_up, ids, act, top_k, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        act.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **launch_options(x)
    )
    extra = num_tokens if shared_expert is not None else 0
    out = torch.empty(pairs + extra, hidden, dtype=x.dtype, device=x.device)
    if shared_expert is not None:
        sg, su, sw, logit = shared_expert
        assert sg.stride(-1) == su.stride(-1) == sw.stride(-1) == 1
        shared_args = (sg, su, sw, sw.shape[1], sg.stride(0), su.stride(0), sw.stride(0))
    else:
        shared_args = (act, act, act, 0, 0, 0, 0)  # never read
    _pair_down_kernel[(pairs + extra, triton.cdiv(hidden, down_block_n))](
        act, down, ids, wts, out, hidden, inter, pairs, act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        *shared_args, BLOCK_N=down_block_n, BLOCK_K=down_block_k, HAS_SHARED=shared_expert is not None,
        ROUND=rounding(x.dtype), num_warps=num_warps, **launch_options(act)
    )
    if shared_expert is not None:
        shared = (out[pairs:], shared_expert[3])
    return sum_pairs(out[:pairs], top_k, shared=shared)


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoEConfig | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_stream: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    """Same contract as `qwen4exp.ops.moe.moe_experts` (see the module docstring); graph-capturable. With
    `shared` = (shared expert output [N, H], its gate logit [N, 1]), adds sigmoid(logit) * output; when
    `shared_stream` is given the output is being written there, and the sum waits for it."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    assert gate_up.shape == (num_experts, 2 * inter, hidden) and down.shape == (num_experts, hidden, inter)
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k)
    if num_pairs == 0:
        _join(shared_stream)
        return torch.zeros_like(x)
    if config is None:
        config = get_config(num_tokens, num_experts, top_k, hidden, inter)
    block_m = config.block_m
    # fp32 callers expect fp32 results; tensor-core TF32 would lose ~3 digits against the reference.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.dtype != torch.float32 and INTERPRETED

    align = moe_align_triton if num_pairs <= ALIGN_KERNEL_MAX_PAIRS else moe_align
    sorted_ids, expert_ids, num_post_padded = align(topk_ids, num_experts, block_m)
    num_pid_m = expert_ids.numel()
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()

    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    t = config.gate_up
    grid = (num_pid_m * triton.cdiv(inter, t.block_n),)
    _gate_up_kernel[grid](
        x, gate_up, act,
        sorted_ids, expert_ids, num_post_padded,
        num_pid_m, num_pairs, top_k, hidden, inter,
        x.stride(0), x.stride(1),
        gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        act.stride(0), act.stride(1),
        BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        EVEN_K=hidden % t.block_k == 0, DOT_PRECISION=precision, DOT_UPCAST=upcast,
        num_warps=t.num_warps, num_stages=t.num_stages, **launch_options(x)
    )

    out_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    t = config.down
    grid = (num_pid_m * triton.cdiv(hidden, t.block_n),)
    _down_kernel[grid](
        act, down, out_pairs, weights,
        sorted_ids, expert_ids, num_post_padded,
        num_pid_m, num_pairs, hidden, inter,
        act.stride(0), act.stride(1),
        down.stride(0), down.stride(1), down.stride(2),
        out_pairs.stride(0), out_pairs.stride(1),
        BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        EVEN_K=inter % t.block_k == 0, DOT_PRECISION=precision, DOT_UPCAST=upcast,
        num_warps=t.num_warps, num_stages=t.num_stages, **launch_options(act)
    )
    _join(shared_stream)
    return sum_pairs(out_pairs, top_k, shared=shared)


def _join(stream: torch.cuda.Stream | None) -> None:
    """The current stream waits for `stream`'s work so far (nothing for None)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, inter, stride_g, stride_o,
                     BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = (rows < N)[:, None] & (cols < inter)[None, :]
    g = tl.load(gu_ptr + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows[:, None] * stride_g + (inter + cols)[None, :], mask=m, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # as eager rounds: silu to the model dtype, then the product
    act = round_to(g * tl.sigmoid(g), dtype, BF16)
    y = round_to(act * u, dtype, BF16)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(dtype), mask=m)


def silu_mul_halves(gate_up: torch.Tensor, block_n: int = 32, block_i: int = 128, num_warps: int = 4) -> torch.Tensor:
    """silu(gate) * up for gate, up = gate_up.chunk(2, -1) ([N, 2I], rows possibly strided): `ops.moe.silu_mul`'s
    rounding, in one pass that reads each half once (the grouped experts' activation at prefill sizes)."""
    N, two_i = gate_up.shape
    inter = two_i // 2
    assert gate_up.stride(1) == 1 and two_i % 2 == 0
    out = torch.empty(N, inter, dtype=gate_up.dtype, device=gate_up.device)
    if N:
        _silu_mul_kernel[(triton.cdiv(N, block_n), triton.cdiv(inter, block_i))](
            gate_up, out, N, inter, gate_up.stride(0), out.stride(0),
            BLOCK_N=block_n, BLOCK_I=block_i, BF16=gate_up.dtype == torch.bfloat16, num_warps=num_warps,
            **launch_options(gate_up),
        )
    return out


@triton.jit
def _sum_pairs_kernel(
    y_ptr, rows_ptr, w_ptr, shared_ptr, logit_ptr, out_ptr, hidden,
    stride_y, stride_s, stride_l, stride_o,
    TOP_K: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_SHARED: tl.constexpr,
    BLOCK: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr
):
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        if HAS_ROWS:
            row = tl.load(rows_ptr + pair).to(tl.int64)
        else:
            row = pair
        v = tl.load(y_ptr + row * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            v = v * tl.load(w_ptr + pair).to(tl.float32)
        acc += v
    if HAS_SHARED:
        gate = tl.sigmoid(tl.load(logit_ptr + token * stride_l).to(tl.float32))
        acc += gate * tl.load(shared_ptr + token * stride_s + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding=ROUND),
             mask=ok)


def sum_pairs(y, top_k: int, rows=None, weights=None, shared=None, block: int | None = None) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * y[rows[n, j]] (+ sigmoid(logit[n]) * shared_out[n]), one launch, fp32 sums.

    y [M, H] holds the pair outputs; rows [N, k] their row in y (default n*k + j); weights [N, k] (default: already
    weighted); shared = (shared_out [N, H], logit [N, 1]). Returns [N, H] in y's dtype. Deterministic: each output
    element is one program's ordered sum (the reason not to use atomics in the experts' epilogue). block: columns a
    program (a tuning override)."""
    hidden = y.shape[1]
    num_tokens = rows.shape[0] if rows is not None else y.shape[0] // top_k
    if block is None:
        # H200, hidden 2560, k=10: 256 columns at 1 token 0.86 us vs 1.33
        # at 1024; 512 at 64 tokens 1.49 vs 1.62 at 256, and at 16k tokens 216.4 vs 238.8 at 1024.
        block = 256 if num_tokens <= 16 else 512
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    if num_tokens == 0:
        return out
    shared_out, logit = shared if shared is not None else (y, y)
    block = min(block, triton.next_power_of_2(hidden))
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, rows if rows is not None else y, weights.reshape(-1).contiguous() if weights is not None else y,
        shared_out, logit, out, hidden,
        y.stride(0), shared_out.stride(0), logit.stride(0), out.stride(0),
        TOP_K=top_k, HAS_ROWS=rows is not None, HAS_WEIGHTS=weights is not None, HAS_SHARED=shared is not None,
        BLOCK=block, ROUND=rounding(y.dtype), num_warps=4, **launch_options(y)
    )
    return out


# the router kernel holds a token's logits in registers
ROUTE_MAX_EXPERTS = 4096


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, ROUND: tl.constexpr,
                  PDL: tl.constexpr):
    """One token: softmax over the experts in fp32, the top-k by repeated argmax (lowest index among equals),
    optionally renormalised; weights in the logits' dtype, in descending order."""
    pdl_start(PDL)
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + n * stride_l + e, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=0)
    # One max-reduction per pick: the key orders by probability (the bits of a non-negative float order as it does),
    # then by lowest index; taken and padding experts get -1.
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    key = tl.where(valid, key, -1)
    rank = tl.full((BLOCK_E,), -1, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        pick = BLOCK_E - 1 - (tl.max(key, axis=0) & 0xFFFFFFFF)
        rank = tl.where(e == pick, j, rank)
        key = tl.where(e == pick, -1, key)
    chosen = rank >= 0
    w = p
    if RENORMALIZE:
        w = p / tl.sum(tl.where(chosen, p, 0.0), axis=0)
    tl.store(weights_ptr + n * TOP_K + rank, w.to(weights_ptr.dtype.element_ty, fp_downcast_rounding=ROUND),
             mask=chosen)
    tl.store(ids_ptr + n * TOP_K + rank, e.to(tl.int64), mask=chosen)


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool,
                 num_warps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as qwen4exp.ops.moe.route_ref, one launch (softmax, top-k and renormalisation fused).
    One warp per token by default: its reductions are then register shuffles, with no shared-memory round trip."""
    n, num_experts = logits.shape
    weights = torch.empty(n, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n:
        _route_kernel[(n,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
                            ROUND=rounding(logits.dtype), num_warps=num_warps, **launch_options(logits))
    return weights, ids


# ---------------------------------------------------------------------------------------------------------------------
# Block-scaled fp8 experts (ops.fp8's rule): gate_up [E, 2I', H] (gate rows, then up rows, each padded to I', a
# multiple of 128) and down [E, H, I] in float8_e4m3fn with one fp32 scale per 128 x 128 block. The layer input is
# quantized per token and 128-column group; each expert's activation silu(gate) * up is rounded to the activations'
# dtype as the reference rounds it (gate and up as projection outputs, silu, the product), then quantized per row and
# 128-column group for the down projection.
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _swiglu_rounded(g, u, DTYPE: tl.constexpr, BF16: tl.constexpr):
    """silu(g) * u with the reference's roundings to DTYPE (kept in fp32): g and u, silu(g), the product."""
    g = round_to(g, DTYPE, BF16)
    u = round_to(u, DTYPE, BF16)
    return round_to(round_to(g * tl.sigmoid(g), DTYPE, BF16) * u, DTYPE, BF16)


@triton.jit
def _pair_gate_up_fp8_kernel(
    x_ptr, w_ptr, ws_ptr, ids_ptr, act_ptr, top_k, hidden, inter, up_start,
    stride_xn, stride_we, stride_wr, stride_wse, stride_wsr, stride_an,
    DTYPE: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, EXACT: tl.constexpr,
    PDL: tl.constexpr
):
    """One (token, expert) pair x BLOCK_N rows of the intermediate (within one 128-row scale block), G 128-column
    groups a step, as `fp8_triton._gemv_kernel`: the token's groups are quantized here in a compact [G, 128] layout,
    scaled by the gate's and the up's block scales and broadcast over the rows. Writes the activation rounded to
    DTYPE."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    token = pair // top_k
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    r0 = tl.program_id(1) * BLOCK_N
    rows = r0 + tl.arange(0, BLOCK_N)
    gg = tl.arange(0, G)
    k2 = gg[:, None] * 128 + tl.arange(0, 128)[None, :]
    k3 = k2[None, :, :]
    rows3 = rows[:, None, None]
    row_ok = rows3 < inter
    g_ptrs = w_ptr + expert * stride_we + rows3 * stride_wr + k3
    u_ptrs = g_ptrs + up_start * stride_wr
    gs_ptrs = ws_ptr + expert * stride_wse + (r0 // 128) * stride_wsr + gg
    us_ptrs = ws_ptr + expert * stride_wse + ((up_start + r0) // 128) * stride_wsr + gg
    acc_g = tl.zeros((BLOCK_N, G, 128), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, G, 128), dtype=tl.float32)
    for k0 in range(0, hidden, G * 128):
        m3 = row_ok & (k0 + k3 < hidden)
        wg = tl.load(g_ptrs + k0, mask=m3, other=0.0)
        wu = tl.load(u_ptrs + k0, mask=m3, other=0.0)
        x = tl.load(x_ptr + token * stride_xn + k0 + k2, mask=k0 + k2 < hidden, other=0.0).to(tl.float32)
        q, s = quantize_groups(x, 1, EXACT)
        g_ok = k0 + gg * 128 < hidden
        a = q.to(tl.float32) * s
        acc_g += (a * tl.load(gs_ptrs + k0 // 128, mask=g_ok, other=0.0)[:, None])[None, :, :] * wg.to(tl.float32)
        acc_u += (a * tl.load(us_ptrs + k0 // 128, mask=g_ok, other=0.0)[:, None])[None, :, :] * wu.to(tl.float32)
    h = _swiglu_rounded(tl.sum(tl.sum(acc_g, axis=2), axis=1), tl.sum(tl.sum(acc_u, axis=2), axis=1), DTYPE, BF16)
    tl.store(act_ptr + pair * stride_an + rows, h.to(act_ptr.dtype.element_ty), mask=rows < inter)


@triton.jit(do_not_specialize=["num_pairs"])
def _pair_down_fp8_kernel(
    act_ptr, w_ptr, ws_ptr, ids_ptr, wts_ptr, out_ptr, hidden, inter, num_pairs,
    stride_an, stride_we, stride_wr, stride_wse, stride_wsr, stride_on,
    sg_ptr, su_ptr, sw_ptr, sws_ptr, shared_inter, stride_sg, stride_su, stride_sw, stride_sws,
    DTYPE: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, HAS_SHARED: tl.constexpr,
    SHARED_FP8: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr
):
    """One pair x BLOCK_N rows of the hidden dim (within one scale block): routing weight * down_e(act), the pair's
    activation quantized here per 128-column group. With HAS_SHARED, programs past the pairs compute row
    num_pairs + n = down_shared(silu(gate_n) * up_n) for token n (unweighted), its activation formed here from the
    router GEMM's output and, when the shared down projection is fp8 too (SHARED_FP8, scales at sws), quantized."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    r0 = tl.program_id(1) * BLOCK_N
    rows = r0 + tl.arange(0, BLOCK_N)
    gg = tl.arange(0, G)
    k2 = gg[:, None] * 128 + tl.arange(0, 128)[None, :]
    k3 = k2[None, :, :]
    rows3 = rows[:, None, None]
    row_ok = rows3 < hidden
    acc = tl.zeros((BLOCK_N, G, 128), dtype=tl.float32)
    if pair < num_pairs:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w_ptrs = w_ptr + expert * stride_we + rows3 * stride_wr + k3
        s_ptrs = ws_ptr + expert * stride_wse + (r0 // 128) * stride_wsr + gg
        for k0 in range(0, inter, G * 128):
            w = tl.load(w_ptrs + k0, mask=row_ok & (k0 + k3 < inter), other=0.0)
            a = tl.load(act_ptr + pair * stride_an + k0 + k2, mask=k0 + k2 < inter, other=0.0).to(tl.float32)
            q, s = quantize_groups(a, 1, EXACT)
            sw = tl.load(s_ptrs + k0 // 128, mask=k0 + gg * 128 < inter, other=0.0)
            acc += (q.to(tl.float32) * (s * sw[:, None]))[None, :, :] * w.to(tl.float32)
        out = tl.sum(tl.sum(acc, axis=2), axis=1) * tl.load(wts_ptr + pair).to(tl.float32)
    else:
        if HAS_SHARED:
            token = (pair - num_pairs).to(tl.int64)
            for k0 in range(0, shared_inter, G * 128):
                c_ok = k0 + k2 < shared_inter
                g = tl.load(sg_ptr + token * stride_sg + k0 + k2, mask=c_ok, other=0.0).to(tl.float32)
                u = tl.load(su_ptr + token * stride_su + k0 + k2, mask=c_ok, other=0.0).to(tl.float32)
                # silu(gate) * up as `ops.moe.silu_mul` rounds it, the gate and up being the router GEMM's outputs
                a = round_to(round_to(g * tl.sigmoid(g), DTYPE, BF16) * u, DTYPE, BF16)
                w = tl.load(sw_ptr + rows3 * stride_sw + k0 + k3, mask=row_ok & (k0 + k3 < shared_inter), other=0.0)
                if SHARED_FP8:
                    q, s = quantize_groups(a, 1, EXACT)
                    ss = tl.load(sws_ptr + (r0 // 128) * stride_sws + k0 // 128 + gg,
                                 mask=k0 + gg * 128 < shared_inter, other=0.0)
                    a = q.to(tl.float32) * (s * ss[:, None])
                acc += a[None, :, :] * w.to(tl.float32)
        out = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(out_ptr + pair * stride_on + rows, to_dtype(out, out_ptr.dtype.element_ty, EXACT), mask=rows < hidden)


def pairwise_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, topk_ids, topk_weights, shared_expert=None,
                     block_n: int = 4, down_block_n: int = 8, num_warps: int = 1) -> torch.Tensor:
    """`pairwise_moe` for block-scaled fp8 experts: one program per (pair, BLOCK_N rows), three launches (gate-up,
    down with the shared expert, sum), each quantizing its activations per 128-column group itself (the layer input
    in the gate-up launch, the activation in the down launch). `shared_expert` = (gate, up, down weight, logit) or
    (gate, up, down weight, logit, down scale) for an fp8 down weight. block_n / down_block_n: rows a program (powers
    of two dividing 128). The defaults were the fastest on one H100 at flash-next widths and one token (26.1 us a call
    with the shared expert; more rows or warps a program, and wider steps with per-step sums as the fp8 GEMV's,
    27.3-43.5: benchmarks/kernels/bench_fp8.py --sweep)."""
    num_tokens, hidden = x.shape
    up_start = gate_up.shape[1] // 2
    inter = down.shape[2]
    top_k = topk_ids.shape[1]
    pairs = num_tokens * top_k
    ids = topk_ids.reshape(-1)
    wts = topk_weights.reshape(-1).contiguous()
    bf16 = x.dtype == torch.bfloat16
    dtype = _TL_DTYPES[x.dtype]
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _pair_gate_up_fp8_kernel[(pairs, triton.cdiv(inter, block_n))](
        x, gate_up, gate_up_scale, ids, act, top_k, hidden, inter, up_start, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), act.stride(0),
        DTYPE=dtype, BF16=bf16, BLOCK_N=block_n, G=groups_per_step(hidden, 2), EXACT=INTERPRETED,
        num_warps=num_warps,
        **launch_options(x))
    extra = num_tokens if shared_expert is not None else 0
    out = torch.empty(pairs + extra, hidden, dtype=x.dtype, device=x.device)
    shared_fp8 = shared_expert is not None and len(shared_expert) == 5
    shared_inter = 0
    if shared_expert is not None:
        sg, su, sw = shared_expert[:3]
        assert sg.stride(-1) == su.stride(-1) == sw.stride(-1) == 1
        sws = shared_expert[4] if shared_fp8 else sw
        shared_inter = sw.shape[1]
        shared_args = (sg, su, sw, sws, shared_inter, sg.stride(0), su.stride(0), sw.stride(0), sws.stride(0))
    else:
        shared_args = (act, act, act, act, 0, 0, 0, 0, 0)  # never read
    _pair_down_fp8_kernel[(pairs + extra, triton.cdiv(hidden, down_block_n))](
        act, down, down_scale, ids, wts, out, hidden, inter, pairs, act.stride(0), down.stride(0), down.stride(1),
        down_scale.stride(0), down_scale.stride(1), out.stride(0), *shared_args,
        DTYPE=dtype, BF16=bf16, BLOCK_N=down_block_n, G=groups_per_step(max(inter, shared_inter), 1),
        HAS_SHARED=shared_expert is not None, SHARED_FP8=shared_fp8, EXACT=INTERPRETED, num_warps=num_warps,
        **launch_options(act))
    shared = (out[pairs:], shared_expert[3]) if shared_expert is not None else None
    return sum_pairs(out[:pairs], top_k, shared=shared)


@triton.jit(do_not_specialize=["num_pid_m", "num_pairs"])
def _gate_up_fp8_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, aq_ptr, as_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    num_pid_m, num_pairs, top_k, H, I, up_start,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_am, stride_asm,
    DTYPE: tl.constexpr, BF16: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, EXACT: tl.constexpr,
    PDL: tl.constexpr
):
    """`_gate_up_kernel` on fp8 operands, one 128-column block of the intermediate a program: per 128-column group
    of H, fp8 dots of the rows' quantized input with the gate's and the up's tiles, scaled by the rows' and the
    weight blocks' scales; then silu(gate) * up rounded as the reference rounds it, quantized per row (the tile is
    one 128-column group of the activation) and written as fp8 with its scales."""
    pdl_start(PDL)
    pid_m, pid_n = _tile_ids(num_pid_m, I, 128, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * 128 + tl.arange(0, 128)
    n_ok = offs_n < I
    offs_k = tl.arange(0, 128)
    a_ptrs = xq_ptr + token[:, None] * stride_xm + offs_k[None, :]
    sa_ptrs = xs_ptr + token * stride_xsm
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + up_start * stride_wn
    gs_ptrs = ws_ptr + expert * stride_wse + pid_n * stride_wsn
    us_ptrs = gs_ptrs + (up_start // 128) * stride_wsn
    acc_g = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, 128)):
        k_ok = offs_k < H - kb * 128
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_ptrs + kb, mask=valid, other=0.0)[:, None]
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g += tl.dot(a, g) * (sa * tl.load(gs_ptrs + kb))
        acc_u += tl.dot(a, u) * (sa * tl.load(us_ptrs + kb))
        a_ptrs += 128
        g_ptrs += 128
        u_ptrs += 128
    # padding rows and columns past I are zeros: zero activations, quantized with scale 1
    q, s = quantize_groups(_swiglu_rounded(acc_g, acc_u, DTYPE, BF16), 1, EXACT)
    tl.store(aq_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :], q, mask=n_ok[None, :])
    tl.store(as_ptr + offs_m[:, None].to(tl.int64) * stride_asm + pid_n, s)


@triton.jit(do_not_specialize=["num_pid_m", "num_pairs"])
def _down_fp8_kernel(
    aq_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
    num_pid_m, num_pairs, H, I,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr
):
    """`_down_kernel` on fp8 operands: per 128-column group of I, an fp8 dot of the quantized activations with the
    down tile, scaled by the rows' and the weight blocks' scales; the routing weight in the epilogue."""
    pdl_start(PDL)
    pid_m, pid_n = _tile_ids(num_pid_m, H, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, 128)
    a_ptrs = aq_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    sa_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    bs_ptrs = ws_ptr + expert * stride_wse + (offs_n // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(I, 128)):
        k_ok = offs_k < I - kb * 128
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        sa = tl.load(sa_ptrs + kb)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sb = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += 128
        b_ptrs += 128
    acc = acc * tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             to_dtype(acc, out_ptr.dtype.element_ty, EXACT), mask=valid[:, None] & n_ok[None, :])


def get_fp8_config(num_tokens: int, num_experts: int, top_k: int) -> MoEConfig:
    """Tiles of the fp8 fused kernels from the static problem shape, with get_config's tiers of rows per expert (so
    that the same step sizes share compiled variants). The K step is the 128-column group; the gate-up tile is one
    128-column group of the activation (its epilogue quantizes it), so its two accumulators and the dots' results
    hold 4 x BLOCK_M x 128 fp32: BLOCK_M stays at 64 or less, with 8 warps from 32 (the sm_90 build spills at 32 rows
    on 4 warps). To be measured on the H200 (benchmarks/kernels/bench_fp8.py)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        return MoEConfig(block_m=16, gate_up=Tile(block_n=128, block_k=128, num_warps=4, num_stages=4),
                         down=Tile(block_n=64, block_k=128, num_warps=4, num_stages=4))
    if rows_per_expert <= 48:
        return MoEConfig(block_m=32, gate_up=Tile(block_n=128, block_k=128, num_warps=8, num_stages=4),
                         down=Tile(block_n=64, block_k=128, num_warps=4, num_stages=4))
    return MoEConfig(block_m=64, gate_up=Tile(block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3),
                     down=Tile(block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=4))


def fused_moe_fp8(x, gate_up, gate_up_scale, down, down_scale, topk_ids, topk_weights,
                  config: MoEConfig | None = None, shared=None, shared_stream=None) -> torch.Tensor:
    """`fused_moe` for block-scaled fp8 experts (every size past the pairwise kernels: torch's grouped GEMM has no
    block-scaled form): the layer input quantized once (`fp8_triton.quantize`), the sorted pairs' gate-up GEMM
    writing the quantized activation, the down GEMM, the sum. shared / shared_stream: as in `fused_moe`."""
    num_tokens, hidden = x.shape
    num_experts = gate_up.shape[0]
    up_start = gate_up.shape[1] // 2
    inter = down.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        _join(shared_stream)
        return torch.zeros_like(x)
    config = config or get_fp8_config(num_tokens, num_experts, top_k)
    assert config.gate_up.block_n == config.gate_up.block_k == config.down.block_k == 128
    block_m = config.block_m
    align = moe_align_triton if num_pairs <= ALIGN_KERNEL_MAX_PAIRS else moe_align
    sorted_ids, expert_ids, num_post_padded = align(topk_ids, num_experts, block_m)
    num_pid_m = expert_ids.numel()
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    xq, xs = fp8_triton.quantize(x)

    rows = sorted_ids.numel()
    aq = torch.empty(rows, inter, dtype=fp8_triton.FP8, device=x.device)
    a_scale = torch.empty(rows, triton.cdiv(inter, 128), dtype=torch.float32, device=x.device)
    t = config.gate_up
    _gate_up_fp8_kernel[(num_pid_m * triton.cdiv(inter, 128),)](
        xq, xs, gate_up, gate_up_scale, aq, a_scale, sorted_ids, expert_ids, num_post_padded,
        num_pid_m, num_pairs, top_k, hidden, inter, up_start,
        xq.stride(0), xs.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
        gate_up_scale.stride(1), aq.stride(0), a_scale.stride(0),
        DTYPE=_TL_DTYPES[x.dtype], BF16=x.dtype == torch.bfloat16, BLOCK_M=block_m, GROUP_M=t.group_m,
        EXACT=INTERPRETED, num_warps=t.num_warps, num_stages=t.num_stages, **launch_options(x))

    out_pairs = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    t = config.down
    _down_fp8_kernel[(num_pid_m * triton.cdiv(hidden, t.block_n),)](
        aq, a_scale, down, down_scale, out_pairs, weights, sorted_ids, expert_ids, num_post_padded,
        num_pid_m, num_pairs, hidden, inter,
        aq.stride(0), a_scale.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1),
        out_pairs.stride(0),
        BLOCK_M=block_m, BLOCK_N=t.block_n, GROUP_M=t.group_m, EXACT=INTERPRETED, num_warps=t.num_warps,
        num_stages=t.num_stages, **launch_options(aq))
    _join(shared_stream)
    return sum_pairs(out_pairs, top_k, shared=shared)


def fp8_supported(x, gate_up, gate_up_scale, down, down_scale) -> bool:
    """The fp8 expert kernels' preconditions: x [N, H] of a float dtype with unit-stride rows; gate_up [E, 2I', H]
    and down [E, H, I] fp8 with unit-stride rows, I' = I rounded up to 128; fp32 block scales of the rule's shapes."""
    if x.dim() != 2 or x.dtype not in _TL_DTYPES or x.stride(1) != 1:
        return False
    if gate_up.dtype != fp8_triton.FP8 or down.dtype != fp8_triton.FP8 or gate_up_scale is None or down_scale is None:
        return False
    e, two_ip, h = gate_up.shape
    inter = down.shape[2]
    return (x.shape[1] == h and two_ip == 2 * triton.cdiv(inter, 128) * 128 and tuple(down.shape) == (e, h, inter)
            and gate_up.stride(2) == 1 and down.stride(2) == 1 and gate_up_scale.stride(2) == down_scale.stride(2) == 1
            and gate_up_scale.dtype == down_scale.dtype == torch.float32
            and tuple(gate_up_scale.shape) == (e, two_ip // 128, triton.cdiv(h, 128))
            and tuple(down_scale.shape) == (e, triton.cdiv(h, 128), triton.cdiv(inter, 128)))
