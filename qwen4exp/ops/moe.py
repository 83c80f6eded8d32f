"""Routed experts (SwiGLU) of the sparse MoE block: torch reference."""

import torch
import torch.nn.functional as F

from . import compiled_on_gpu


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
    64 / 4096 / 16384 tokens against the compiled reference's 17.5 / 45 / 137 us (`bench/decode_kernels.py --parts
    route_big`)."""
    from . import fast_path

    if fast_path(logits) and logits.shape[-1] <= 4096:
        from .triton_moe import route_triton

        return route_triton(logits, top_k, renormalize)
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
) -> torch.Tensor:
    """x: [N, H]; gate_up: [E, 2I, H] (gate rows first); down: [E, H, I]; topk_ids/weights: [N, k].
    Returns sum_j w_j * down_e(silu(gate_e x) * up_e x) over each token's k experts, [N, H] in x's dtype."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def moe_block_ref(x, gate_up, down, topk_ids, topk_weights, shared=None) -> torch.Tensor:
    """`moe_experts`' reference: the routed experts, then the gated shared expert added as the model writes it."""
    routed = moe_experts_ref(x, gate_up, down, topk_ids, topk_weights)
    return routed if shared is None else add_shared_expert(routed, shared[1], shared[0])


# Above this many (token, expert) pairs the grouped GEMM beats the Triton kernel (set from bench/ on an H200).
GROUPED_MM_MIN_PAIRS = 4096


def moe_experts(x, gate_up, down, topk_ids, topk_weights, shared_expert=None) -> torch.Tensor:
    """Routed experts, plus the gated shared expert sigmoid(logit) * down(silu(gate) * up) with `shared_expert` =
    (gate [N, Is], up [N, Is], down weight [H, Is], logit [N, 1]) (gate, up and logit: the router GEMM's outputs).

    Dispatch: Triton fused MoE for small batches (graph-capturable), torch grouped GEMM for large ones; on the GPU
    the gated shared expert is added in the kernel that sums each token's experts; up to PAIRWISE_MAX_PAIRS pairs
    its down projection runs in the routed experts' launch, and on the fused path its silu_mul and down projection
    run on a side stream beside the routed experts."""
    from . import fast_path

    def shared_output():
        if shared_expert is None:
            return None
        gate, up, down_weight, logit = shared_expert
        return F.linear(silu_mul(gate, up), down_weight), logit

    if not fast_path(x):
        return moe_block_ref(x, gate_up, down, topk_ids, topk_weights, shared_output())
    if topk_ids.numel() >= GROUPED_MM_MIN_PAIRS:
        from .moe_grouped import grouped_mm_available, grouped_moe

        if grouped_mm_available(x):
            return grouped_moe(x, gate_up, down, topk_ids, topk_weights, shared_output())
    from .triton_moe import PAIRWISE_MAX_PAIRS, fused_moe, pairwise_moe

    if topk_ids.numel() <= PAIRWISE_MAX_PAIRS:
        return pairwise_moe(x, gate_up, down, topk_ids, topk_weights, shared_expert=shared_expert)
    if shared_expert is None or not x.is_cuda:  # (tests run the fast path on the CPU in Triton's interpreter)
        return fused_moe(x, gate_up, down, topk_ids, topk_weights, shared=shared_output())
    shared, side = shared_expert_on_side_stream(shared_expert)
    return fused_moe(x, gate_up, down, topk_ids, topk_weights, shared=shared, shared_stream=side)


def shared_expert_on_side_stream(shared_expert):
    """The shared expert's silu_mul and down projection, launched on a side stream so that they run beside the
    routed experts' weight-bound launches instead of before them (a few small kernels a layer at decode sizes;
    stream forks and joins are captured by CUDA graphs). Returns ((output [N, H], logit), the side stream): the
    output is allocated on the compute stream, which must wait on the side stream before reading it."""
    from . import side_stream

    gate, up, down_weight, logit = shared_expert
    main = torch.cuda.current_stream(gate.device)
    side = side_stream(gate.device, "shared_expert")
    out = torch.empty(gate.shape[0], down_weight.shape[0], dtype=gate.dtype, device=gate.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        # silu_mul's result is allocated and freed on the side stream; the inputs outlive the join (the caller
        # holds them until moe_experts returns)
        torch.mm(silu_mul(gate, up), down_weight.t(), out=out)
    return (out, logit), side


def kernel_variant(num_tokens: int, num_experts: int, top_k: int) -> tuple:
    """Which compiled kernels `moe_experts` runs for a step of num_tokens tokens on the GPU (steps with equal values
    share them)."""
    pairs = num_tokens * top_k
    if pairs >= GROUPED_MM_MIN_PAIRS:
        return ("grouped",)
    from .triton_moe import PAIRWISE_MAX_PAIRS, fused_variant

    if pairs <= PAIRWISE_MAX_PAIRS:
        return ("pairwise",)
    return fused_variant(num_tokens, num_experts, top_k)


def warm_up_token_counts(num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """The smallest step size of every kernel variant up to max_tokens: one eager step of each compiles them all."""
    first = {}
    for n in range(1, max_tokens + 1):
        first.setdefault(kernel_variant(n, num_experts, top_k), n)
    return sorted(first.values())
