"""Hyper-connection mix kernels (decode: split-K GEMVs; batched: tensor-core GEMMs) against the torch reference,
interpreted on CPU."""

import pytest
import torch

pytest.importorskip("triton")

from conftest import on_device

from qwen4exp import ops
from qwen4exp.ops import hyper_connection, triton_hc
from qwen4exp.ops.hyper_connection import hc_mix, hc_mix_ref
from qwen4exp.ops.triton_hc import hc_mix_batched, hc_mix_decode, supported

hc_mix_decode = on_device(hc_mix_decode)
hc_mix_batched = on_device(hc_mix_batched)


def _inputs(dtype, tokens, hidden, rank, inject, hc=4, pad=8):
    g = torch.Generator().manual_seed(tokens + hidden)
    streams = (torch.randn(tokens, hc * hidden, generator=g) * 3).to(dtype)
    norm_w = (torch.randn(hc * hidden, generator=g) * 0.1).to(dtype)
    rows = rank + (hc if inject else 0)
    # down rows, inject rows, then padding (the model pads with zeros; here large values, which must be ignored)
    w_di = torch.full((rows + pad, hc * hidden), 5.0, dtype=dtype)
    w_di[:rows] = (torch.randn(rows, hc * hidden, generator=g) / (hc * hidden) ** 0.5).to(dtype)
    w_up = (torch.randn(hc * hidden, rank, generator=g) / rank**0.5).to(dtype)
    return streams, norm_w, w_di, w_up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,rank,inject,tiles", [
    (1, 64, 16, True, {}), (3, 80, 24, True, {}), (4, 64, 16, False, {}), (2, 128, 40, True, {}),
    # several K chunks per stream and row blocks ending inside the inject rows; partial column blocks
    (2, 192, 40, True, dict(block_rows=8, chunk=64, block_h=32)), (1, 128, 20, False, dict(chunk=32, block_h=8)),
])
def test_matches_reference(dtype, tokens, hidden, rank, inject, tiles):
    hc = 4
    g = torch.Generator().manual_seed(tokens + hidden)
    streams = (torch.randn(tokens, hc * hidden, generator=g) * 3).to(dtype)
    norm_w = (torch.randn(hc * hidden, generator=g) * 0.1).to(dtype)
    rows = rank + (hc if inject else 0)
    # as the model stores it: down rows, inject rows, then zero padding up to a multiple of 8
    w_di = torch.zeros(rows + (-rows) % 8, hc * hidden, dtype=dtype)
    w_di[:rows] = (torch.randn(rows, hc * hidden, generator=g) / (hc * hidden) ** 0.5).to(dtype)
    w_up = (torch.randn(hc * hidden, rank, generator=g) / rank**0.5).to(dtype)

    mixed, inj = hc_mix_decode(streams, norm_w, w_di, w_up, 1e-6, hc, rank, inject, **tiles)
    ref_mixed, ref_inj = hc_mix_ref.eager(streams, norm_w, w_di, w_up, 1e-6, hc, rank, inject)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert mixed.dtype == dtype and mixed.shape == (tokens, hidden)
    torch.testing.assert_close(mixed, ref_mixed, **tol)
    if inject:
        torch.testing.assert_close(inj, ref_inj, **tol)
    else:
        assert inj is None


def test_supported_widths():
    assert supported(torch.zeros(1, 4 * 64), 4) and supported(torch.zeros(64, 4 * 48), 4)
    assert not supported(torch.zeros(1, 4 * 60), 4)  # blocks of 60 / 2^k < 16 would straddle streams
    assert not supported(torch.zeros(0, 4 * 64), 4)


