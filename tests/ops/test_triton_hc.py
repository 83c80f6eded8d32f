"""Decode hyper-connection mix (two split-K Triton launches) against the torch reference, interpreted on CPU."""

import pytest
import torch

pytest.importorskip("triton")

from conftest import on_device

from qwen4exp.ops.hyper_connection import hc_mix_ref
from qwen4exp.ops.triton_hc import hc_mix_decode, supported

hc_mix_decode = on_device(hc_mix_decode)


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


def test_dispatch_takes_single_tokens_only():
    # two tokens and up measured slower than the compiled reference on an H200 (bench/decode_kernels.py)
    assert supported(torch.zeros(1, 4 * 64), 4)
    assert not supported(torch.zeros(2, 4 * 64), 4)
    assert not supported(torch.zeros(1, 4 * 60), 4)  # blocks of 60 / 2^k < 16 would straddle streams


def test_repeated_calls_rearm_the_arrival_counters():
    """The last program of each row block resets its counter: a second call (as a graph replay would make) with new
    inputs gives the new inputs' result, and the counters are left at zero."""
    from qwen4exp.ops.triton_hc import _counters

    hc, hidden, rank = 4, 64, 16
    g = torch.Generator().manual_seed(7)
    norm_w = torch.randn(hc * hidden, generator=g) * 0.1
    w_di = torch.randn(rank + hc, hc * hidden, generator=g) / (hc * hidden) ** 0.5
    w_up = torch.randn(hc * hidden, rank, generator=g) / rank**0.5
    for _ in range(3):
        streams = torch.randn(2, hc * hidden, generator=g)
        mixed, inj = hc_mix_decode(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True, block_rows=8, chunk=32)
        ref_mixed, ref_inj = hc_mix_ref.eager(streams, norm_w, w_di, w_up, 1e-6, hc, rank, True)
        torch.testing.assert_close(mixed, ref_mixed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inj, ref_inj, rtol=1e-5, atol=1e-5)
    assert all(int(c.count_nonzero()) == 0 for c in _counters.values())
