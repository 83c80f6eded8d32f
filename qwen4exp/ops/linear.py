"""Linear projections.

`linear` is F.linear, except for one token on the GPU (decode), where cuBLAS runs these widths well below HBM
bandwidth: there it is one Triton GEMV launch (linear_triton.py); small projections take the GEMV up to a few tokens
(`gemv_max_tokens`).

`merged_linear` is one `linear` over the stacked weights of several projections of the same input, split into their
outputs (the weights of `model.merged_linear.MergedLinear`).

`output_linear` is `linear` for the blocks' output projections (GDN out_proj, attention o_proj), whose only reader
is the next hyper-connection mix: at 2 to tuning.PARTIALS_MAX_TOKENS tokens on the GPU it returns fp32 partial products
(`partial_products`) that the mix's combine sums, in place of cuBLAS's split-K GEMM and its reduce kernel; fp8
weights likewise past the fp8 GEMV's reach when tuning.FP8_OUTPUT_SPLITS is above 1 (`ops.fp8.partial_products`).

`fp32_out_linear` (the lm_head) keeps the GEMM's fp32 accumulator instead of rounding it to the operands' dtype.
"""

import torch
import torch.nn.functional as F

from . import fp8, tuning
from ._dispatch import HAS_TRITON, fast_path

if HAS_TRITON:
    from . import linear_triton


def gemv_max_tokens(weight: torch.Tensor) -> int:
    """Tokens up to which a bias-free projection by `weight` runs as the GEMV on the GPU (ops/tuning.py)."""
    if weight.numel() <= tuning.GEMV_SMALL_WEIGHT:
        return max(tuning.GEMV_MAX_TOKENS, tuning.GEMV_SMALL_MAX_TOKENS)
    return tuning.GEMV_MAX_TOKENS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); the Triton GEMV for bias-free projections of up to `gemv_max_tokens(weight)`
    tokens on the fast path. A float8_e4m3fn weight with its block scales `scale` is a block-scaled fp8 product
    (`ops.fp8.linear`)."""
    if weight.dtype == fp8.FP8:
        return fp8.linear(x, weight, scale, bias)
    if (bias is None and HAS_TRITON and fast_path(x) and x.dim() == 2 and x.shape[0] <= gemv_max_tokens(weight)
            and linear_triton.supported(x, weight)):
        return linear_triton.gemv(x, weight)
    return F.linear(x, weight, bias)


def partial_products(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x @ weight.T as `splits` fp32 partial products over slices of K, [T, splits, N] (a view of [splits, T, N]),
    from one cuBLAS batched GEMM. At decode sizes cuBLAS runs the plain product as a split-K GEMM and a reduce
    kernel of its own; the sum of the partials happens instead in the kernel that reads them."""
    tokens, k = x.shape
    n = weight.shape[0]
    a = x.view(tokens, splits, k // splits).transpose(0, 1)
    b = weight.view(n, splits, k // splits).permute(1, 2, 0)
    if not a.is_cuda:  # no bf16 -> fp32 batched GEMM on the CPU
        return torch.bmm(a.float(), b.float()).transpose(0, 1)
    return torch.bmm(a, b, out_dtype=torch.float32).transpose(0, 1)


def output_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` for a block's output projection, read only by the next hyper-connection mix's combine
    (`ops.hyper_connection.hc_mix`, which takes either form): [T, N] in x's dtype, or on the GPU from 2 tokens past
    the GEMV's reach (`gemv_max_tokens`) to tuning.PARTIALS_MAX_TOKENS the product as tuning.OUTPUT_SPLITS fp32 partial
    products [T, splits, N]."""
    if weight.dtype == fp8.FP8:
        if (bias is None and x.dim() == 2 and tuning.FP8_OUTPUT_SPLITS > 1
                and tuning.FP8_GEMV_MAX_TOKENS < x.shape[0] <= tuning.PARTIALS_MAX_TOKENS):
            partials = fp8.partial_products(x, weight, scale, tuning.FP8_OUTPUT_SPLITS)
            if partials is not None:
                return partials
        return linear(x, weight, bias, scale)
    splits = tuning.OUTPUT_SPLITS
    if (bias is None and fast_path(x) and max(1, gemv_max_tokens(weight)) < x.shape[0] <= tuning.PARTIALS_MAX_TOKENS
            and x.is_contiguous() and x.shape[1] % splits == 0):
        return partial_products(x, weight, splits)
    return linear(x, weight, bias, scale)


def fp32_out_linear(x: torch.Tensor, weight: torch.Tensor, chunk_rows: int = 32768) -> torch.Tensor:
    """x @ weight.T in fp32: bf16 operands, fp32 accumulation, and no rounding of the result to bf16.

    For the logits. A trained model's top logits lie around 8-16, where one bf16 step is 1/16, so bf16 logits turn
    near ties into exact ones and flip the argmax: on `small` trained on the CPU the bf16 engine's top-1 agreement
    with fp32 went from 98.73% to 99.41% with fp32 logits. On the GPU
    cuBLAS writes its fp32 accumulator directly (no widened weight; the extra cost is the wider output, 64 x 248k x 2
    bytes at batch 64). The reference widens `chunk_rows` weight rows at a time, so it never holds an fp32 copy of the
    whole matrix."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(x, weight)
    if fast_path(x):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    x32 = x.float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, weight.shape[0], chunk_rows):
        out[:, start:start + chunk_rows] = F.linear(x32, weight[start:start + chunk_rows].float())
    return out


def merged_linear(x: torch.Tensor, weight: torch.Tensor, sizes: tuple[int, ...],
                  bias: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The outputs of projections stacked in `weight` (`sizes` rows each, then any padding rows), from one `linear`:
    views of its output columns, the padding's dropped."""
    y = linear(x, weight, bias, scale)
    return y.split((*sizes, weight.shape[0] - sum(sizes)), dim=-1)[: len(sizes)]
