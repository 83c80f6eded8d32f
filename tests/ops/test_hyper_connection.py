"""Hyper-connection kernels against the torch reference, interpreted on CPU: the decode mix (two split-K Triton
launches) and the combine + norm pass of larger batches."""

import pytest
import torch

pytest.importorskip("triton")

from conftest import on_device

from qwen4exp.ops.hyper_connection import hc_combine, hc_mix_ref
from qwen4exp.ops.hyper_connection_triton import hc_mix_decode, hc_prenorm, supported
from qwen4exp.ops.norm import rms_norm

hc_mix_decode = on_device(hc_mix_decode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,rank,inject,tiles", [
    (1, 64, 16, True, {}), (3, 80, 24, True, {}), (4, 64, 16, False, {}), (2, 128, 40, True, {}),
    # several K chunks per stream and row blocks ending inside the inject rows; partial column blocks
    (2, 192, 40, True, dict(block_rows=8, chunk=64, block_h=32)), (1, 128, 20, False, dict(chunk=32, block_h=8)),
    # the GPU's default tiles (the interpreter's default is one row block and one up program)
    (1, 64, 16, True, dict(block_rows=16, block_h=4)), (2, 64, 16, True, dict(block_rows=8, block_h=4)),
    # W_up in column tiles: 3 (a ragged last one), all read before the wait; 5, the fifth read after it
    (1, 64, 40, True, dict(block_h=16, up_chunk=16)), (2, 80, 40, False, dict(block_h=32, up_chunk=8)),
])
@pytest.mark.parametrize("pending", [False, True])
def test_matches_reference(dtype, tokens, hidden, rank, inject, tiles, pending):
    """The mix of the streams, with the previous block's output combined into them first when one is pending: the
    combined streams equal the eager combine's exactly."""
    hc = 4
    g = torch.Generator().manual_seed(tokens + hidden)
    streams = (torch.randn(tokens, hc * hidden, generator=g) * 3).to(dtype)
    norm_w = (torch.randn(hc * hidden, generator=g) * 0.1).to(dtype)
    rows = rank + (hc if inject else 0)
    # as the model stores it: down rows, inject rows, then zero padding up to a multiple of 8
    w_di = torch.zeros(rows + (-rows) % 8, hc * hidden, dtype=dtype)
    w_di[:rows] = (torch.randn(rows, hc * hidden, generator=g) / (hc * hidden) ** 0.5).to(dtype)
    w_up = (torch.randn(hc * hidden, rank, generator=g) / rank**0.5).to(dtype)
    block_out = block_inject = None
    want_streams = streams
    if pending:
        block_out = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
        block_inject = (torch.rand(tokens, hc, generator=g) * 2).to(dtype)
        want_streams = hc_combine.eager(streams, block_out, block_inject)

    new, mixed, inj = hc_mix_decode(streams, norm_w, w_di, w_up, 1e-6, hc, rank, inject, block_out, block_inject,
                                    **tiles)
    assert torch.equal(new, want_streams)
    ref_mixed, ref_inj = hc_mix_ref.eager(want_streams, norm_w, w_di, w_up, 1e-6, hc, rank, inject)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert mixed.dtype == dtype and mixed.shape == (tokens, hidden)
    torch.testing.assert_close(mixed, ref_mixed, **tol)
    if inject:
        torch.testing.assert_close(inj, ref_inj, **tol)
    else:
        assert inj is None


@pytest.mark.parametrize("small_width", [False, True])
def test_dispatch_takes_the_decode_kernels_up_to_the_token_threshold(monkeypatch, small_width):
    """hc_mix runs the two decode launches up to tuning.HC_DECODE_MAX_TOKENS tokens (HC_DECODE_SMALL_MAX_TOKENS for
    streams of at most HC_DECODE_SMALL_WIDTH columns) and the norm pass beyond it; a stream width whose blocks would
    straddle streams never takes the decode kernels."""
    from qwen4exp import ops
    from qwen4exp.ops import hyper_connection, hyper_connection_triton

    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    calls = []
    real = hyper_connection_triton.hc_mix_decode
    monkeypatch.setattr(hyper_connection_triton, "hc_mix_decode", lambda *a, **k: calls.append(a[0].shape[0]) or
                        real(*a, **k))
    hc, hidden, rank = 4, 64, 16
    w_di, w_up = torch.zeros(24, hc * hidden), torch.zeros(hc * hidden, rank)
    if not small_width:
        monkeypatch.setattr(ops.tuning, "HC_DECODE_SMALL_WIDTH", hc * hidden - 1)
    limit = ops.tuning.HC_DECODE_SMALL_MAX_TOKENS if small_width else ops.tuning.HC_DECODE_MAX_TOKENS
    for tokens in (limit, limit + 1):
        on_device(hyper_connection.hc_mix)(torch.ones(tokens, hc * hidden), torch.zeros(hc * hidden), w_di, w_up, 1e-6,
                                           hc, rank, True)
    assert calls == [limit]
    assert supported(torch.zeros(1, 4 * 64), 4)
    assert not supported(torch.zeros(1, 4 * 60), 4)  # blocks of 60 / 2^k < 16 would straddle streams


