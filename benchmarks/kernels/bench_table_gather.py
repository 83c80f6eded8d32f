"""The PLE n-gram table's row gather (qwen4exp/ops/table_gather.py) at the model's table size: each token's rows of
every n-gram head, dequantised and concatenated, against the torch reference.

Tables: bf16 and fp8 (e4m3, one scale) in GPU memory; with --host also fp8 in page-locked host memory (the
released model's table lives there: `--ple-table-device cpu`), which the kernel reads over PCIe in place.

    python benchmarks/kernels/bench_table_gather.py [--host] [--tokens 1,64,8192] [--json out.json]
"""

import torch

from qwen4exp.bench.kernels import Variant, run
from qwen4exp.ops import table_gather
from qwen4exp.weights.ngram_table import FP8, host_empty

CHUNK_ROWS = 1 << 22


def gpu_table(bench, dtype):
    """A random [rows, D] table of the model's size, with its scale; filled in chunks (a 10 GB fp32 temporary
    would not fit next to it)."""
    w = bench.widths
    table = torch.empty(w.ngram_rows, w.ngram_dim, dtype=dtype, device=bench.device)
    for start in range(0, w.ngram_rows, CHUNK_ROWS):
        rows = table[start:start + CHUNK_ROWS]
        rows.copy_(torch.randn(rows.shape, device=bench.device, generator=bench.generator).to(dtype))
    scale = torch.tensor(0.05 if dtype == FP8 else 1.0, device=bench.device)
    return table, scale


def host_copy(table: torch.Tensor) -> torch.Tensor:
    """`table` copied into page-locked host memory that kernels read in place (as the engine allocates it)."""
    host = host_empty(tuple(table.shape), table.dtype, pin=table.is_cuda)
    for start in range(0, table.shape[0], CHUNK_ROWS):
        host[start:start + CHUNK_ROWS].copy_(table[start:start + CHUNK_ROWS])
    return host


def main(bench):
    w = bench.widths
    fp8 = gpu_table(bench, FP8)
    tables = [("bf16 table in GPU memory", *gpu_table(bench, torch.bfloat16)), ("fp8 table in GPU memory", *fp8)]
    if bench.args.host:
        tables.append(("fp8 table in page-locked host memory", host_copy(fp8[0]), fp8[1]))
    for what, table, scale in tables:
        case = f"{what}, {w.ngram_rows:,} rows x {w.ngram_dim}, {w.ngram_heads} rows a token, {w.ple_layers} a step"
        for tokens in bench.tokens([1, 64, 8192]):
            ids = torch.randint(0, w.ngram_rows, (tokens, w.ngram_heads), device=bench.device,
                                generator=bench.generator)
            out = torch.empty(tokens, w.ngram_heads * w.ngram_dim, dtype=bench.dtype, device=bench.device)
            bench.measure(case, tokens, [
                # a host table's reference gathers on the CPU: not in a graph
                Variant("reference", lambda: table_gather.gather_rows_ref(table, ids, scale, bench.dtype),
                        graph=table.device == ids.device),
                Variant("dispatched", lambda: table_gather.gather_rows(table, ids, scale, bench.dtype, out)),
            ], calls=max(4, w.ple_layers) if tokens <= 512 else 4)


if __name__ == "__main__":
    run(main, __doc__, "table_gather", arguments=lambda p: p.add_argument(
        "--host", action="store_true", help="also an fp8 table in page-locked host memory"))
