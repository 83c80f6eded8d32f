"""The sparse MoE block's router and routed experts (SwiGLU) with the gated shared expert: API, dispatch, the torch
reference, and the grouped-GEMM path for large steps. moe_triton.py holds the kernels.

GPU dispatch by the step's (token, expert) pairs (thresholds in `tuning`):
  up to PAIRWISE_MAX_PAIRS   one program per pair, three launches (`moe_triton.pairwise_moe`), the shared expert's
                             down projection in the pairs' down launch;
  up to GROUPED_MM_MIN_PAIRS pairs sorted by expert and padded to the tile height, two Triton GEMM launches
                             (`moe_triton.fused_moe`), the shared expert on a side stream beside them;
  beyond                     torch's grouped GEMM (CUTLASS, bf16, Hopper) over the pairs in expert order
                             (`grouped_moe`), with Triton kernels for the order, the input rows, silu_mul and the sum.
Block-scaled fp8 experts (`ops.fp8`) take the fp8 forms of the first two (`moe_triton.pairwise_moe_fp8`,
`moe_triton.fused_moe_fp8`, the latter at every larger size: the grouped GEMM has no block-scaled form). A shared
expert whose down projection is fp8 runs in the pairwise down launch or on the side stream either way.
"""

import torch
import torch.nn.functional as F

from . import fp8, tuning
from ._dispatch import HAS_TRITON, compiled_on_gpu, fast_path, side_stream
from .linear import linear

if HAS_TRITON:
    from . import moe_triton


@compiled_on_gpu
def route_ref(logits, top_k: int, renormalize: bool):
    """Softmax router: logits [N, E] -> (weights [N, k] in the logits' dtype, expert ids [N, k]); softmax in fp32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route(logits, top_k: int, renormalize: bool):
    """Dispatch: on the GPU one fused Triton launch, a warp per token (inductor leaves softmax, topk's two kernels
    and the renormalisation separate). At 128 experts, top-10, on an H200 it takes 3.0 / 8.8 / 29 us at
    64 / 4096 / 16384 tokens against the compiled reference's 17.5 / 45 / 137 us."""
    if HAS_TRITON and fast_path(logits) and logits.shape[-1] <= moe_triton.ROUTE_MAX_EXPERTS:
        return moe_triton.route_triton(logits, top_k, renormalize)
    return route_ref(logits, top_k, renormalize)


@compiled_on_gpu
def silu_mul(gate, up):
    return F.silu(gate) * up


@compiled_on_gpu
def add_shared_expert(routed, shared_gate_logit, shared_out):
    """routed + sigmoid(gate) * shared, the shared expert's contribution to the MoE output."""
    return routed + torch.sigmoid(shared_gate_logit) * shared_out


