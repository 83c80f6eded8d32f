"""Where the varlen GDN conv's time goes, against the time of its bytes.

    python bench/conv_parts.py [--out OUT_DIR] [--tokens 16384]

Times, in CUDA graphs of 8 calls, on the model's layout (the first 10240 columns of a [T, 16480] in_proj output,
planar q/k/v output, 1k-token requests without initial state):
  copy_torch      out.copy_(x) of the same strided slice (the bandwidth reference)
  copy_tile       a Triton kernel with the conv's grid and tiles that only copies its tile (one load, one store)
  taps            the four shifted tap loads and the weighted sum, without the per-token request / state loads
  varlen          `triton_conv.causal_conv1d_varlen` as the model calls it (default tiles, then a small sweep): the
                  taps over the whole batch, then a small kernel rewriting each request's first rows from its state
The differences between the rows say which part costs: the tile structure itself, the repeated tap loads, or the
requests' heads and states. Diagnostic only: the copy and taps kernels here are not used by the engine.
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decode_kernels import per_call_us  # noqa: E402
from qwen4exp.ops.triton_conv import causal_conv1d_varlen  # noqa: E402


@triton.jit
def _copy_tile_kernel(x_ptr, out_ptr, T, C, stride_xt, stride_ot, BT: tl.constexpr, BC: tl.constexpr):
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    ok = (offs_t < T)[:, None] & (offs_c < C)[None, :]
    x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_c[None, :], mask=ok)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_c[None, :], x, mask=ok)


@triton.jit
def _taps_kernel(x_ptr, w_ptr, out_ptr, T, C, stride_xt, stride_wc, stride_ot,
                 K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(0) * BC + tl.arange(0, BC)
    c_ok = offs_c < C
    ok = (offs_t < T)[:, None] & c_ok[None, :]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        back = K - 1 - j
        xv = tl.load(x_ptr + tl.maximum(offs_t - back, 0)[:, None] * stride_xt + offs_c[None, :],
                     mask=ok & (offs_t >= back)[:, None], other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + offs_c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_c[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    a = ap.parse_args()
    T, C, K, L, dev, dt = a.tokens, 10240, 4, 1024, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, 16480, device=dev, generator=g).to(dt)[:, :C]
    w = (torch.randn(C, 1, K, device=dev, generator=g) * 0.5).to(dt)[:, 0, :]  # the model's [C, 1, K] weight view
    n = T // L
    qsl = torch.arange(0, T + 1, L, device=dev)
    slots, has_init = torch.arange(1, n + 1, device=dev), torch.zeros(n, dtype=torch.bool, device=dev)
    state = torch.zeros(n + 1, C, K - 1, device=dev, dtype=dt)
    out = torch.empty(T, C, device=dev, dtype=dt)
    nbytes = 2 * T * C * 2
    rows = {"tokens": T, "bandwidth_us_at_4TBs": nbytes / 4e6}
    rows["copy_torch"] = per_call_us(lambda: out.copy_(x), calls=8)
    for bt, bc, nw in ((32, 128, 4), (64, 256, 8), (16, 256, 4)):
        grid = (triton.cdiv(C, bc), triton.cdiv(T, bt))
        rows[f"copy_tile_t{bt}_c{bc}_w{nw}"] = per_call_us(lambda: _copy_tile_kernel[grid](
            x, out, T, C, x.stride(0), out.stride(0), BT=bt, BC=bc, num_warps=nw), calls=8)
        rows[f"taps_t{bt}_c{bc}_w{nw}"] = per_call_us(lambda: _taps_kernel[grid](
            x, w, out, T, C, x.stride(0), w.stride(0), out.stride(0), K=K, BT=bt, BC=bc, num_warps=nw), calls=8)
        rows[f"varlen_t{bt}_c{bc}_w{nw}"] = per_call_us(lambda: causal_conv1d_varlen(
            x, w, state, qsl, slots, has_init, block_t=bt, block_c=bc, num_warps=nw,
            split=(2048, 2048, 6144)), calls=8)
        print({k: round(v, 1) for k, v in rows.items()}, flush=True)
    # the taps kernel's output equals the varlen kernel's (no initial state, so only the request starts differ:
    # compare the rows past every request's first K-1 tokens)
    _taps_kernel[(triton.cdiv(C, 128), triton.cdiv(T, 32))](x, w, out, T, C, x.stride(0), w.stride(0), out.stride(0),
                                                            K=K, BT=32, BC=128, num_warps=4)
    ref = causal_conv1d_varlen(x, w, state.clone(), qsl, slots, has_init)
    inner = torch.arange(T, device=dev) % L >= K - 1
    rows["taps_max_abs_diff"] = (out[inner].float() - ref[inner].float()).abs().max().item()
    print(rows, flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        json.dump(rows, open(os.path.join(a.out, "conv_parts.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
