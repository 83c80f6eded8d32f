"""Block-scaled FP8 (e4m3) weights and dynamically quantized activations: the one rule, and its torch reference.

The released checkpoint's format (DeepSeek-style): a quantized linear stores its weight as float8_e4m3fn [N, K] and
`weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)]; a 128 x 128 block's real value is its fp8 values times its
scale. Products are W8A8:
- activations are quantized per token and per 128-column group of the input (the last group may be shorter):
  s_x = amax(|x_group|) / 448 in fp32 (an all-zero group: s_x = 1), xq = fp8(x / s_x), rounded to nearest even;
- y[t, n] = sum over column groups b of s_x[t, b] * s_w[n // 128, b] * (sum_{k in b} xq[t, k] * wq[n, k]),
  accumulated in fp32, plus the bias in fp32, rounded once to the activation dtype.
Weights are quantized the same way per 128 x 128 block (`quantize_weight`), when a bf16 checkpoint is converted on
load or a random fp8 checkpoint is written. Where stacked parts (a merged projection's parts, an expert's gate and
up rows) have row counts that are not multiples of 128, each part is padded with zero rows to the next multiple, so
every row block belongs to one part.

`linear` dispatches on the GPU (thresholds in `ops.tuning`, kernels in fp8_triton.py):
  up to FP8_GEMV_MAX_TOKENS          one Triton launch on CUDA cores (`fp8_triton.gemv`), x quantized in the kernel;
  below FP8_CUBLAS_MIN_TOKENS        x quantized in its own launch (`fp8_triton.quantize`), then the tensor-core
                                     kernel (`fp8_triton.gemm`);
  from FP8_CUBLAS_MIN_TOKENS         the quantization launch and torch's block-scaled cuBLAS GEMM
                                     (`fp8_triton.cublas_gemm`) where torch and the GPU support it, else the above.
`partial_products` is the tensor-core form with K cut into slices whose fp32 sums its reader adds up (the blocks'
output projections, `ops.linear.output_linear`).

How closely the GPU follows the rule: the GEMV and the tensor-core kernel's 16- and 32-row tiles (up to 32 tokens) are
within 1e-7 of max |y| of it. Hopper's fp8 wgmma (the kernel's 64- and 128-row tiles, and cuBLAS) sums each group's
products in an accumulator narrower than fp32: 2.4-3.3e-4 of max |y| on an H100 at 64-1024 tokens, cuBLAS and Triton
alike. Promoting to fp32 every 32 products (`max_num_imprecise_acc=32`) leaves 6e-5 and costs a quarter to a third more
time at 512 tokens; bf16 dots of the fp8 values are exact but 2.8-3.5x slower at 64-512 tokens: neither is taken. The
next product quantizes its input again, so such differences move some values to the neighbouring e4m3 step (6% apart):
the GPU fp8 model follows the CPU reference in its argmax, its logprobs within a few 1e-2.
"""

from __future__ import annotations

import torch

from . import tuning
from ._dispatch import HAS_TRITON, fast_path

if HAS_TRITON:
    from . import fp8_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
BLOCK = 128


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as an IEEE quotient, 1 where amax is 0. The divisor is a tensor: CUDA torch divides by a Python
    number as a multiply by its reciprocal, which is not exact for 448 and put one H100's quotients one ulp off the
    CPU's (and the Triton kernels') for about a quarter of the blocks."""
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) -> (wq float8_e4m3fn [..., N, K], scale fp32 [..., ceil(N/128), ceil(K/128)])
    with one scale per 128 x 128 block: amax / 448 (1 for an all-zero block). Leading dims (experts) are kept."""
    *lead, n, k = w.shape
    pn, pk = _blocks(n) * BLOCK - n, _blocks(k) * BLOCK - k
    padded = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    blocks = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # [..., nb, 128, kb, 128]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = _scales(amax)
    q = (blocks / scale[..., :, None, :, None]).to(FP8)
    wq = q.flatten(-4, -3).flatten(-2, -1)[..., :n, :k]
    return wq.contiguous(), scale


def expand_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block scales [..., ceil(n/128), ceil(k/128)] -> one scale per element [..., n, k]."""
    return scale.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]


def dequantize_weight(wq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real values of a block-scaled fp8 weight, rounded once to `dtype`."""
    return (wq.float() * expand_scale(scale, wq.shape[-2], wq.shape[-1])).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq float8_e4m3fn [T, K], scale fp32 [T, ceil(K/128)]): one scale per token and 128-column group,
    amax / 448 (1 for an all-zero group)."""
    t, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, _blocks(k) * BLOCK - k))
    groups = padded.unflatten(-1, (-1, BLOCK))  # [T, kb, 128]
    amax = groups.abs().amax(dim=-1)
    scale = _scales(amax)
    xq = (groups / scale[..., None]).to(FP8).flatten(-2)[:, :k]
    return xq.contiguous(), scale


def linear_ref(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The rule of the module docstring: x [T, K] quantized per token and 128-column group, times the block-scaled
    weight wq [N, K] / scale, in fp32; returns [T, N] in x's dtype."""
    xq, sx = quantize_activations(x)
    k = x.shape[-1]
    a = xq.float() * sx.repeat_interleave(BLOCK, dim=-1)[:, :k]
    y = a @ dequantize_weight(wq, scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Block-scaled fp8 projection of x [..., K] by wq [N, K] (see `linear_ref`), dispatched (module docstring)."""
    if x.dim() != 2:
        return linear(x.reshape(-1, x.shape[-1]), wq, scale, bias).reshape(*x.shape[:-1], wq.shape[0])
    if not (HAS_TRITON and fast_path(x) and fp8_triton.supported(x, wq, scale, bias)):
        return linear_ref(x, wq, scale, bias)
    tokens = x.shape[0]
    if tokens <= tuning.FP8_GEMV_MAX_TOKENS:
        return fp8_triton.gemv(x, wq, scale, bias)
    if tokens >= tuning.FP8_CUBLAS_MIN_TOKENS and bias is None:
        layout = fp8_triton.cublas_layout(x, wq, scale)
        if layout is not None:
            return fp8_triton.cublas_gemm(x, wq, scale, layout)
    xq, sx = fp8_triton.quantize(x)
    return fp8_triton.gemm(xq, sx, wq, scale, bias, out_dtype=x.dtype)


def partial_products(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, splits: int) -> torch.Tensor | None:
    """`linear` without bias as `splits` fp32 partial products over slices of K's 128-column groups, [T, splits, N]
    (a view of [splits, T, N]), for a reader that sums them (`ops.linear.output_linear`): their sum is the rule's
    fp32 value up to the order of its additions. The quantization launch and one tensor-core launch; None where the
    kernels do not apply."""
    if not (HAS_TRITON and fast_path(x) and fp8_triton.supported(x, wq, scale)):
        return None
    xq, sx = fp8_triton.quantize(x)
    return fp8_triton.gemm(xq, sx, wq, scale, splits=splits).transpose(0, 1)