def test_repeated_calls_rearm_the_arrival_counters():
    """The last program of each row block resets its counter: a second call (as a graph replay would make) with new
    inputs gives the new inputs' result, and the counters are left at zero."""
    from qwen4exp.ops.hyper_connection_triton import _counters

    hc, hidden, rank = 4, 64, 16
    g = torch.Generator().manual_seed(7)
    norm_w = torch.randn(hc * hidden, generator=g) * 0.1
    w_di = torch.randn(rank + hc, hc * hidden, generator=g) / (hc * hidden) ** 0.5
    w_up = torch.randn(hc * hidden, rank, generator=g) / rank**0.5
    for _ in range(3):
        streams = torch.randn(2, hc * hidden, generator=g)
        _, mixed, inj = hc_mix_decode(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True, block_rows=8, chunk=32)
        ref_mixed, ref_inj = hc_mix_ref.eager(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True)
        torch.testing.assert_close(mixed, ref_mixed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inj, ref_inj, rtol=1e-5, atol=1e-5)
    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())


hc_prenorm = on_device(hc_prenorm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,pending,block_tokens", [
    (1, 64, True, None), (5, 80, True, None), (3, 64, False, None), (2, 100, True, None),
    (5, 80, True, 1), (3, 64, False, 1), (7, 48, True, 4)])  # the GPU's one token a program; partial token blocks
def test_prenorm_matches_combine_then_norm(dtype, tokens, hidden, pending, block_tokens):
    """The Triton pass of the mix for two tokens and up: the deferred combine and the per-stream RMSNorm, against
    the eager combine and norm. The combined streams are bitwise the eager combine's (same roundings; Triton's
    interpreter truncates every conversion to bf16 whatever the rounding mode, so there the reference truncates)."""
    hc = 4
    g = torch.Generator().manual_seed(tokens * hidden)
    streams = (torch.randn(tokens, hc * hidden, generator=g) * 3).to(dtype)
    norm_w = (torch.randn(hc * hidden, generator=g) * 0.1).to(dtype)
    block_out = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype) if pending else None
    inject = (torch.rand(tokens, hc, generator=g) * 2).to(dtype) if pending else None

    new, normed = hc_prenorm(streams, norm_w, 1e-6, hc, block_out, inject, block_tokens=block_tokens)
    ref_new = hc_combine.eager(streams, block_out, inject) if pending else streams
    if dtype == torch.bfloat16 and not torch.cuda.is_available() and pending:
        # the eager combine's two roundings, each a truncation as the interpreter does them
        def trunc(x):
            return (x.float().view(torch.int32) & -65536).view(torch.float32)

        prod = trunc(block_out.float()[:, None, :] * inject.float()[:, :, None]).flatten(1)
        ref_new = trunc(streams.float() + prod).to(dtype)
    ref_normed = rms_norm.eager(ref_new, norm_w, 1e-6, hidden)
    assert new.dtype == normed.dtype == dtype and normed.shape == streams.shape
    if dtype == torch.float32:
        torch.testing.assert_close(new, ref_new, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-5)
        return
    assert torch.equal(new, ref_new)
    # an ulp where the fp32 sums of squares (reduced in another order), or the interpreter's truncation, differ
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=2**-7, atol=1e-6)


