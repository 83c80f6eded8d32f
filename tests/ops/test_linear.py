"""Few-token Triton GEMV against F.linear (interpreted on CPU), and its dispatch from ops.linear."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from conftest import on_device

import qwen4exp.ops as ops
from qwen4exp.model.merged_linear import MergedLinear
from qwen4exp.ops import linear as linear_ops
from qwen4exp.ops.linear_triton import default_tiles, gemv, supported
from qwen4exp.ops.tuning import GEMV_MAX_TOKENS as MAX_TOKENS

gemv = on_device(gemv)


def _inputs(tokens, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 131 * tokens + n + k)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, w


def _tol(dtype):
    # bf16: the interpreter (Triton 3.9) truncates fp32 -> bf16 where the GPU rounds to nearest: within one ulp
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,k,tiles", [
    (1, 40, 256, {}),
    (MAX_TOKENS, 24, 128, {}),
    (3, 24, 128, {}),
    # N and K not multiples of the blocks: a partial last row block and a masked last K chunk
    (1, 37, 200, dict(block_n=4, block_k=64)),
    (MAX_TOKENS, 19, 200, dict(block_n=8, block_k=32, num_warps=2)),
    (2, 5, 72, dict(block_n=1, block_k=16, num_warps=1)),
    # weights read before the PDL wait: 3 of 5 chunks (the masked last one after), every chunk
    (1, 37, 200, dict(block_n=4, block_k=64, steps_ahead=3)),
    (2, 19, 200, dict(block_n=8, block_k=64, num_warps=2, steps_ahead=4)),
])
def test_matches_f_linear(dtype, tokens, n, k, tiles):
    x, w = _inputs(tokens, n, k, dtype)
    y = gemv(x, w, **tiles)
    assert y.dtype == dtype and y.shape == (tokens, n)
    torch.testing.assert_close(y, F.linear(x, w), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows(dtype):
    """x as a column slice of a wider activation (row stride > K) and W as rows of a wider, padded buffer."""
    tokens, n, k = 2, 21, 96
    x_wide, w_wide = _inputs(tokens, n + 3, k + 32, dtype, seed=5)
    x, w = x_wide[:, 16: 16 + k], w_wide[:n, :k]
    y = gemv(x, w, block_n=4, block_k=32)
    torch.testing.assert_close(y, F.linear(x, w), **_tol(dtype))


@pytest.mark.parametrize("ahead", [0, 1, 2, 4])
def test_every_k_chunk_and_row_counts(ahead):
    """x nonzero in one K chunk at a time (the masked tail included) and W nonzero in one row at a time, with the
    first `ahead` of the 4 chunks of weights read before the PDL wait: a dropped or repeated chunk, or a misplaced
    row, gives a wrong (or zero) output."""
    tokens, n, k, block_k = 2, 10, 100, 32
    x, w = _inputs(tokens, n, k, torch.float32, seed=9)
    tiles = dict(block_n=4, block_k=block_k, steps_ahead=ahead)
    for k0 in range(0, k, block_k):
        xc = torch.zeros_like(x)
        xc[:, k0: k0 + block_k] = x[:, k0: k0 + block_k]
        torch.testing.assert_close(gemv(xc, w, **tiles), F.linear(xc, w), rtol=1e-5, atol=1e-6)
    for row in range(n):
        wr = torch.zeros_like(w)
        wr[row] = w[row]
        torch.testing.assert_close(gemv(x, wr, **tiles), F.linear(x, wr), rtol=1e-5, atol=1e-6)


def test_supported_shapes():
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(40, 64, dtype=torch.bfloat16)
    assert supported(x, w)
    assert supported(torch.zeros(MAX_TOKENS, 64, dtype=torch.bfloat16), w)
    assert not supported(x.float(), w)  # mixed dtypes
    assert not supported(torch.zeros(1, 60, dtype=torch.bfloat16), torch.zeros(40, 60, dtype=torch.bfloat16))  # rows
    assert not supported(x, w.t().contiguous().t())  # K not unit-stride in W


def test_tiles_depend_on_shapes_only():
    """Defaults at the flash-next widths (what a captured decode graph runs), the fastest measured on the H200."""
    assert default_tiles(1, 2560, 6144) == dict(block_n=4, block_k=512, num_warps=4)
    assert default_tiles(1, 16480, 2560) == dict(block_n=1, block_k=256, num_warps=1)
    assert default_tiles(1, 1416, 2560) == dict(block_n=1, block_k=256, num_warps=1)
    assert default_tiles(1, 2560, 6144, element_size=4)["block_k"] == 256


def test_cpu_path_is_f_linear():
    x, w = _inputs(2, 24, 64, torch.float32)
    b = torch.randn(24)
    assert torch.equal(linear_ops.linear(x, w), F.linear(x, w))
    assert torch.equal(linear_ops.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("small_weight", [True, False])
def test_dispatch_on_the_fast_path(monkeypatch, small_weight):
    """With the fast path on (the interpreter stands in for the GPU), few tokens take the kernel, including a
    MergedLinear's padded weight; more tokens and biases take F.linear. A small weight (tuning.GEMV_SMALL_WEIGHT)
    takes it up to tuning.GEMV_SMALL_MAX_TOKENS, a larger one up to tuning.GEMV_MAX_TOKENS."""
    calls = []
    import qwen4exp.ops.linear_triton as tlin

    real = tlin.gemv
    monkeypatch.setattr(tlin, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    if not small_weight:  # this test's weight, 512 elements, counts as large
        monkeypatch.setattr(ops.tuning, "GEMV_SMALL_WEIGHT", 511)
    limit = ops.tuning.GEMV_SMALL_MAX_TOKENS if small_weight else MAX_TOKENS
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    merged = MergedLinear(32, {"a": 5, "b": 1, "c": 7}).to(dev)  # 13 rows + 3 zero rows of padding
    assert merged.weight.shape == (16, 32)
    weights = [view for _, view in merged.part_tensors()]
    for w in weights:
        w.copy_(torch.randn(w.shape, generator=g).to(dev))
    for tokens in (1, limit, limit + 1):
        x = torch.randn(tokens, 32, generator=g).to(dev)
        with torch.no_grad():
            got = merged(x)
        for y, w in zip(got, weights):
            torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == [1, limit]
    linear_ops.linear(x[:1], weights[0], torch.zeros(5, device=dev))
    assert calls == [1, limit]


@pytest.mark.parametrize("small_weight", [True, False])
def test_output_linear_gives_partials_past_the_gemv(monkeypatch, small_weight):
    """A block's output projection on the fast path: the GEMV's [T, N] while it reaches (small weights up to
    tuning.GEMV_SMALL_MAX_TOKENS, so that the next mix can take its decode kernels), then tuning.OUTPUT_SPLITS fp32
    partial products summing to the product."""
    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    if not small_weight:
        monkeypatch.setattr(ops.tuning, "GEMV_SMALL_WEIGHT", 511)
    limit = ops.tuning.GEMV_SMALL_MAX_TOKENS if small_weight else MAX_TOKENS
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 32, generator=g).to(dev)
    for tokens in (1, 2, limit, limit + 1):
        x = torch.randn(tokens, 32, generator=g).to(dev)
        y = linear_ops.output_linear(x, w)
        partials = tokens > limit
        assert y.dim() == (3 if partials else 2)
        torch.testing.assert_close(y.sum(1) if partials else y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5])
def test_fp32_out_linear_keeps_the_accumulator(tokens):
    """The logits GEMM: bf16 operands, the fp32 result not rounded to bf16; the reference (widening a few weight rows
    at a time, here 7 of 20) and the GPU's cuBLAS call give the fp32 product of the bf16 values."""
    x, w = _inputs(tokens, 20, 256, torch.bfloat16)
    want = F.linear(x.float(), w.float())
    ref = linear_ops.fp32_out_linear(x, w, chunk_rows=7)
    assert ref.dtype == torch.float32
    torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ref, want.bfloat16().float())  # not rounded to bf16
    fast = on_device(linear_ops.fp32_out_linear)(x, w)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-5)
