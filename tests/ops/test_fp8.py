"""Block-scaled fp8 (ops.fp8): the quantization rule on known values, the W8A8 product against its definition
written out block by block, and every fast path (fp8_triton.py, the fp8 kernels of moe_triton.py; Triton's
interpreter on the CPU) against the torch reference, with the dispatch that picks them by size."""

import pytest
import torch

from qwen4exp import ops
from qwen4exp.ops import fp8, tuning
from qwen4exp.ops.linear import linear, merged_linear
from qwen4exp.ops.moe import moe_block_ref, moe_experts_ref, silu_mul


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


# ---------------------------------------------------------------------------------------------------------------------
# Fast paths (skipped without Triton; on the GPU when there is one)
# ---------------------------------------------------------------------------------------------------------------------

triton = pytest.importorskip("triton")

from conftest import on_device  # noqa: E402

from qwen4exp.ops import fp8_triton, moe_triton  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


def _weight(n, k, seed, pad_rows=0):
    """A block-quantized random [n, k] weight scaled for unit-variance outputs, as (wq, scale); pad_rows > 0 lays its
    rows out in a wider buffer (row stride k + pad_rows, a multiple of 16 bytes)."""
    g = torch.Generator().manual_seed(seed)
    wq, scale = fp8.quantize_weight(torch.randn(n, k, generator=g) / k**0.5)
    if pad_rows:
        wide = torch.zeros(n, k + pad_rows, dtype=fp8.FP8)
        wide[:, :k] = wq
        wq = wide[:, :k]
    return wq, scale


def _activations(tokens, k, dtype, seed, spread=2.0):
    """Random [tokens, k] activations whose 128-column groups differ in magnitude by about e^spread: every group
    needs its own scale."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.randn(tokens, -(-k // 128), generator=g) * spread).repeat_interleave(128, 1)
    return (torch.randn(tokens, k, generator=g) * magnitude[:, :k]).to(dtype)


def _assert_matches_reference(got, want, tensor_cores: bool):
    """fp32 sums in another order: bf16 outputs at most one rounding step apart, nearly all equal; fp32 outputs within
    the summation order. Hopper's fp8 tensor cores (wgmma: Triton's row tiles of 64 and more, cuBLAS) sum a
    128-column group's products in a narrower accumulator than fp32: up to ~3e-4 of the output's magnitude from the
    rule on an H100, which leaves 5-6% of bf16 outputs one rounding step off (ops/fp8.py)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * want.float().abs().max().item())
        assert (got != want).float().mean() < (0.1 if tensor_cores and ON_GPU else 0.01)
    else:
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-3 if tensor_cores and ON_GPU else 1e-5,
                                   atol=(5e-4 if tensor_cores and ON_GPU else 1e-6) * scale)


