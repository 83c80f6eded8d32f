"""Row gather with dequantisation: the Triton kernel (GPU, or the interpreter on CPU) against the torch reference,
for every table dtype; a page-locked host table is read in place on the GPU."""

import pytest
import torch

from qwen4exp.ops.table_gather import gather_rows_ref

triton = pytest.importorskip("triton")
from conftest import on_device  # noqa: E402

from qwen4exp.ops.table_gather_triton import gather_rows_triton  # noqa: E402


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_matches_reference(table_dtype, out_dtype):
    g = torch.Generator().manual_seed(1)
    table = (torch.randn(3001, 40, generator=g) * 5).to(table_dtype)
    ids = torch.randint(0, 3001, (37, 6), generator=g)
    ids[0, 0], ids[-1, -1] = 0, 3000  # first and last rows
    scale = torch.tensor(0.0371) if table_dtype == torch.float8_e4m3fn else torch.tensor(1.0)
    got = on_device(gather_rows_triton)(table, ids, scale, out_dtype)
    want = gather_rows_ref(table, ids, scale, out_dtype)
    assert got.shape == (37, 240) and got.dtype == out_dtype
    if out_dtype == torch.bfloat16 and not torch.cuda.is_available():
        # the interpreter truncates fp32 -> bf16 instead of rounding to nearest: one bf16 ulp at most
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


def test_empty_batch():
    table = torch.randn(10, 8)
    out = gather_rows_triton(table, torch.zeros(0, 3, dtype=torch.long), torch.tensor(1.0), torch.float32)
    assert out.shape == (0, 24)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_page_locked_host_table_is_read_in_place():
    from qwen4exp.weights.ngram_table import host_empty, on_host

    table = host_empty((100_000, 160), torch.float8_e4m3fn, pin=True)
    table.copy_((torch.randn(100_000, 160) * 50).clamp(-448, 448).to(torch.float8_e4m3fn))
    assert on_host(table) and table.is_pinned()
    ids = torch.randint(0, 100_000, (257, 16), device="cuda")
    scale = torch.tensor(0.02, device="cuda")
    got = gather_rows_triton(table, ids, scale, torch.bfloat16)
    assert got.is_cuda
    assert torch.equal(got.cpu(), gather_rows_ref(table, ids.cpu(), scale.cpu(), torch.bfloat16))