def test_prenorm_reads_strided_rows():
    hc, hidden = 4, 32
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(3, hc * hidden + 16, generator=g)
    streams = wide[:, : hc * hidden]
    norm_w = torch.randn(hc * hidden, generator=g) * 0.1
    block_out = torch.randn(3, 2 * hidden, generator=g)[:, hidden:]
    inject = torch.rand(3, hc + 2, generator=g)[:, :hc]
    new, normed = hc_prenorm(streams, norm_w, 1e-6, hc, block_out, inject)
    ref_new = hc_combine.eager(streams, block_out, inject)
    torch.testing.assert_close(new, ref_new, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, rms_norm.eager(ref_new, norm_w, 1e-6, hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inject", [True, False])
def test_mix_activates_rank_and_inject_columns_like_separate_slices(dtype, inject):
    """hc_mix_normed activates the down projection's output in one pass (silu on the rank columns, 2 sigmoid on the
    inject columns, padding columns ignored); it equals the model's formula on the two slices: bit for bit in bf16,
    within an ulp in fp32 (the CPU's vectorised and scalar sigmoid differ in the last bit)."""
    import torch.nn.functional as F

    from qwen4exp.ops.hyper_connection import hc_mix_normed

    hc, hidden, rank, tokens = 4, 48, 20, 5
    g = torch.Generator().manual_seed(3)
    normed = torch.randn(tokens, hc * hidden, generator=g).to(dtype)
    rows = rank + (hc if inject else 0)
    w_di = torch.zeros(rows + (-rows) % 8, hc * hidden, dtype=dtype)
    w_di[:rows] = (torch.randn(rows, hc * hidden, generator=g) / (hc * hidden) ** 0.5 * 8).to(dtype)
    w_up = (torch.randn(hc * hidden, rank, generator=g) / rank**0.5).to(dtype)

    down = F.linear(normed, w_di)
    gate = torch.sigmoid(F.linear(F.silu(down[:, :rank] / hc), w_up))
    want_mixed = (gate * normed).unflatten(-1, (hc, hidden)).mean(dim=-2)
    mixed, inj = hc_mix_normed.eager(normed, w_di, w_up, hc, rank, inject)
    same = torch.equal if dtype == torch.bfloat16 else (
        lambda a, b: torch.allclose(a, b, rtol=2e-7, atol=0) and a.dtype == b.dtype)
    assert same(mixed, want_mixed)
    if inject:
        assert same(inj, 2 * torch.sigmoid(down[:, rank: rank + hc] / hc))
    else:
        assert inj is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inject", [True, False])
def test_mix_from_down_partials_equals_the_mix_from_the_down_gemm(dtype, inject):
    """The decode-size GPU mix takes the down projection as fp32 partial products over 16 K slices
    (`ops.linear.partial_products`) and sums them in its activation kernel; the result is the mix of the plain GEMM
    (fp32: to summation order; bf16: the projection rounded once either way, so at most one ulp of it apart)."""
    from qwen4exp.ops.hyper_connection import hc_mix_normed, hc_mix_partials
    from qwen4exp.ops.linear import partial_products

    hc, hidden, rank, tokens, splits = 4, 64, 24, 6, 16
    g = torch.Generator().manual_seed(5)
    normed = torch.randn(tokens, hc * hidden, generator=g).to(dtype)
    w_di = (torch.randn(rank + hc + 4, hc * hidden, generator=g) / (hc * hidden) ** 0.5 * 8).to(dtype)
    w_up = (torch.randn(hc * hidden, rank, generator=g) / rank**0.5).to(dtype)

    partials = partial_products(normed, w_di, splits)
    assert partials.shape == (tokens, splits, w_di.shape[0]) and partials.dtype == torch.float32
    torch.testing.assert_close(partials.sum(1), normed.double() @ w_di.double().t(), rtol=1e-5, atol=1e-5,
                               check_dtype=False)
    got = hc_mix_partials.eager(normed, partials, w_up, hc, rank, inject)
    want = hc_mix_normed.eager(normed, w_di, w_up, hc, rank, inject)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -9)
    torch.testing.assert_close(got[0], want[0], **tol)
    if inject:
        torch.testing.assert_close(got[1], want[1], **tol)
    else:
        assert got[1] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_prenorm_sums_partial_products_of_the_block_output(dtype, parts):
    """A block output given as fp32 partial products [T, P, H] (`ops.linear.output_linear` at decode sizes) is
    summed and rounded to the model dtype before the combine: the pass equals the pass given that rounded sum."""
    from qwen4exp.ops.linear import partial_products

    hc, hidden, tokens, k = 4, 48, 5, 6 * parts
    g = torch.Generator().manual_seed(11 + parts)
    streams = (torch.randn(tokens, hc * hidden, generator=g) * 3).to(dtype)
    norm_w = (torch.randn(hc * hidden, generator=g) * 0.1).to(dtype)
    inject = (torch.rand(tokens, hc, generator=g) * 2).to(dtype)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    weight = (torch.randn(hidden, k, generator=g) * 4).to(dtype)
    partials = partial_products(x, weight, parts)
    assert partials.shape == (tokens, parts, hidden) and partials.dtype == torch.float32

    summed = partials[:, 0]
    for p in range(1, parts):
        summed = summed + partials[:, p]
    if dtype == torch.bfloat16 and not torch.cuda.is_available():  # the interpreter truncates to bf16
        summed = (summed.view(torch.int32) & -65536).view(torch.float32)
    new, normed = hc_prenorm(streams, norm_w, 1e-6, hc, partials, inject)
    want_new, want_normed = hc_prenorm(streams, norm_w, 1e-6, hc, summed.to(dtype), inject)
    assert torch.equal(new, want_new) and torch.equal(normed, want_normed)


@pytest.mark.parametrize("tokens", [1, 3])
def test_mix_takes_the_block_output_as_partial_products(tokens):
    """Every `hc_mix` path (the CPU reference here) accepts the block output as partial products: the result is the
    mix after combining their sum."""
    from qwen4exp.ops.hyper_connection import hc_mix
    from qwen4exp.ops.linear import partial_products

    hc, hidden, rank, k = 4, 32, 8, 24
    g = torch.Generator().manual_seed(tokens)
    streams = torch.randn(tokens, hc * hidden, generator=g)
    norm_w = torch.randn(hc * hidden, generator=g) * 0.1
    w_di = torch.randn(rank + hc, hc * hidden, generator=g) / (hc * hidden) ** 0.5
    w_up = torch.randn(hc * hidden, rank, generator=g) / rank**0.5
    inject = torch.rand(tokens, hc, generator=g) * 2
    x, weight = torch.randn(tokens, k, generator=g), torch.randn(hidden, k, generator=g)
    got = hc_mix(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True, partial_products(x, weight, 2), inject)
    want = hc_mix(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True, x @ weight.t(), inject)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