def test_quantize_kernel_is_the_reference_bit_for_bit():
    """The quantization launch equals `quantize_activations` exactly: values at every midpoint between fp8 values
    (ties to even, the subnormals included, where the interpreter's own cast rounds otherwise), groups of very
    different magnitudes, an all-zero group, a ragged last group, bf16 input; padding rows and the column-major
    scale layout cuBLAS reads."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    values = values[torch.isfinite(values)].unique()
    midpoints = (values[:-1] + values[1:]) / 2
    row = torch.cat([midpoints, -midpoints, values[:20]])[:384]
    row[0] = 448.0  # the group's amax: scale 1, so x / s is each midpoint itself
    row[128], row[256] = 448.0, -448.0
    x = torch.stack([row, row * 0.37, torch.zeros(384)])
    x = torch.cat([x, _activations(5, 384, torch.float32, 1)])[:, :300]
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        want_q, want_s = fp8.quantize_activations(xd)
        q, s = on_device(fp8_triton.quantize)(xd)
        assert q.dtype == fp8.FP8 and s.dtype == torch.float32
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
        q, s = on_device(fp8_triton.quantize)(xd, rows=16, scale_columns=True)
        assert q.shape == (16, 300) and s.shape == (16, 3) and s.stride() == (1, 16)
        assert torch.equal(q[:8].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s[:8], want_s)
        assert torch.all(q[8:].float() == 0) and torch.all(s[8:] == 1)


@pytest.mark.skipif(not ON_GPU, reason="compares the GPU's torch with the CPU's")
def test_reference_quantization_is_the_same_on_the_gpu():
    """The torch rule run on the GPU (quantize-on-load, the reference) gives the CPU's scales and values bit for bit:
    scales are IEEE quotients there too, not multiplies by a rounded 1/448."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 1000, 300, generator=g)  # leading expert dim, ragged blocks
    x = _activations(64, 300, torch.float32, 4)
    for (q, s), (qd, sd) in ((fp8.quantize_weight(w), fp8.quantize_weight(w.cuda())),
                             (fp8.quantize_activations(x), fp8.quantize_activations(x.cuda()))):
        assert torch.equal(s, sd.cpu()) and torch.equal(q.view(torch.uint8), qd.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,k,tiles,bias", [
    # "gpu": the GPU's default tiles for the shape (the interpreter's default is one step over whole rows)
    (1, 256, 512, "gpu", False),  # one step of 8 groups (4 masked), summed every step
    (1, 64, 256, dict(block_n=8, groups_per_step=4, num_warps=2), False),  # the GPU's tiles from 8192 rows
    (1, 24, 4224, "gpu", True),  # long rows: 16 groups a step, 33 groups (the last step mostly masked)
    (1, 130, 200, "gpu", True),  # ragged rows, ragged last group, bias
    (2, 64, 384, "gpu", False),
    (1, 8192, 256, None, False),  # the platform's default
    (3, 300, 4224, None, True),
    (3, 37, 640, dict(block_n=8, groups_per_step=4, num_warps=1), False),  # 5 groups in steps of 4: the last masked
    (4, 96, 256, dict(block_n=32, groups_per_step=2, num_warps=2), True),
    (8, 24, 72, dict(block_n=16, groups_per_step=1, num_warps=4), False),
    # the accumulator reduced every step; 3 steps of 8 groups over 20 (the last partly masked)
    (1, 40, 2560, dict(block_n=8, groups_per_step=8, num_warps=2, reduce_each_step=True), True),
    (2, 16, 640, dict(block_n=4, groups_per_step=16, num_warps=1, reduce_each_step=True), False),
    # weights read before the PDL wait: none, 2 of 3 steps of 8 groups over 20; both steps of 4 groups over 5
    (1, 40, 2560, dict(block_n=8, groups_per_step=8, num_warps=2, reduce_each_step=True, steps_ahead=0), True),
    (1, 40, 2560, dict(block_n=8, groups_per_step=8, num_warps=2, reduce_each_step=True, steps_ahead=2), False),
    (3, 37, 640, dict(block_n=8, groups_per_step=4, num_warps=1, steps_ahead=2), True),
])
def test_gemv_matches_reference(dtype, tokens, n, k, tiles, bias):
    x = _activations(tokens, k, dtype, seed=tokens + n)
    wq, scale = _weight(n, k, seed=n + k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) if bias else None
    tiles = fp8_triton.gemv_tiles(tokens, n, k) if tiles == "gpu" else tiles
    got = on_device(fp8_triton.gemv)(x, wq, scale, b, tiles=tiles)
    _assert_matches_reference(got, fp8.linear_ref(x, wq, scale, b), tensor_cores=False)


