"""Probe: Triton row gather from a registered (page-locked) host table vs a GPU table on one H200."""

import json
import os
import statistics
import sys
import time

import torch

from qwen4exp.ops.table_gather import gather_rows_ref, gather_rows_triton

out_dir = sys.argv[1]
res = {}
cudart = torch.cuda.cudart()

rows_total = int(float(os.environ.get("PROBE_ROWS", "320001536")))
D = 160
t0 = time.perf_counter()
host = torch.empty(rows_total, D, dtype=torch.uint8)
res["alloc_s"] = time.perf_counter() - t0
# fill on GPU in chunks and copy into the host table
t0 = time.perf_counter()
chunk = 1 << 24
g = torch.Generator(device="cuda").manual_seed(0)
for s in range(0, rows_total, chunk):
    e = min(rows_total, s + chunk)
    x = torch.randn(e - s, D, device="cuda", generator=g).clamp_(-8, 8).mul_(40).to(torch.float8_e4m3fn)
    host[s:e].copy_(x.view(torch.uint8))
res["fill_unpinned_s"] = time.perf_counter() - t0
t0 = time.perf_counter()
err = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
res["register_s"] = time.perf_counter() - t0
res["register_err"] = int(err) if not isinstance(err, tuple) else [int(x) for x in err]
table_h = host.view(torch.float8_e4m3fn)
scale = torch.tensor(0.01, device="cuda")

ids = torch.randint(0, rows_total, (64, 16), device="cuda")
try:
    got = gather_rows_triton(table_h, ids, scale, torch.bfloat16)
    ref = gather_rows_ref(table_h, ids.cpu(), scale.cpu(), torch.bfloat16)
    res["host_triton_equal"] = bool(torch.equal(got.cpu(), ref))
except Exception as e:  # noqa: BLE001
    res["host_triton_error"] = repr(e)

try:
    class _I:
        pass
    iface = _I()
    iface.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "|u1", "data": (host.data_ptr(), False),
                                      "version": 3, "strides": None}
    alias = torch.as_tensor(iface, device="cuda")
    res["alias_device"] = str(alias.device)
    res["alias_index_equal"] = bool(torch.equal(alias[ids[:4, 0]].cpu(), host[ids[:4, 0].cpu()]))
except Exception as e:  # noqa: BLE001
    res["alias_error"] = repr(e)

# timing: host vs device table (a 4 GB device slice, random rows over the whole host table)
dev_rows = min(rows_total, 25_000_000)
table_d = host[:dev_rows].cuda().view(torch.float8_e4m3fn)


def bench(fn, n=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


timing = {}
for T in (1, 64, 1024, 8192):
    idh = torch.randint(0, rows_total, (T, 16), device="cuda")
    idd = torch.randint(0, dev_rows, (T, 16), device="cuda")
    out = torch.empty(T, 16 * D, dtype=torch.bfloat16, device="cuda")
    timing[T] = {
        "host_us": bench(lambda: gather_rows_triton(table_h, idh, scale, torch.bfloat16, out)),
        "gpu_us": bench(lambda: gather_rows_triton(table_d, idd, scale, torch.bfloat16, out)),
    }
res["gather_us"] = timing

# CUDA graph with a side-stream gather joined back
side = torch.cuda.Stream()
idg = torch.randint(0, rows_total, (4, 16), device="cuda")
buf = torch.empty(4, 16 * D, dtype=torch.bfloat16, device="cuda")


def step():
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gather_rows_triton(table_h, idg, scale, torch.bfloat16, buf)
    torch.cuda.current_stream().wait_stream(side)
    return buf * 2


step()
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = step()
idg.copy_(torch.randint(0, rows_total, (4, 16), device="cuda"))
graph.replay()
torch.cuda.synchronize()
res["graph_equal"] = bool(torch.equal(y.cpu(), gather_rows_ref(table_h, idg.cpu(), scale.cpu(), torch.bfloat16) * 2))
t0 = time.perf_counter()
cudart.cudaHostUnregister(host.data_ptr())
res["unregister_s"] = time.perf_counter() - t0
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, "probe.json"), "w") as f:
    json.dump(res, f, indent=1)
print(json.dumps(res, indent=1))