def test_dispatch_by_token_count(monkeypatch):
    """On the GPU one token takes the decode kernels and two or more the batched ones (the compiled reference is
    slower at both); the CPU path and unsupported widths keep the reference."""
    calls = []
    monkeypatch.setattr(triton_hc, "hc_mix_decode", lambda *a, **k: calls.append("decode"))
    monkeypatch.setattr(triton_hc, "hc_mix_batched", lambda *a, **k: calls.append("batched"))
    monkeypatch.setattr(hyper_connection, "hc_mix_ref", lambda *a, **k: calls.append("reference"))

    def run(tokens, hidden=64):
        calls.clear()
        streams, norm_w, w_di, w_up = _inputs(torch.float32, tokens, hidden, 16, True)
        hc_mix(streams, norm_w, w_di, w_up, 1e-6, 4, 16, True)
        return calls[0]

    assert [run(t) for t in (1, 2, 64)] == ["reference"] * 3  # CPU tensors
    monkeypatch.setattr(ops, "fast_path", lambda x: True)  # as for CUDA tensors
    assert [run(t) for t in (1, 2, 5, 64, 130)] == ["decode"] + ["batched"] * 4
    assert run(2, hidden=60) == "reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,rank,inject,tiles", [
    (2, 64, 20, True, {}), (5, 48, 24, False, {}), (64, 64, 20, True, {}), (130, 48, 24, True, {}),
    # whole-stream chunks (rstd fused into the down GEMM), with and without a split of K; narrow row blocks that end
    # inside the inject rows; partial token and hidden blocks
    (37, 64, 20, True, dict(chunk=256)), (37, 64, 20, True, dict(chunk=128, block_n=16, block_h=32)),
    (19, 64, 24, False, dict(chunk=64, block_m=16)), (70, 48, 20, True, dict(chunk=16, block_n=16, block_m=32)),
])
def test_batched_matches_reference(dtype, tokens, hidden, rank, inject, tiles):
    streams, norm_w, w_di, w_up = _inputs(dtype, tokens, hidden, rank, inject)
    mixed, inj = hc_mix_batched(streams, norm_w, w_di, w_up, 1e-6, 4, rank, inject, **tiles)
    ref_mixed, ref_inj = hc_mix_ref.eager(streams, norm_w, w_di, w_up, 1e-6, 4, rank, inject)
    # bf16: one rounding step of the output (values up to ~4) and the rounded intermediates it depends on
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert mixed.dtype == dtype and mixed.shape == (tokens, hidden)
    torch.testing.assert_close(mixed, ref_mixed, **tol)
    if inject:
        assert inj.shape == (tokens, 4)
        torch.testing.assert_close(inj, ref_inj, **tol)
    else:
        assert inj is None


def test_batched_variants_are_few():
    """Serving compiles one kernel variant per entry (the warm-up runs a step of each size)."""
    sizes = hyper_connection.warm_up_token_counts(2560, 4, 320, 8192)
    assert sizes[0] == 2 and len(sizes) <= 12


@pytest.mark.parametrize("batched", [False, True])
def test_repeated_calls_rearm_the_arrival_counters(batched):
    """The last program of each output tile resets its counter: a second call (as a graph replay would make) with
    new inputs gives the new inputs' result, and the counters are left at zero."""
    from qwen4exp.ops.triton_hc import _counters

    hc, hidden, rank = 4, 64, 16
    g = torch.Generator().manual_seed(7)
    norm_w = torch.randn(hc * hidden, generator=g) * 0.1
    w_di = torch.randn(rank + hc, hc * hidden, generator=g) / (hc * hidden) ** 0.5
    w_up = torch.randn(hc * hidden, rank, generator=g) / rank**0.5
    for _ in range(3):
        streams = torch.randn(2, hc * hidden, generator=g)
        if batched:
            mixed, inj = hc_mix_batched(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True, block_n=16, chunk=32)
        else:
            mixed, inj = hc_mix_decode(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True, block_rows=8, chunk=32)
        ref_mixed, ref_inj = hc_mix_ref.eager(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True)
        torch.testing.assert_close(mixed, ref_mixed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inj, ref_inj, rtol=1e-5, atol=1e-5)
    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())