def test_gemv_strided_rows():
    """x a column slice of a wider activation, W rows of a wider buffer (row stride K + 16)."""
    x = _activations(2, 400, torch.bfloat16, 3)[:, 16:272]
    wq, scale = _weight(40, 256, seed=4, pad_rows=16)
    got = on_device(fp8_triton.gemv)(x, wq, scale)
    _assert_matches_reference(got, fp8.linear_ref(x, wq, scale), tensor_cores=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,k,tiles,bias", [
    (1, 64, 256, None, False),
    (5, 130, 200, None, True),
    (16, 96, 384, None, False),
    (33, 160, 320, None, False),
    (64, 48, 128, None, True),
    # several row tiles in grouped order, ragged rows, columns and groups: a prefill-shaped launch
    (150, 200, 330, dict(block_m=32, block_n=64, group_m=2, num_warps=4, num_stages=2), False),
])
def test_gemm_matches_reference(dtype, tokens, n, k, tiles, bias):
    """The quantization launch and the tensor-core kernel reading its output."""
    x = _activations(tokens, k, dtype, seed=tokens + k)
    wq, scale = _weight(n, k, seed=n)
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) if bias else None

    def run(x, wq, scale, b):
        return fp8_triton.gemm(*fp8_triton.quantize(x), wq, scale, b, out_dtype=x.dtype, tiles=tiles)
    _assert_matches_reference(on_device(run)(x, wq, scale, b), fp8.linear_ref(x, wq, scale, b), tensor_cores=True)


