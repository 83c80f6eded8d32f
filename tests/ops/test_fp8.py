"""Block-scaled fp8 (ops.fp8): the quantization rule on known values, and the W8A8 product against its definition
written out block by block."""

import pytest
import torch

from qwen4exp.ops import fp8
from qwen4exp.ops.linear import linear
from qwen4exp.ops.moe import moe_experts_ref


def test_weight_blocks_get_their_own_scale_and_round_trip_within_fp8_precision():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g)
    w[128:, :128] *= 1000  # one block far larger than the rest: its scale must not leak into its neighbours
    w[:128, 256:] = 0  # an all-zero block
    wq, scale = fp8.quantize_weight(w)
    assert wq.dtype == fp8.FP8 and wq.shape == (200, 300)
    assert scale.shape == (2, 3) and scale.dtype == torch.float32
    assert scale[0, 2] == 1.0 and torch.all(wq[:128, 256:].float() == 0)
    for bn, bk in ((0, 0), (1, 0), (1, 2)):
        block = w[bn * 128:(bn + 1) * 128, bk * 128:(bk + 1) * 128]
        assert scale[bn, bk] == block.abs().max() / 448
    back = fp8.dequantize_weight(wq, scale)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of each value (and of the block's scale near zero)
    err = (back - w).abs() / (w.abs() + fp8.expand_scale(scale, 200, 300) * 2**-6)
    assert err.max() <= 2**-4 + 1e-6


def test_activation_groups_are_per_token_and_per_128_columns():
    x = torch.zeros(3, 130)
    x[0, :128] = 2.0
    x[0, 128:] = -7.0
    x[1, 5] = 448.0 * 3
    xq, s = fp8.quantize_activations(x)
    assert s.shape == (3, 2)
    torch.testing.assert_close(s[0], torch.tensor([2 / 448, 7 / 448]))
    assert s[2].tolist() == [1.0, 1.0]  # all-zero groups
    assert xq[0, 0].float() == 448 and xq[0, 129].float() == -448 and xq[1, 5].float() == 448


@pytest.mark.parametrize("tokens,n,k", [(1, 256, 384), (5, 130, 200), (4, 64, 96)])
def test_linear_is_the_block_sum_of_scaled_products(tokens, n, k):
    """y = sum over 128-column groups b of s_x[b] * s_w[n//128, b] * (xq . wq over b), in fp32, rounded once."""
    g = torch.Generator().manual_seed(tokens + n + k)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    wq, sw = fp8.quantize_weight(torch.randn(n, k, generator=g) / k**0.5)
    bias = torch.randn(n, generator=g)
    xq, sx = fp8.quantize_activations(x)
    expected = torch.zeros(tokens, n)
    for b in range(-(-k // 128)):
        cols = slice(b * 128, (b + 1) * 128)
        partial = xq[:, cols].float() @ wq[:, cols].float().t()
        expected += partial * sx[:, b:b + 1] * sw[:, b].repeat_interleave(128)[:n]
    expected = (expected + bias).to(torch.bfloat16)
    got = linear(x, wq, bias, scale=sw)
    assert got.dtype == torch.bfloat16
    # fp32 sums in another order: at most one bf16 rounding step apart
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-3)


def test_fp8_experts_match_their_dequantized_weights_up_to_activation_quantization():
    """The fp8 reference MoE equals the bf16 reference run on the dequantized weights, within the error of
    quantizing the activations (gate rows and up rows padded to 128 each)."""
    g = torch.Generator().manual_seed(3)
    E, H, inter, tokens = 4, 192, 48, 6
    gate = torch.randn(E, inter, H, generator=g) / H**0.5
    up = torch.randn(E, inter, H, generator=g) / H**0.5
    down = torch.randn(E, H, inter, generator=g) / inter**0.5
    padded = torch.zeros(E, 256, H)
    padded[:, :inter], padded[:, 128:128 + inter] = gate, up
    gu_q, gu_s = fp8.quantize_weight(padded)
    d_q, d_s = fp8.quantize_weight(down)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.randint(0, E, (tokens, 2), generator=g)
    w = torch.rand(tokens, 2, generator=g)
    got = moe_experts_ref(x, gu_q, d_q, ids, w, gu_s, d_s)
    gate_up_deq = fp8.dequantize_weight(gu_q, gu_s)
    plain = moe_experts_ref(x, torch.cat([gate_up_deq[:, :inter], gate_up_deq[:, 128:128 + inter]], 1),
                            fp8.dequantize_weight(d_q, d_s), ids, w)
    torch.testing.assert_close(got, plain, rtol=0.1, atol=0.1)
    assert (got - plain).abs().mean() < 0.05 * plain.abs().mean()