def moe_experts_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [N, H]; gate_up: [E, 2I, H] (gate rows first); down: [E, H, I]; topk_ids/weights: [N, k].
    Returns sum_j w_j * down_e(silu(gate_e x) * up_e x) over each token's k experts, [N, H] in x's dtype.

    Block-scaled fp8 experts (`ops.fp8`) come with their scales: gate_up [E, 2I', H] with gate_up_scale
    [E, 2I'/128, ceil(H/128)] (I' = I rounded up to a multiple of 128: gate rows, then up rows, each padded with
    zeros), down [E, H, I] with down_scale [E, ceil(H/128), ceil(I/128)]."""
    out = torch.zeros_like(x)
    inter = down.shape[2]
    up_start = gate_up.shape[1] // 2
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        h = linear(x[token], gate_up[expert], scale=None if gate_up_scale is None else gate_up_scale[expert])
        gate, up = h[:, :inter], h[:, up_start:up_start + inter]
        act = F.silu(gate) * up
        y = linear(act, down[expert], scale=None if down_scale is None else down_scale[expert])
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(out.dtype))
    return out


def moe_block_ref(x, gate_up, down, topk_ids, topk_weights, shared=None, gate_up_scale=None,
                  down_scale=None) -> torch.Tensor:
    """`moe_experts`' reference: the routed experts, then the gated shared expert added as the model writes it."""
    routed = moe_experts_ref(x, gate_up, down, topk_ids, topk_weights, gate_up_scale, down_scale)
    return routed if shared is None else add_shared_expert(routed, shared[1], shared[0])


def moe_experts(x, gate_up, down, topk_ids, topk_weights, shared_expert=None, gate_up_scale=None,
                down_scale=None) -> torch.Tensor:
    """Routed experts, plus the gated shared expert sigmoid(logit) * down(silu(gate) * up) with `shared_expert` =
    (gate [N, Is], up [N, Is], down weight [H, Is], logit [N, 1]) (gate, up and logit: the router GEMM's outputs),
    or (gate, up, down weight, logit, down scale) when its down projection is block-scaled fp8. The routed experts
    may be block-scaled fp8 too, with `gate_up_scale` and `down_scale` (see `moe_experts_ref`).

    Dispatch: see the module docstring; on the GPU the gated shared expert is added in the kernel that sums each
    token's experts."""
    if shared_expert is not None and len(shared_expert) == 5 and shared_expert[2].dtype != fp8.FP8:
        shared_expert = shared_expert[:4]  # an unquantized down weight: its (absent) scale means nothing

    def shared_output():
        if shared_expert is None:
            return None
        gate, up, down_weight, logit, *down_weight_scale = shared_expert
        return linear(silu_mul(gate, up), down_weight, scale=(down_weight_scale or [None])[0]), logit

    if not (HAS_TRITON and fast_path(x)) or (
            gate_up.dtype == fp8.FP8 and not moe_triton.fp8_supported(x, gate_up, gate_up_scale, down, down_scale)):
        return moe_block_ref(x, gate_up, down, topk_ids, topk_weights, shared_output(), gate_up_scale, down_scale)
    if gate_up.dtype == fp8.FP8:
        quantized = (gate_up_scale, down, down_scale)
        if topk_ids.numel() <= tuning.PAIRWISE_MAX_PAIRS:
            return moe_triton.pairwise_moe_fp8(x, gate_up, *quantized, topk_ids, topk_weights, shared_expert)
        if shared_expert is None or not x.is_cuda:
            return moe_triton.fused_moe_fp8(x, gate_up, *quantized, topk_ids, topk_weights, shared=shared_output())
        shared, side = shared_expert_on_side_stream(shared_expert)
        return moe_triton.fused_moe_fp8(x, gate_up, *quantized, topk_ids, topk_weights, shared=shared,
                                        shared_stream=side)
    if topk_ids.numel() >= tuning.GROUPED_MM_MIN_PAIRS and grouped_mm_available(x):
        return grouped_moe(x, gate_up, down, topk_ids, topk_weights, shared_output())
    if topk_ids.numel() <= tuning.PAIRWISE_MAX_PAIRS:
        if shared_expert is not None and len(shared_expert) == 5:  # the bf16 kernel's shared down launch is bf16
            return moe_triton.pairwise_moe(x, gate_up, down, topk_ids, topk_weights, shared=shared_output())
        return moe_triton.pairwise_moe(x, gate_up, down, topk_ids, topk_weights, shared_expert=shared_expert)
    if shared_expert is None or not x.is_cuda:  # (tests run the fast path on the CPU in Triton's interpreter)
        return moe_triton.fused_moe(x, gate_up, down, topk_ids, topk_weights, shared=shared_output())
    shared, side = shared_expert_on_side_stream(shared_expert)
    return moe_triton.fused_moe(x, gate_up, down, topk_ids, topk_weights, shared=shared, shared_stream=side)


def shared_expert_on_side_stream(shared_expert):
    """The shared expert's silu_mul and down projection (bf16, or block-scaled fp8 for a 5-tuple), launched on a side
    stream so that they run beside the routed experts' weight-bound launches instead of before them (a few small
    kernels a layer at decode sizes; stream forks and joins are captured by CUDA graphs). Returns ((output [N, H],
    logit), the side stream): the output is allocated on the compute stream, which must wait on the side stream before
    reading it."""
    gate, up, down_weight, logit, *down_weight_scale = shared_expert
    main = torch.cuda.current_stream(gate.device)
    side = side_stream(gate.device, "shared_expert")
    out = torch.empty(gate.shape[0], down_weight.shape[0], dtype=gate.dtype, device=gate.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        # silu_mul's result is allocated and freed on the side stream; the inputs outlive the join (the caller
        # holds them until moe_experts returns)
        if down_weight_scale:  # block-scaled fp8: its product, also allocated and freed there, copied out
            out.copy_(fp8.linear(silu_mul(gate, up), down_weight, down_weight_scale[0]))
        else:
            torch.mm(silu_mul(gate, up), down_weight.t(), out=out)
    return (out, logit), side


def kernel_variant(num_tokens: int, num_experts: int, top_k: int) -> tuple:
    """Which compiled kernels `moe_experts` runs for a step of num_tokens tokens on the GPU (steps with equal values
    share them)."""
    pairs = num_tokens * top_k
    if pairs >= tuning.GROUPED_MM_MIN_PAIRS:
        return ("grouped",)
    if pairs <= tuning.PAIRWISE_MAX_PAIRS:
        return ("pairwise",)
    return moe_triton.fused_variant(num_tokens, num_experts, top_k)


def warm_up_token_counts(num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """The smallest step size of every kernel variant up to max_tokens: one eager step of each compiles them all."""
    first = {}
    for n in range(1, max_tokens + 1):
        first.setdefault(kernel_variant(n, num_experts, top_k), n)
    return sorted(first.values())


def grouped_mm_available(x: torch.Tensor) -> bool:
    """True when `torch._grouped_mm` can take x's dtype on x's device (static: decided by dtype/device only)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda:
        # The CUTLASS kernel is bf16-only and needs Hopper or later; older GPUs would hit a slow fallback or fail.
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def grouped_moe(x, gate_up, down, topk_ids, topk_weights, shared=None) -> torch.Tensor:
    """`moe_experts` through `torch._grouped_mm` (a private op, guarded by `grouped_mm_available`), for prefill-sized
    steps: the N*k (token, slot) pairs are put in expert order (`moe_triton.sort_pairs`), each token's row is
    written to its pairs' sorted rows (`spread_rows`), each expert's contiguous run goes through one grouped GEMM,
    and `sum_pairs` adds each token's k rows, weighted, where they lie (deterministic, no atomics, no scatter). Every
    step has shapes fixed by N, k and E and reads the group offsets on the device, so nothing syncs with the host.
    shared: (shared expert output [N, H], its gate logit [N, 1]) to add, as in `moe_experts`."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    _, offs, rows = moe_triton.sort_pairs(topk_ids, gate_up.shape[0])
    # weights as stored ([E, out, in]) transposed to [E, in, out]: column-major views, taken without a copy
    h = torch._grouped_mm(moe_triton.spread_rows(x, rows, top_k), gate_up.transpose(1, 2), offs=offs)
    # one pass over both halves (inductor's compiled silu_mul ran at ~60% of bandwidth here)
    y = torch._grouped_mm(moe_triton.silu_mul_halves(h), down.transpose(1, 2), offs=offs)
    return moe_triton.sum_pairs(y, top_k, rows.view(num_tokens, top_k), topk_weights, shared).to(x.dtype)