@pytest.mark.parametrize("tokens,n,k,splits", [
    (2, 96, 640, 4),  # 5 groups in slices of 2, 2, 1
    (20, 64, 512, 2),
    (3, 40, 200, 4),  # 2 groups, a ragged last one: two slices empty
])
def test_gemm_split_products_sum_to_the_reference(tokens, n, k, splits):
    """K cut into slices of 128-column groups: fp32 partial products [splits, M, N] whose sum, rounded to the
    activations' dtype (as the reading combine rounds it), is the product."""
    x = _activations(tokens, k, torch.bfloat16, seed=tokens + k)
    wq, scale = _weight(n, k, seed=n)

    def run(x, wq, scale):
        return fp8_triton.gemm(*fp8_triton.quantize(x), wq, scale, splits=splits)
    parts = on_device(run)(x, wq, scale)
    assert parts.shape == (splits, tokens, n) and parts.dtype == torch.float32
    groups = -(-k // 128)
    assert torch.all(parts[-(-groups // -(-groups // splits)):] == 0)  # slices past K's groups
    _assert_matches_reference(parts.sum(0).to(x.dtype), fp8.linear_ref(x, wq, scale), tensor_cores=True)


def test_output_projections_give_partial_products_past_the_gemv(monkeypatch):
    """A block's fp8 output projection (ops.linear.output_linear) on the fast path, with FP8_OUTPUT_SPLITS = 4: the
    GEMV's output at one token, 4 partial products [T, 4, N] from two tokens to PARTIALS_MAX_TOKENS, whose sum is
    the product; a plain product past it, off the fast path, and with FP8_OUTPUT_SPLITS = 1."""
    from qwen4exp.ops.linear import output_linear

    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    monkeypatch.setattr(tuning, "PARTIALS_MAX_TOKENS", 8)
    monkeypatch.setattr(tuning, "FP8_OUTPUT_SPLITS", 4)
    wq, scale = (t.to(DEV) for t in _weight(48, 512, seed=5))
    for tokens, parts in ((1, None), (2, 4), (8, 4), (9, None)):
        x = _activations(tokens, 512, torch.bfloat16, tokens).to(DEV)
        got = output_linear(x, wq, scale=scale)
        want = fp8.linear_ref(x, wq, scale)
        if parts is None:
            assert got.shape == (tokens, 48)
        else:
            assert got.shape == (tokens, parts, 48) and got.dtype == torch.float32
            got = got.sum(1).to(x.dtype)
        _assert_matches_reference(got, want, tensor_cores=tokens > 1)
    monkeypatch.setattr(tuning, "FP8_OUTPUT_SPLITS", 1)
    assert output_linear(x[:2], wq, scale=scale).shape == (2, 48)
    monkeypatch.setattr(tuning, "FP8_OUTPUT_SPLITS", 4)
    monkeypatch.setattr(ops.settings, "fast_on_cpu", False)
    if not ON_GPU:
        assert output_linear(x[:2], wq, scale=scale).shape == (2, 48)


def test_supported_shapes():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    wq, scale = _weight(40, 256, seed=0)
    assert fp8_triton.supported(x, wq, scale)
    assert fp8_triton.supported(x, wq, scale, torch.zeros(40))
    assert not fp8_triton.supported(x.double(), wq, scale)
    assert not fp8_triton.supported(x, wq, scale[:, :1])  # scales of another shape
    assert not fp8_triton.supported(x, wq, scale.double())
    assert not fp8_triton.supported(x, wq, scale, torch.zeros(41))
    assert not fp8_triton.supported(x[:, :200], *_weight(40, 200, seed=0))  # rows of 200 bytes: not 16-byte aligned
    assert not fp8_triton.supported(x, wq.t().contiguous().t(), scale)  # K not unit-stride


def test_dispatch_by_tokens(monkeypatch):
    """With the fast path on (the interpreter stands in for the GPU), each token count takes its implementation: the
    GEMV, the quantization launch + the tensor-core kernel (the CPU has no cuBLAS block GEMM, so also past
    FP8_CUBLAS_MIN_TOKENS); 3-D inputs, merged projections and ops.linear included; the results equal the
    reference."""
    calls = []
    for name in ("gemv", "gemm", "quantize"):
        real = getattr(fp8_triton, name)
        monkeypatch.setattr(fp8_triton, name, lambda *a, _name=name, _real=real, **kw: calls.append(
            _name) or _real(*a, **kw))
    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    monkeypatch.setattr(tuning, "FP8_GEMV_MAX_TOKENS", 1)
    monkeypatch.setattr(tuning, "FP8_CUBLAS_MIN_TOKENS", 8)
    wq, scale = _weight(48, 256, seed=2)
    wq, scale = wq.to(DEV), scale.to(DEV)
    cublas = fp8_triton.cublas_layout(torch.zeros(1, 256, dtype=torch.bfloat16, device=DEV), wq, scale) is not None
    expected = {1: ["gemv"], 2: ["quantize", "gemm"], 5: ["quantize", "gemm"],
                9: ["quantize"] + ([] if cublas else ["gemm"])}  # (cuBLAS on a GPU that has it)
    for tokens, path in expected.items():
        calls.clear()
        x = _activations(tokens, 256, torch.bfloat16, tokens).to(DEV)
        got = linear(x, wq, scale=scale)
        assert calls == path, tokens
        _assert_matches_reference(got, fp8.linear_ref(x, wq, scale), tensor_cores=tokens > 1)
    x3 = _activations(6, 256, torch.bfloat16, 6).to(DEV).view(2, 3, 256)
    torch.testing.assert_close(fp8.linear(x3, wq, scale), fp8.linear(x3.reshape(6, 256), wq, scale).view(2, 3, 48))
    a, b = merged_linear(x3[0], wq, (16, 20), scale=scale)
    assert a.shape == (3, 16) and b.shape == (3, 20)
    torch.testing.assert_close(torch.cat([a, b], 1), fp8.linear(x3[0], wq, scale)[:, :36])
    calls.clear()
    fp8.linear(x3[0].double(), wq, scale)  # unsupported: the reference
    assert calls == []


@pytest.mark.skipif(not ON_GPU, reason="cuBLAS's block-scaled GEMM needs a GPU")
@pytest.mark.parametrize("tokens,n,k", [(1, 4096, 2560), (77, 256, 640), (1000, 2560, 6144), (4096, 1280, 2560)])
def test_cublas_block_gemm_matches_reference(tokens, n, k):
    """The quantization launch + torch's block-scaled cuBLAS GEMM, where torch and the GPU have it: any row count
    (padded to 16), K/128 not a multiple of 4 (640)."""
    x = _activations(tokens, k, torch.bfloat16, tokens).cuda()
    wq, scale = (t.cuda() for t in _weight(n, k, seed=k))
    layout = fp8_triton.cublas_layout(x, wq, scale)
    if layout is None:
        pytest.skip("no block-scaled cuBLAS GEMM for this torch / GPU")
    _assert_matches_reference(fp8_triton.cublas_gemm(x, wq, scale, layout), fp8.linear_ref(x, wq, scale), True)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_linear_is_captured_in_cuda_graphs():
    """Every small-step path replays from a CUDA graph with new inputs (static shapes, no host syncs)."""
    wq, scale = (t.cuda() for t in _weight(512, 2560, seed=1))
    for tokens in (1, 8, 64):
        x = _activations(tokens, 2560, torch.bfloat16, tokens).cuda()
        fp8.linear(x, wq, scale)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8.linear(x, wq, scale)
        x.copy_(_activations(tokens, 2560, torch.bfloat16, tokens + 100).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fp8.linear(x, wq, scale))


# ---- MoE ----


def _fp8_experts(e, h, inter, seed):
    """fp8 experts as the checkpoint holds them: gate_up rows [gate padded to I', up padded to I'], down [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    ip = -(-inter // 128) * 128
    padded = torch.zeros(e, 2 * ip, h)
    padded[:, :inter] = torch.randn(e, inter, h, generator=g) / h**0.5
    padded[:, ip:ip + inter] = torch.randn(e, inter, h, generator=g) / h**0.5
    gu, gu_s = fp8.quantize_weight(padded)
    dn, dn_s = fp8.quantize_weight(torch.randn(e, h, inter, generator=g) / inter**0.5)
    return gu, gu_s, dn, dn_s


def _routing(n, e, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return ids, torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)


def _shared(n, h, inter, dtype, kind, seed):
    """The shared expert as moe_experts takes it: None, bf16 (gate, up, down, logit) or fp8 (..., down scale); gate,
    up and logit strided views of one router output, as the model passes them."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    merged = torch.randn(n, 3 + 1 + 2 * inter, generator=g).to(dtype)
    logit, sg, su = merged[:, 3:4], merged[:, 4:4 + inter], merged[:, 4 + inter:]
    w = torch.randn(h, inter, generator=g) / inter**0.5
    if kind == "fp8":
        wq, scale = fp8.quantize_weight(w)
        return sg, su, wq, logit, scale
    return sg, su, w.to(dtype), logit


def _moe_reference(x, gu, gu_s, dn, dn_s, ids, w, shared):
    """moe_experts on the reference path (the CPU's)."""
    shared_out = None
    if shared is not None:
        shared_out = (linear(silu_mul(shared[0], shared[1]), shared[2], scale=shared[4] if len(shared) == 5 else None),
                      shared[3])
    return moe_block_ref(x, gu, dn, ids, w, shared_out, gu_s, dn_s)


def _assert_moe_close(out, ref, tensor_cores: bool = False):
    """The experts' activations are quantized after a sum whose order differs from the reference's (and, in bf16, after
    rounding it): now and then one lands on the other side of an fp8 rounding step, which moves its token's outputs
    by up to ~1e-2 of their magnitude; otherwise fp32 outputs agree to the summation order (~3e-7 here) and bf16
    outputs to the reference's bf16 sum of the experts (a mean 0.3-0.4% of the mean output for the fp8 kernels, 0.8%
    for the bf16 ones). Where Hopper's fp8 wgmma runs (64-row tiles on the GPU) its narrower accumulator sends more
    activations across a rounding step: a mean 1.3e-3 of the mean fp32 output on an H100. A wrong expert, scale or
    group moves most outputs by far more."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    scale = ref.float().abs()
    assert diff.max() < 3e-2 * scale.max(), (diff.max() / scale.max()).item()
    bound = 1.5e-2 if ref.dtype == torch.bfloat16 else 4e-3 if tensor_cores and ON_GPU else 1e-3
    assert diff.mean() < bound * scale.mean(), diff.mean() / scale.mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,h,inter,e,k,shared,shared_inter", [
    (1, 256, 128, 8, 2, None, 0),
    (3, 200, 130, 8, 3, "bf16", 96),  # ragged H, I = 130 padded to 256 in gate_up, ragged shared width
    (2, 384, 96, 6, 2, "fp8", 300),
    (9, 128, 64, 16, 4, "fp8", 64),
])
def test_pairwise_fp8_experts_match_reference(dtype, n, h, inter, e, k, shared, shared_inter):
    gu, gu_s, dn, dn_s = _fp8_experts(e, h, inter, seed=n + h)
    x = _activations(n, h, dtype, seed=n, spread=0.5)
    ids, w = _routing(n, e, k, dtype, seed=n)
    sh = _shared(n, h, shared_inter, dtype, shared, seed=n)
    out = on_device(moe_triton.pairwise_moe_fp8)(x, gu, gu_s, dn, dn_s, ids, w, shared_expert=sh, block_n=32,
                                                 down_block_n=32)
    _assert_moe_close(out, _moe_reference(x, gu, gu_s, dn, dn_s, ids, w, sh))


_SMALL = moe_triton.MoEConfig(block_m=16, gate_up=moe_triton.Tile(block_n=128, block_k=128),
                              down=moe_triton.Tile(block_n=32, block_k=128, group_m=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,h,inter,e,k,config", [
    (1, 256, 128, 8, 2, None),
    (17, 200, 130, 8, 3, _SMALL),  # ragged H and I (gate and up rows padded to 256)
    (64, 128, 256, 16, 4, None),
    (300, 128, 128, 8, 2, None),  # a prefill size: 75 rows an expert, 64-row tiles
])
def test_fused_fp8_experts_match_reference(dtype, n, h, inter, e, k, config):
    gu, gu_s, dn, dn_s = _fp8_experts(e, h, inter, seed=n + inter)
    x = _activations(n, h, dtype, seed=n, spread=0.5)
    ids, w = _routing(n, e, k, dtype, seed=n)
    out = on_device(moe_triton.fused_moe_fp8)(x, gu, gu_s, dn, dn_s, ids, w, config=config)
    block_m = (config or moe_triton.get_fp8_config(n, e, k)).block_m
    _assert_moe_close(out, _moe_reference(x, gu, gu_s, dn, dn_s, ids, w, None), tensor_cores=block_m >= 64)


@pytest.mark.parametrize("num_tokens", [1, 400, 8192])
def test_fused_fp8_every_config_tier(num_tokens):
    """Each tier of get_fp8_config (16, 32, 64 rows at the released 128 experts, top-10) on a small problem, with a
    gated shared expert added in the sum."""
    config = moe_triton.get_fp8_config(num_tokens, 128, 10)
    gu, gu_s, dn, dn_s = _fp8_experts(8, 128, 128, seed=num_tokens)
    x = _activations(40, 128, torch.float32, seed=1, spread=0.5)
    ids, w = _routing(40, 8, 3, torch.float32, seed=2)
    g = torch.Generator().manual_seed(3)
    shared = (torch.randn(40, 128, generator=g), torch.randn(40, 1, generator=g))
    out = on_device(moe_triton.fused_moe_fp8)(x, gu, gu_s, dn, dn_s, ids, w, config=config, shared=shared)
    _assert_moe_close(out, moe_block_ref(x, gu, dn, ids, w, shared, gu_s, dn_s))


def test_fp8_config_tiers_follow_the_bf16_ones():
    """The fp8 fused kernels change tiles where the bf16 ones do, so a warm-up step of each bf16 variant also
    compiles each fp8 one."""
    for n in (1, 100, 204, 205, 400, 614, 615, 2000, 8192):
        bf16 = moe_triton.get_config(n, 128, 10, 2560, 640).block_m
        assert moe_triton.get_fp8_config(n, 128, 10).block_m == min(bf16, 64), n


@pytest.mark.parametrize("routed,shared", [("fp8", "fp8"), ("fp8", "bf16"), ("fp8", None), ("bf16", "fp8")])
def test_moe_experts_dispatch(monkeypatch, routed, shared):
    """moe_experts on the fast path: fp8 experts take the pairwise kernels up to PAIRWISE_MAX_PAIRS pairs and the
    fused ones past it; bf16 experts with an fp8 shared down projection keep the bf16 kernels with the shared output
    computed beforehand. Results equal the reference's."""
    from qwen4exp.ops import moe

    calls = []
    for name in ("pairwise_moe_fp8", "fused_moe_fp8", "pairwise_moe", "fused_moe"):
        real = getattr(moe_triton, name)
        monkeypatch.setattr(moe_triton, name, lambda *a, _name=name, _real=real, **kw: calls.append(_name) or
                            _real(*a, **kw))
    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    monkeypatch.setattr(tuning, "PAIRWISE_MAX_PAIRS", 6)
    monkeypatch.setattr(tuning, "GROUPED_MM_MIN_PAIRS", 1 << 40)
    dtype = torch.bfloat16
    gu, gu_s, dn, dn_s = _fp8_experts(8, 128, 64, seed=5)
    if routed == "bf16":
        gu = fp8.dequantize_weight(gu, gu_s, dtype)[:, torch.cat([torch.arange(64), 128 + torch.arange(64)])]
        dn, gu_s, dn_s = fp8.dequantize_weight(dn, dn_s, dtype), None, None
    for n, path in ((3, "pairwise"), (4, "fused")):
        calls.clear()
        x = _activations(n, 128, dtype, seed=n, spread=0.5).to(DEV)
        ids, w = (t.to(DEV) for t in _routing(n, 8, 2, dtype, seed=n))
        sh = _shared(n, 128, 64, dtype, shared, seed=n)
        sh = tuple(t.to(DEV) for t in sh) if sh is not None else None
        args = [t.to(DEV) if t is not None else None for t in (gu, dn, gu_s, dn_s)]
        out = moe.moe_experts(x, args[0], args[1], ids, w, sh, args[2], args[3])
        want = path + ("_moe_fp8" if routed == "fp8" else "_moe")
        assert calls == [want], (n, calls)
        with ops.settings.override(reference=True):
            ref = moe.moe_experts(x, args[0], args[1], ids, w, sh, args[2], args[3])
        _assert_moe_close(out, ref)


@pytest.mark.skipif(not ON_GPU, reason="streams need a GPU")
def test_fp8_shared_expert_on_a_side_stream_in_graphs():
    """fp8 experts with an fp8 shared expert at fused sizes: the shared expert runs on a side stream; eager and
    replayed from a CUDA graph with new inputs, the result equals computing it in line."""
    from qwen4exp.ops import moe

    n, h, inter, e, k = 64, 256, 128, 32, 4
    gu, gu_s, dn, dn_s = (t.cuda() for t in _fp8_experts(e, h, inter, seed=7))
    x = _activations(n, h, torch.bfloat16, seed=7, spread=0.5).cuda()
    ids, w = (t.cuda() for t in _routing(n, e, k, torch.bfloat16, seed=7))
    sh = tuple(t.cuda() for t in _shared(n, h, 96, torch.bfloat16, "fp8", seed=7))

    def side():
        return moe.moe_experts(x, gu, dn, ids, w, sh, gu_s, dn_s)

    def in_line():
        shared_out = (fp8.linear(silu_mul(sh[0], sh[1]), sh[2], sh[4]), sh[3])
        return moe_triton.fused_moe_fp8(x, gu, gu_s, dn, dn_s, ids, w, shared=shared_out)

    assert torch.equal(side(), in_line())
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        side()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = side()
    x.copy_(_activations(n, h, torch.bfloat16, seed=8, spread=0.5).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, in_line())
