"""Decode-size fast kernels at flash-next widths (bf16, H200): per-call time inside a CUDA graph, with tile sweeps.

    python bench/decode_kernels.py [--out OUT_DIR] [--parts hc,moe,align,route,gemv,gdn,conv,hc_batch,...]

  hc mix:   `ops.triton_hc.hc_mix_decode` against the inductor-compiled reference (4 streams x 2560, low rank 320),
            T = 1, 2, 4; tiles swept at T = 1.
  pair MoE: `ops.triton_moe.pairwise_moe` (128 experts, top-10, 640 intermediate, shared expert in the down launch)
            at T = 1, 4 and 8; tiles swept at T = 1.
  align:    moe_align (torch ops, radix sort) vs moe_align_triton (a program per expert), 64 tokens x top-10 of 128.
  route:    the fused softmax + top-10 of 128 kernel with 1 and 4 warps per token, T = 1 and 64.
  gemv:     `ops.triton_linear.gemv` against F.linear (cuBLAS) at the decode projections (out_proj/o_proj, the MoE
            router + shared expert, GDN in_proj, attention q/k/v + indexer; lm_head for reference), T = 1, 2, 4; tiles
            swept at T = 1. Each call reads its own copy of the weight (>= 256 MB of copies per shape), as each layer
            does, so no call finds its weight in L2.
  gdn:      GDN decode core (16 key heads x 128, 48 value heads x 128, fp32 state), batch 1 and 64: gdn_gates
            (inductor) + the recurrent kernel against the kernel computing the gates from the raw b, a projections;
            the fused kernel's value-tile widths (128 = one program per head, what folding the output norm into
            it would take) and the gated RMS norm after it, as the model called it before and as it calls it now.
  conv:     the GDN causal conv (10240 channels): the decode update kernel at batch 1 and 64 over channel tiles and
            warps, and the varlen prefill kernel at 8 x 1024 tokens over token / channel tiles, against torch.
  hc_batch: the hyper-connection combine + mix at 64 and 8192 tokens (batch-64 decode, 8 x 1k prefill), compiled
            separately against the combine deferred into the mix's Triton norm pass.
  gemm_layouts (not in the default parts): the dense projections at 64 tokens (batch-64 decode) and 8192 (prefill)
            through cuBLAS with the weight as stored ([out, in], F.linear's "TN" GEMM) against a transposed copy
            ([in, out], torch.mm's "NN"), the transposed product W @ x^T ("out_T", a [n, T] result read through its
            transpose), and the hyper-connection down projection with its rows padded from 328 to 384 (gemm_layouts64:
            at 64 tokens only); per decode step, the microseconds a layout would save (calls per step x difference).
  moe_tiles (not in the default parts): `fused_moe` (the sorted-pairs path of 65-409 tokens, batch-64 decode) over
            gate/up tiles, then down tiles with the best gate/up tile, at 64 tokens; the best against the defaults
            at 16-256 tokens. One weight set of 1.26 GB: no call finds it in L2. moe_tiles128: the same sweep at
            128 tokens (the upper half of the first tier), checked at 72, 128 and 200.
  moe_spread (not in the default parts): the grouped experts' input in expert order at 8k and 16k tokens: torch's
            gather and index_select against `triton_moe.spread_rows` at 256-4096 columns a program.
  sum_pairs_decode (not in the default parts): the decode experts' pair sum at 1-64 tokens by columns a program.
  blas_backends (not in the default parts): F.linear at the model's projections (and lm_head) at 1, 64 and 8192
            tokens through cuBLAS and cuBLASLt (torch.backends.cuda.preferred_blas_library), alternating.
  norms (not in the default parts): the GDN output norm, the PLE's grouped norm and the grouped experts' silu_mul
            (10 pairs a token), compiled against the Triton passes (ops/triton_norm.py, triton_hc.hc_prenorm,
            triton_moe.silu_mul_halves) at 64-8192 tokens.
  route_big (not in the default parts): the one-warp-per-token router kernel against the compiled softmax + topk
            at 64-16384 tokens.
  norm_rope (not in the default parts): the attention's per-head norm + rotation, compiled (two kernels) against
            the Triton pass, for the query, key and indexer query at 1-16384 tokens; the output gate on a reshaped
            (copied) gate against its view.
  grouped_sort (not in the default parts): the grouped MoE path's expert order, torch ops against the Triton
            counting sort, 512-16384 tokens x top-10 of 128.
  autotune_linear (not in the default parts): the decode projections at 64 tokens through F.linear (cuBLAS)
            and through inductor's max-autotune of the same GEMM, alternating; us per step saved.
  hc_autotune (not in the default parts): the hyper-connection mix after its norm compiled as the model compiles it
            against inductor's max-autotune (Triton GEMM templates with fused epilogues where they win), static
            shapes, at 64 tokens.
  read_bw (not in the default parts): the read ceiling: a streaming Triton read over 4 GB (contiguous ranges per
            program and interleaved blocks, 1-8 waves of programs), torch's sum and the copy, against `fused_moe`
            at 64 tokens (all 1.26 GB of expert weights read), GB/s.
  pdl (not in the default parts): a chain of 192 small Triton kernels in a CUDA graph, plain against programmatic
            dependent launch (gdc_wait first; and with an independent load before the wait): us per kernel.
  gdn_warps (not in the default parts): the fused GDN decode kernel at batch 64 over value-tile widths and warps
            (`triton_gdn._num_warps` overridden), alternating with the defaults.
  prefill_attn (not in the default parts): dense causal attention of prefill steps (24 q heads, 2 kv heads,
            head_dim 256, page 16): `sparse_paged_attention` (the current path) against the flash-style
            `prefill_paged_attention` at its defaults and a tile sweep, 8 x 1024 and 1 x 8192 new tokens and
            4 x 1024 after 3072 cached; run it before setting ops.attention.PREFILL_KERNEL_MIN_TOKENS.
  partials (not in the default parts): the split-K projections at 64 tokens (F.linear: cuBLAS's GEMM and reduce)
            against cuBLAS batched GEMMs of S K-slices with fp32 partial outputs, alone and with a compiled sum.
  hc_partials (not in the default parts): the hyper-connection mix after its norm at 2-256 tokens, with the down
            projection as cuBLAS's GEMM (`hc_mix_normed`) against S fp32 partial products summed in the activation
            kernel (`ops.linear.partial_products` + `hc_mix_partials`).
  output_partials (not in the default parts): out_proj / o_proj then the next mix's combine + norm pass at 2-128
            tokens: cuBLAS's GEMM against 2, 4 or 8 fp32 partial products summed in the combine.
  lm_head (not in the default parts): the logits GEMM [248320, 2560] at 1 and 64 tokens with bf16 output (before
            ad7f1ac) against `fp32_out_linear` (cuBLAS writing its fp32 accumulator), plus the greedy argmax of each.

Each variant is captured in a CUDA graph of `calls` calls (a decode step's worth), replayed 30 times; prints the
median microseconds per call, the weight bytes per call over that time, and the max difference from the reference.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qwen4exp.ops.hyper_connection import hc_mix_ref  # noqa: E402
from qwen4exp.ops.moe import moe_block_ref, silu_mul  # noqa: E402
from qwen4exp.ops.triton_hc import hc_mix_decode  # noqa: E402
from qwen4exp.ops import triton_linear  # noqa: E402
from qwen4exp.ops.triton_moe import pairwise_moe  # noqa: E402


def per_call_us(fn, calls, reps=30):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def weight_copies(n, k, calls, g, dt, dev):
    """Copies of a random [n, k] weight, at least 256 MB of them (and at least min(calls, 4)), so that calls cycling
    through them never find theirs in L2, as each layer reads its own weight."""
    nbytes = n * k * 2
    copies = min(max(calls, 4), -(-(256 << 20) // nbytes))
    return [(torch.randn(n, k, device=dev, generator=g) / k**0.5).to(dt) for _ in range(copies)]


def bench_hc(results):
    hc, hidden, rank, dev, dt = 4, 2560, 320, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    norm_w = torch.randn(hc * hidden, device=dev, generator=g).to(dt) * 0.1
    w_di = torch.zeros(rank + hc + 4, hc * hidden, device=dev, dtype=dt)  # padded to a multiple of 8, as the model
    w_di[: rank + hc] = (torch.randn(rank + hc, hc * hidden, device=dev, generator=g) / (hc * hidden) ** 0.5).to(dt)
    w_up = (torch.randn(hc * hidden, rank, device=dev, generator=g) / rank**0.5).to(dt)
    weight_bytes = (rank + hc) * hc * hidden * 2 + w_up.numel() * 2

    def run(tokens, **tiles):
        streams = torch.randn(tokens, hc * hidden, device=dev, generator=g).to(dt)
        args = (streams, norm_w, w_di, w_up, 1e-6, hc, rank, True)
        us = per_call_us(lambda: hc_mix_decode(*args, **tiles), calls=96)
        # after the graph replays: the arrival counters must have been re-armed by every call
        ref, got = hc_mix_ref(*args), hc_mix_decode(*args, **tiles)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ref, got))
        return us, diff, args

    sweep = []
    for block_rows, chunk in ((8, 256), (8, 512), (16, 256), (16, 512), (32, 256)):
        us, diff, _ = run(1, block_rows=block_rows, chunk=chunk)
        sweep.append(dict(block_rows=block_rows, chunk=chunk, block_h=4, us=us, max_abs_diff=diff))
        print(f"hc T=1 block_rows={block_rows:2d} chunk={chunk:4d} block_h=4: {us:6.2f} us, diff {diff:.3g}",
              flush=True)
    best = min(sweep, key=lambda r: r["us"])
    for block_h in (2, 8, 16):
        us, diff, _ = run(1, block_rows=best["block_rows"], chunk=best["chunk"], block_h=block_h)
        sweep.append(dict(block_rows=best["block_rows"], chunk=best["chunk"], block_h=block_h, us=us,
                          max_abs_diff=diff))
        print(f"hc T=1 block_rows={best['block_rows']:2d} chunk={best['chunk']:4d} block_h={block_h}: {us:6.2f} us, "
              f"diff {diff:.3g}", flush=True)
    best = min(sweep, key=lambda r: r["us"])
    tiles = {k: best[k] for k in ("block_rows", "chunk", "block_h")}
    rows = []
    for tokens in (1, 2, 4):
        default_us, diff, args = run(tokens)
        best_us, best_diff, _ = run(tokens, **tiles)
        ref = per_call_us(lambda: hc_mix_ref(*args), calls=96)
        rows.append(dict(tokens=tokens, reference_us=ref, triton_default_us=default_us, triton_best_us=best_us,
                         max_abs_diff=max(diff, best_diff)))
        print(f"hc T={tokens}: compiled reference {ref:6.2f} us, triton (defaults) {default_us:6.2f} us "
              f"({weight_bytes / default_us / 1e3:.0f} GB/s), best tiles {best_us:6.2f} us, reference / default "
              f"{ref / default_us:.2f}, max |diff| {max(diff, best_diff):.3g}", flush=True)
    results["hc"] = dict(sweep=sweep, best_tiles=tiles, by_tokens=rows)


def bench_moe(results):
    E, k, hidden, inter, dev, dt = 128, 10, 2560, 640, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * inter, hidden, device=dev, generator=g) / hidden**0.5).to(dt)
    down = (torch.randn(E, hidden, inter, device=dev, generator=g) / inter**0.5).to(dt)
    shared_down = (torch.randn(hidden, inter, device=dev, generator=g) / inter**0.5).to(dt)
    weight_bytes = k * (gate_up[0].numel() + down[0].numel()) * 2 + shared_down.numel() * 2

    def run(tokens, **tiles):
        x = torch.randn(tokens, hidden, device=dev, generator=g).to(dt)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(tokens)])
        wts = torch.softmax(torch.randn(tokens, k, device=dev, generator=g), -1)
        sg, su = torch.randn(2, tokens, inter, device=dev, generator=g).to(dt)
        logit = torch.randn(tokens, 1, device=dev, generator=g).to(dt)
        shared_expert = (sg, su, shared_down, logit)
        us = per_call_us(lambda: pairwise_moe(x, gate_up, down, ids, wts, shared_expert=shared_expert, **tiles),
                         calls=48)
        shared_out = torch.nn.functional.linear(silu_mul(sg, su), shared_down)
        ref = moe_block_ref(x, gate_up, down, ids, wts, shared=(shared_out, logit))
        got = pairwise_moe(x, gate_up, down, ids, wts, shared_expert=shared_expert, **tiles)
        return us, (ref.float() - got.float()).abs().max().item()

    sweep = []
    for block_n, block_k, warps in ((16, 256, 4), (8, 256, 4), (32, 128, 4), (16, 128, 4), (16, 512, 8),
                                    (8, 512, 4), (32, 256, 8)):
        us, _ = run(1, block_n=block_n, block_k=block_k, num_warps=warps)
        sweep.append(dict(block_n=block_n, block_k=block_k, num_warps=warps, down_block_n=32, down_block_k=256, us=us))
        print(f"moe T=1 gate_up {block_n}x{block_k} w{warps}: {us:6.2f} us", flush=True)
    best = min(sweep, key=lambda r: r["us"])
    for dbn, dbk in ((16, 256), (64, 128), (32, 128), (16, 128), (64, 64)):
        t = dict(block_n=best["block_n"], block_k=best["block_k"], num_warps=best["num_warps"], down_block_n=dbn,
                 down_block_k=dbk)
        us, _ = run(1, **t)
        sweep.append(dict(t, us=us))
        print(f"moe T=1 down {dbn}x{dbk}: {us:6.2f} us", flush=True)
    best = min(sweep, key=lambda r: r["us"])
    tiles = {key: best[key] for key in ("block_n", "block_k", "num_warps", "down_block_n", "down_block_k")}
    rows = []
    for tokens in (1, 4, 8):
        default_us, diff = run(tokens)
        best_us, best_diff = run(tokens, **tiles)
        rows.append(dict(tokens=tokens, default_us=default_us, best_us=best_us, max_abs_diff=max(diff, best_diff)))
        print(f"moe T={tokens}: defaults {default_us:6.2f} us ({weight_bytes / default_us / 1e3:.0f} GB/s at T=1 "
              f"bytes), best tiles {best_us:6.2f} us, max |diff| {max(diff, best_diff):.3g}", flush=True)
    results["moe"] = dict(sweep=sweep, best_tiles=tiles, by_tokens=rows)


def bench_align(results):
    from qwen4exp.ops.triton_moe import moe_align, moe_align_triton

    ids = torch.stack([torch.randperm(128, device="cuda")[:10] for _ in range(64)])
    ref = moe_align(ids, 128, 16)
    got = moe_align_triton(ids, 128, 16)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)), "align: outputs differ"
    row = dict(torch_us=per_call_us(lambda: moe_align(ids, 128, 16), calls=48),
               triton_us=per_call_us(lambda: moe_align_triton(ids, 128, 16), calls=48))
    print(f"align 640 pairs: torch {row['torch_us']:.2f} us, triton {row['triton_us']:.2f} us", flush=True)
    results["align"] = row


def bench_route(results):
    from qwen4exp.ops.moe import route_ref
    from qwen4exp.ops.triton_moe import route_triton

    rows = []
    for tokens in (1, 64):
        # distinct values, exact in bf16: which of two equal probabilities top-k takes is unspecified
        logits = (torch.stack([torch.randperm(128, device="cuda") for _ in range(tokens)]) / 16 - 3).bfloat16()
        ref_w, ref_ids = route_ref(logits, 10, True)
        row = dict(tokens=tokens)
        for warps in (1, 4):
            _, ids = route_triton(logits, 10, True, num_warps=warps)
            assert torch.equal(ids, ref_ids), "route: ids differ from the reference"
            row[f"warps{warps}_us"] = per_call_us(lambda: route_triton(logits, 10, True, num_warps=warps), calls=48)
        rows.append(row)
        print(f"route T={tokens}: 1 warp {row['warps1_us']:.2f} us, 4 warps {row['warps4_us']:.2f} us", flush=True)
    results["route"] = rows


# (name, rows N (merged buffers padded to 8), K, calls per decode step) at flash-next-128e widths
GEMV_SHAPES = (("out_proj", 2560, 6144, 48), ("moe_router_shared", 1416, 2560, 48), ("gdn_in_proj", 16480, 2560, 36),
               ("attn_qkv_index", 13952, 2560, 12), ("lm_head", 248320, 2560, 1))
GEMV_TILES = ((1, 256, 1), (2, 256, 2), (4, 256, 4), (8, 256, 4), (16, 256, 4), (8, 256, 8), (16, 256, 8),
              (4, 512, 4), (2, 1024, 4), (8, 512, 8))


def bench_gemv(results):
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name, n, k, calls in GEMV_SHAPES:
        nbytes = n * k * 2
        weights = weight_copies(n, k, calls, g, dt, dev)
        copies = len(weights)
        timed_calls = max(calls, 4)

        def run(fn, x):
            state = {"i": 0}

            def call():
                fn(x, weights[state["i"] % copies])
                state["i"] += 1
            return per_call_us(call, calls=timed_calls)

        def check(tokens, **tiles):
            x = torch.randn(tokens, k, device=dev, generator=g).to(dt)
            exact = torch.nn.functional.linear(x.float(), weights[0].float())
            ref = torch.nn.functional.linear(x, weights[0])
            got = triton_linear.gemv(x, weights[0], **tiles)
            return x, dict(diff_vs_cublas=(got.float() - ref.float()).abs().max().item(),
                           err_triton=(got.float() - exact).abs().max().item(),
                           err_cublas=(ref.float() - exact).abs().max().item())

        sweep = []
        if name != "lm_head":
            for block_n, block_k, warps in GEMV_TILES:
                tiles = dict(block_n=block_n, block_k=block_k, num_warps=warps)
                x, diffs = check(1, **tiles)
                us = run(lambda x, w: triton_linear.gemv(x, w, **tiles), x)
                sweep.append(dict(tiles, us=us, gb_s=nbytes / us / 1e3, **diffs))
                print(f"gemv {name} T=1 {block_n:2d}x{block_k:4d} w{warps}: {us:6.2f} us "
                      f"({nbytes / us / 1e3:5.0f} GB/s), diff vs cuBLAS {diffs['diff_vs_cublas']:.3g}", flush=True)
        best = min(sweep, key=lambda r: r["us"]) if sweep else None
        rows = []
        for tokens in (1, 2, 4):
            x, diffs = check(tokens)
            ref_us = run(torch.nn.functional.linear, x)
            default_us = run(triton_linear.gemv, x)
            row = dict(tokens=tokens, cublas_us=ref_us, triton_default_us=default_us,
                       default_tiles=triton_linear.default_tiles(tokens, n, k), **diffs)
            if best is not None:
                tiles = {key: best[key] for key in ("block_n", "block_k", "num_warps")}
                row["triton_best_t1_tiles_us"] = run(lambda x, w: triton_linear.gemv(x, w, **tiles), x)
            rows.append(row)
            print(f"gemv {name} [{n}, {k}] ({nbytes / 4.3e6:.1f} us at 4.3 TB/s) T={tokens}: "
                  f"cuBLAS {ref_us:6.2f} us ({nbytes / ref_us / 1e3:5.0f} GB/s), "
                  f"triton defaults {row['default_tiles']} {default_us:6.2f} us ({nbytes / default_us / 1e3:5.0f} "
                  f"GB/s), T=1 best tiles {row.get('triton_best_t1_tiles_us', float('nan')):6.2f} us; "
                  f"cuBLAS / triton {ref_us / default_us:.2f}; max |diff| vs cuBLAS {diffs['diff_vs_cublas']:.3g}, "
                  f"vs fp32: triton {diffs['err_triton']:.3g} cuBLAS {diffs['err_cublas']:.3g}", flush=True)
        out.append(dict(name=name, n=n, k=k, calls=calls, weight_bytes=nbytes, bandwidth_us_at_4_3_tb_s=nbytes / 4.3e6,
                        sweep=sweep, best_tiles_t1=best, by_tokens=rows))
        weights.clear()
        torch.cuda.empty_cache()
    dispatched = [s for s in out if s["name"] != "lm_head"]
    wins = [t for t in (1, 2, 4) if all(r["triton_default_us"] < r["cublas_us"] for s in dispatched
                                        for r in s["by_tokens"] if r["tokens"] <= t)]
    saved = {t: sum(s["calls"] * (r["cublas_us"] - r["triton_default_us"]) for s in dispatched for r in s["by_tokens"]
                    if r["tokens"] == t) for t in (1, 2, 4)}
    print(f"gemv: defaults beat cuBLAS at every dispatched shape up to T = {max(wins, default=0)} "
          f"(ops.triton_linear.MAX_TOKENS = {triton_linear.MAX_TOKENS}); us saved per decode step at these four "
          f"shapes: " + ", ".join(f"T={t}: {v:.0f}" for t, v in saved.items()), flush=True)
    results["gemv"] = dict(shapes=out, max_winning_tokens=max(wins, default=0), us_saved_per_step=saved)

def bench_gdn(results):
    from qwen4exp.ops.gated_delta import gdn_gates
    from qwen4exp.ops.norm import gated_rms_norm
    from qwen4exp.ops.triton_gdn import (
        _block_v,
        fused_recurrent_gated_delta_rule,
        fused_recurrent_gated_delta_rule_raw,
    )

    hk, hv, d, dev, dt, layers = 16, 48, 128, "cuda", torch.bfloat16, 36
    g = torch.Generator(device=dev).manual_seed(0)
    A_log = torch.rand(hv, device=dev, generator=g) * 2.7  # decay rates 1 .. 15, fp32 as the loader keeps them
    dt_bias = torch.randn(hv, device=dev, generator=g)
    norm_w = (torch.rand(d, device=dev, generator=g) + 0.5).to(dt)
    rows = []
    for batch in (1, 64):
        qkv = torch.randn(batch, 2 * hk * d + hv * d, device=dev, generator=g).to(dt)  # the conv's output
        q, k, v = qkv.split([hk * d, hk * d, hv * d], -1)
        q, k, v = q.reshape(batch, hk, d), k.reshape(batch, hk, d), v.reshape(batch, hv, d)
        # the merged in_proj output: z, b, a are strided views of it, as in GatedDeltaNet
        proj = torch.randn(batch, qkv.shape[1] + hv * d + 2 * hv, device=dev, generator=g).to(dt)
        z, b, a = proj[:, qkv.shape[1]:].split([hv * d, hv, hv], -1)
        slots = torch.arange(1, batch + 1, device=dev)
        has_init = torch.ones(batch, dtype=torch.bool, device=dev)
        state = torch.randn(batch + 1, hv, d, d, device=dev, generator=g) * 0.05
        s_sep, s_fused = state.clone(), state.clone()

        def separate(st=s_sep):
            beta, gg = gdn_gates(b, a, A_log, dt_bias)
            return fused_recurrent_gated_delta_rule(q, k, v, gg, beta, st, slots, has_init)

        def fused(st=s_fused, bv=None):
            return fused_recurrent_gated_delta_rule_raw(q, k, v, b, a, A_log, dt_bias, st, slots, has_init,
                                                        block_v=bv)

        ref_state, got_state = state.clone(), state.clone()
        ref, got = separate(ref_state), fused(got_state)
        row = dict(batch=batch, default_block_v=_block_v(batch * hv, d),
                   max_abs_diff_out=(ref.float() - got.float()).abs().max().item(),
                   max_abs_diff_state=(ref_state - got_state).abs().max().item())
        beta, gg = gdn_gates(b, a, A_log, dt_bias)
        row["gates_us"] = per_call_us(lambda: gdn_gates(b, a, A_log, dt_bias), calls=layers)
        row["recurrent_us"] = per_call_us(
            lambda: fused_recurrent_gated_delta_rule(q, k, v, gg, beta, s_sep, slots, has_init), calls=layers)
        row["gates_plus_recurrent_us"] = per_call_us(separate, calls=layers)
        row["fused_us"] = per_call_us(fused, calls=layers)
        row["fused_by_block_v_us"] = {bv: per_call_us(lambda: fused(bv=bv), calls=layers)
                                      for bv in (8, 16, 32, 64, 128)}
        # the output norm: over [T*Hv, D] rows, where z's reshape is a copy at batch > 1 (before), and over the
        # [T, Hv, D] views (now)
        row["norm_before_us"] = per_call_us(
            lambda: gated_rms_norm(got.reshape(-1, d), z.reshape(-1, d), norm_w, 1e-6, "sigmoid"), calls=layers)
        row["norm_now_us"] = per_call_us(
            lambda: gated_rms_norm(got, z.reshape(batch, hv, d), norm_w, 1e-6, "sigmoid"), calls=layers)
        rows.append(row)
        tiles = ", ".join(f"{bv}: {us:.2f}" for bv, us in row["fused_by_block_v_us"].items())
        print(f"gdn B={batch}: gates {row['gates_us']:.2f} us + recurrent {row['recurrent_us']:.2f} us, together "
              f"{row['gates_plus_recurrent_us']:.2f} us; fused {row['fused_us']:.2f} us "
              f"(block_v {row['default_block_v']}); max |diff| out {row['max_abs_diff_out']:.3g}, state "
              f"{row['max_abs_diff_state']:.3g}", flush=True)
        print(f"gdn B={batch}: fused by block_v (us) {tiles}; gated norm before {row['norm_before_us']:.2f} us, "
              f"now {row['norm_now_us']:.2f} us", flush=True)
    results["gdn"] = rows


def bench_conv(results):
    """GDN causal conv (10240 channels, 4 taps, bf16 state [S, C, 3]): the update kernel at batch 1 and 64 and the
    varlen kernel at 8 x 1024 tokens, against the torch reference, over tile sizes."""
    from qwen4exp.ops.triton_conv import causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_varlen

    C, K, dev, dt = 10240, 4, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(C, K, device=dev, generator=g) * 0.5).to(dt)
    out = {"update": [], "varlen": []}
    for batch in (1, 64):
        x = torch.randn(batch, C, device=dev, generator=g).to(dt)
        state = torch.randn(batch + 1, C, K - 1, device=dev, generator=g).to(dt)
        slots = torch.arange(1, batch + 1, device=dev)
        has_init = torch.ones(batch, dtype=torch.bool, device=dev)
        row = {"batch": batch, "ref_us": per_call_us(lambda: causal_conv1d_update_ref(x, w, state, slots, has_init),
                                                     calls=36)}
        for bc in (64, 128, 256, 512, 1024):
            for nw in (1, 2, 4, 8):
                st = state.clone()
                us = per_call_us(lambda: causal_conv1d_update(x, w, st, slots, has_init, block_c=bc, num_warps=nw),
                                 calls=36)
                row[f"bc{bc}_w{nw}"] = us
        got_state = state.clone()
        state_copy = state.clone()
        got = causal_conv1d_update(x, w, got_state, slots, has_init)
        ref = causal_conv1d_update_ref(x, w, state_copy, slots, has_init)
        row["max_abs_diff"] = (got.float() - ref.float()).abs().max().item()
        best = min((k for k in row if k.startswith("bc")), key=row.get)
        print(f"conv update B={batch}: ref {row['ref_us']:.2f} us, 128 channels x 1 warp (the default) "
              f"{row['bc128_w1']:.2f} us, 256 x 4 (the old default) {row['bc256_w4']:.2f} us, best {best} "
              f"{row[best]:.2f} us, diff {row['max_abs_diff']:.3g}", flush=True)
        out["update"].append(row)
    n, L = 8, 1024
    T = n * L
    x = torch.randn(T, C, device=dev, generator=g).to(dt)
    qsl = torch.arange(0, T + 1, L, device=dev)
    slots = torch.arange(1, n + 1, device=dev)
    has_init = torch.zeros(n, dtype=torch.bool, device=dev)
    state = torch.zeros(n + 1, C, K - 1, device=dev, dtype=dt)
    # as in the model: q, k, v are the first 10240 columns of GDN's [T, 16480] in_proj output, written planar
    x_model = torch.randn(T, 16480, device=dev, generator=g).to(dt)[:, :C]
    for layout, xs, split in (("contiguous", x, None), ("model", x_model, (2048, 2048, 6144))):
        row = {"tokens": T, "layout": layout, "bytes_in_out": 2 * T * C * 2}
        for bt in (16, 32, 64, 128):
            for bc in (64, 128, 256):
                for nw in (4, 8):
                    row[f"bt{bt}_bc{bc}_w{nw}"] = per_call_us(
                        lambda: causal_conv1d_varlen(xs, w, state, qsl, slots, has_init,
                                                     block_t=bt, block_c=bc, num_warps=nw, split=split), calls=8)
        best = min((k for k in row if k.startswith("bt")), key=row.get)
        print(f"conv varlen 8x1024 ({layout} input): default {row['bt32_bc128_w4']:.1f} us, best {best} "
              f"{row[best]:.1f} us (bandwidth time at 4 TB/s: {row['bytes_in_out'] / 4e6:.1f} us)", flush=True)
        out["varlen"].append(row)
    results["conv"] = out


def bench_hc_batch(results):
    """The hyper-connection combine + mix at 64 and 8192 tokens (decode at batch 64, an 8 x 1k prefill step): the
    compiled combine and compiled mix (before), against `ops.hyper_connection.hc_mix` with the combine deferred into
    it (the Triton combine + norm pass, then the compiled rest); max |diff| of the block input between the two."""
    from qwen4exp.ops.hyper_connection import hc_combine, hc_mix

    hc, hidden, rank, dev, dt = 4, 2560, 320, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    norm_w = torch.randn(hc * hidden, device=dev, generator=g).to(dt) * 0.1
    w_di = (torch.randn(rank + hc + 4, hc * hidden, device=dev, generator=g) / (hc * hidden) ** 0.5).to(dt)
    w_up = (torch.randn(hc * hidden, rank, device=dev, generator=g) / rank**0.5).to(dt)
    rows = []
    for tokens in (64, 8192):
        streams = torch.randn(tokens, hc * hidden, device=dev, generator=g).to(dt)
        block = torch.randn(tokens, hidden, device=dev, generator=g).to(dt)
        inject = torch.rand(tokens, hc, device=dev, generator=g).to(dt)
        args = (norm_w, w_di, w_up, 1e-6, hc, rank, True)
        calls = 96 if tokens <= 64 else 8

        def before():
            return hc_mix_ref(hc_combine(streams, block, inject), *args)

        def deferred():
            return hc_mix(streams, *args, block, inject)[1:]

        row = {"tokens": tokens, "mix_us": per_call_us(lambda: hc_mix_ref(streams, *args), calls=calls),
               "combine_us": per_call_us(lambda: hc_combine(streams, block, inject), calls=calls),
               "combine_then_mix_us": per_call_us(before, calls=calls),
               "deferred_combine_mix_us": per_call_us(deferred, calls=calls),
               "max_abs_diff": (before()[0].float() - deferred()[0].float()).abs().max().item(),
               "streams_bytes": streams.numel() * 2}
        print(f"hc T={tokens}: mix {row['mix_us']:.1f} us, combine {row['combine_us']:.1f} us; combine then mix "
              f"{row['combine_then_mix_us']:.1f} us, deferred combine + mix {row['deferred_combine_mix_us']:.1f} us, "
              f"max |diff| {row['max_abs_diff']:.3g} (streams {row['streams_bytes'] / 1e6:.1f} MB)", flush=True)
        rows.append(row)
    results["hc_batch"] = rows


def hc_weight_sets(copies, g, hc, hidden, rank, dt, dev):
    """`copies` (W_down_inject [rank + hc + 4 padding rows, hc*H], W_up [hc*H, rank]) pairs of a mix's weights."""
    return [((torch.randn(rank + hc + 4, hc * hidden, device=dev, generator=g) / (hc * hidden) ** 0.5).to(dt),
             (torch.randn(hc * hidden, rank, device=dev, generator=g) / rank**0.5).to(dt)) for _ in range(copies)]


def bench_hc_autotune(results, token_counts=(64,), copies=24):
    """The hyper-connection mix after its norm (`hc_mix_normed`: down GEMM, activations, up GEMM, gate and stream
    mean) compiled as the model compiles it (cuBLAS GEMMs, inductor's elementwise kernels) against inductor's
    max-autotune (Triton GEMM templates where they win, with the elementwise work fused into their epilogues), static
    shapes, alternating; `copies` weight sets so no call finds its weights in L2. us per call and max |diff|."""
    from qwen4exp.ops.hyper_connection import hc_mix_normed

    hc, hidden, rank, dev, dt = 4, 2560, 320, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    sets = hc_weight_sets(copies, g, hc, hidden, rank, dt, dev)
    rows = []
    for tokens in token_counts:
        normed = torch.randn(tokens, hc * hidden, device=dev, generator=g).to(dt)
        variants = {"default": torch.compile(hc_mix_normed.eager, fullgraph=True, dynamic=False),
                    "autotuned": torch.compile(hc_mix_normed.eager, fullgraph=True, dynamic=False,
                                               mode="max-autotune-no-cudagraphs")}
        row = {"tokens": tokens, "default_us": [], "autotuned_us": []}
        try:
            outs = {k: fn(normed, *sets[0], hc, rank, True) for k, fn in variants.items()}
            row["max_diff"] = max((a.float() - b.float()).abs().max().item()
                                  for a, b in zip(outs["default"], outs["autotuned"]))
            for _ in range(2):
                for label, fn in variants.items():
                    state = {"i": 0}

                    def call(fn=fn):
                        fn(normed, *sets[state["i"] % copies], hc, rank, True)
                        state["i"] += 1
                    row[label + "_us"].append(per_call_us(call, calls=96 if tokens <= 64 else 8))
        except Exception as e:
            row["error"] = repr(e)[:300]
            print(f"hc_autotune T={tokens}: {row['error']}", flush=True)
            rows.append(row)
            continue
        rows.append(row)
        print(f"hc_autotune T={tokens}: default {min(row['default_us']):.2f} us, autotuned "
              f"{min(row['autotuned_us']):.2f} us, max |diff| {row['max_diff']:.3g}; x96 a step: "
              f"{96 * (min(row['default_us']) - min(row['autotuned_us'])):.0f} us saved", flush=True)
    results["hc_autotune"] = rows


# (requests, new tokens each, tokens already cached each): two prompt steps from scratch, and chunks after a prefix
PREFILL_CASES = ((8, 1024, 0), (1, 8192, 0), (4, 1024, 3072), (1, 512, 0), (1, 256, 0), (2, 256, 2048))
# (block_m rows = tokens x 12 heads, block_n, num_warps, num_stages), besides prefill_tile_config's defaults
PREFILL_TILES = ((64, 32, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3))


def bench_prefill_attn(results, cases=PREFILL_CASES, tiles=PREFILL_TILES, widths=(24, 2, 256, 16), dev="cuda",
                       dt=torch.bfloat16, calls=12, sample_rows=256):
    """Dense causal prefill attention (the non-QSA layers' case) at flash-next widths: the current per-token
    sparse_paged_attention against prefill_paged_attention at its defaults and other tiles. Pages are shuffled;
    each step's tile table is built outside the timed graph (once per step in the model). max |diff| is against the
    current path over every row; err_fp32 against the fp32 torch reference on `sample_rows` rows spread over the
    step, for both kernels. The other arguments exist so the part can be smoke-tested small on the CPU."""
    from qwen4exp.model.metadata import build_q_tiles
    from qwen4exp.ops.triton_attention import (
        prefill_paged_attention,
        prefill_tile_config,
        prefill_tile_tokens,
        sparse_paged_attention,
        sparse_paged_attention_ref,
    )

    hq, hkv, D, page = widths
    group = hq // hkv
    g = torch.Generator(device=dev).manual_seed(0)
    default = prefill_tile_config(D, group)
    out_rows = []
    for n_req, new, ctx in cases:
        T, total = n_req * new, ctx + new
        pages = -(-total // page)
        num_pages = n_req * pages + 1
        block_tables = (torch.randperm(num_pages - 1, device=dev, generator=g) + 1).view(n_req, pages).int()
        k_cache = torch.randn(num_pages, page, hkv, D, device=dev, generator=g).to(dt)
        v_cache = torch.randn(num_pages, page, hkv, D, device=dev, generator=g).to(dt)
        q = torch.randn(T, hq, D, device=dev, generator=g).to(dt)
        token_req = torch.arange(T, device=dev) // new
        token_pos = ctx + torch.arange(T, device=dev) % new
        qsl, ctxs = list(range(0, T + 1, new)), [ctx] * n_req
        scale = D**-0.5
        # QK^T and PV over each query's visible keys (the causal half, plus the whole prefix)
        flops = 4 * hq * D * n_req * sum(ctx + i + 1 for i in range(new))
        sample = torch.linspace(0, T - 1, min(sample_rows, T), device=dev).long()
        exact = sparse_paged_attention_ref(q[sample].float(), k_cache.float(), v_cache.float(), block_tables,
                                           token_req[sample], token_pos[sample], scale)

        def current():
            return sparse_paged_attention(q, k_cache, v_cache, block_tables, token_req, token_pos, scale,
                                          max_context=total)

        ref = current()
        row = dict(requests=n_req, new_tokens=new, cached=ctx, tflop=flops / 1e12,
                   current_us=per_call_us(current, calls=calls),
                   current_err_fp32=(ref[sample].float() - exact).abs().max().item(), sweep=[])
        print(f"prefill_attn {n_req}x{new} after {ctx}: sparse_paged_attention {row['current_us']:8.1f} us "
              f"({flops / row['current_us'] / 1e6:6.1f} TFLOP/s), err vs fp32 {row['current_err_fp32']:.3g}",
              flush=True)
        for cfg in [default] + [dict(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in tiles]:
            q_tiles = build_q_tiles(qsl, ctxs, prefill_tile_tokens(cfg["block_m"], group)).to(dev)

            def flash(cfg=cfg, q_tiles=q_tiles):
                return prefill_paged_attention(q, k_cache, v_cache, block_tables, token_pos, q_tiles, scale, **cfg)

            got = flash()
            entry = dict(cfg, default=cfg is default, num_tiles=q_tiles.shape[0],
                         max_abs_diff=(got.float() - ref.float()).abs().max().item(),
                         err_fp32=(got[sample].float() - exact).abs().max().item())
            entry["us"] = per_call_us(flash, calls=calls)
            row["sweep"].append(entry)
            print(f"prefill_attn {n_req}x{new} after {ctx}: prefill_paged_attention {cfg['block_m']:3d} rows "
                  f"({prefill_tile_tokens(cfg['block_m'], group)} tokens) x {cfg['block_n']:2d} keys "
                  f"w{cfg['num_warps']} s{cfg['num_stages']}{' (defaults)' if cfg is default else ''}: "
                  f"{entry['us']:8.1f} us ({flops / entry['us'] / 1e6:6.1f} TFLOP/s, "
                  f"{row['current_us'] / entry['us']:.2f}x the current path's speed), "
                  f"max |diff| {entry['max_abs_diff']:.3g}, err vs fp32 {entry['err_fp32']:.3g}", flush=True)
        best = min(row["sweep"], key=lambda e: e["us"])
        print(f"prefill_attn {n_req}x{new} after {ctx}: best {best['block_m']}x{best['block_n']} w{best['num_warps']} "
              f"s{best['num_stages']} {best['us']:.1f} us vs current {row['current_us']:.1f} us", flush=True)
        out_rows.append(row)
    results["prefill_attn"] = out_rows


# (name, out, in, calls per decode step) of the dense projections cuBLAS runs at batch 64 and in prefill
LAYOUT_SHAPES = (("out_proj", 2560, 6144, 48), ("moe_router_shared", 1416, 2560, 48), ("gdn_in_proj", 16480, 2560, 36),
                 ("attn_qkv_index", 13952, 2560, 12), ("shared_down", 2560, 640, 48), ("hc_down", 328, 10240, 96),
                 ("hc_up", 10240, 320, 96))


def bench_gemm_layouts(results, shapes=LAYOUT_SHAPES, token_counts=(64, 8192), dev="cuda"):
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, n, k, calls in shapes:
        nbytes = n * k * 2
        weights = weight_copies(n, k, calls, g, dt, dev)
        copies = len(weights)
        transposed = [w.t().contiguous() for w in weights]
        variants = {"TN": lambda x, i: torch.nn.functional.linear(x, weights[i]),
                    "NN": lambda x, i: torch.mm(x, transposed[i]),
                    # the same weights, the transposed product: W @ x^T is [n, T], cuBLAS gets the skinny side as N
                    "out_T": lambda x, i: torch.mm(weights[i], x.t()).t()}
        if name == "hc_down":
            padded = [torch.cat([w, w.new_zeros(384 - n, k)]) for w in weights]
            variants["TN_rows_384"] = lambda x, i: torch.nn.functional.linear(x, padded[i])
        for tokens in token_counts:
            x = torch.randn(tokens, k, device=dev, generator=g).to(dt)
            row = dict(name=name, n=n, k=k, calls=calls, tokens=tokens)
            ref = torch.nn.functional.linear(x, weights[0]).float()
            for label, fn in variants.items():
                state = {"i": 0}

                def call(fn=fn):
                    fn(x, state["i"] % copies)
                    state["i"] += 1
                us = per_call_us(call, calls=max(calls, 4) if tokens <= 64 else 8)
                row[label + "_us"] = us
                row[label + "_max_diff"] = (fn(x, 0)[:, :n].float() - ref).abs().max().item()
            row["nn_saves_us_per_step"] = calls * (row["TN_us"] - row["NN_us"])
            rows.append(row)
            rate = (f"{nbytes / row['TN_us'] / 1e3:5.0f} GB/s" if tokens <= 64
                    else f"{2 * tokens * n * k / row['TN_us'] / 1e6:5.0f} TFLOPS")
            extra = {key: round(v, 2) for key, v in row.items() if key.endswith("_us") and key != "TN_us"}
            print(f"gemm_layouts {name} [{n}, {k}] T={tokens}: TN {row['TN_us']:7.2f} us ({rate}), {extra}, "
                  f"NN saves {row['nn_saves_us_per_step']:.0f} us per step", flush=True)
        weights.clear(), transposed.clear()
        torch.cuda.empty_cache()
    for tokens in token_counts:
        total = sum(r["nn_saves_us_per_step"] for r in rows if r["tokens"] == tokens)
        print(f"gemm_layouts: NN instead of TN at every shape saves {total:.0f} us per step of {tokens} tokens",
              flush=True)
    results["gemm_layouts"] = rows


PARTIAL_SHAPES = (("hc_down", 328, 10240, 96), ("out_proj", 2560, 6144, 48), ("gdn_in_proj", 16480, 2560, 36),
                  ("attn_qkv_index", 13952, 2560, 12), ("moe_router_shared", 1416, 2560, 48))


def kernel_names(fn) -> list[str]:
    """The CUDA kernels one eager call of `fn` launches, in order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def bench_partials(results, shapes=PARTIAL_SHAPES, tokens=64, splits=(1, 2, 4, 8, 16), dev="cuda"):
    """F.linear at 64 tokens (cuBLAS's choice: a split-K GEMM and its reduce kernel at some shapes) against the
    product as S partial sums over K slices, one cuBLAS batched GEMM with fp32 outputs [S, T, N], the reduce left to
    the consumer (which already is an elementwise kernel after every split-K projection of the decode step). Timed
    alone and with a compiled sum to bf16 after it (an upper bound on what the consumer pays)."""
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    summed = torch.compile(lambda p: p.sum(0).to(torch.bfloat16))
    for name, n, k, calls in shapes:
        weights = weight_copies(n, k, calls, g, dt, dev)
        copies = len(weights)
        x = torch.randn(tokens, k, device=dev, generator=g).to(dt)
        ref = (x.float() @ weights[0].float().t())
        row = dict(name=name, n=n, k=k, calls=calls, tokens=tokens)

        def partials(i, s):
            w = weights[i]
            return torch.bmm(x.view(tokens, s, k // s).transpose(0, 1), w.view(n, s, k // s).permute(1, 2, 0),
                             out_dtype=torch.float32)

        variants = {"linear": lambda i: torch.nn.functional.linear(x, weights[i])}
        for s in splits:
            if k % s == 0:
                variants[f"partials{s}"] = lambda i, s=s: partials(i, s)
                variants[f"partials{s}_sum"] = lambda i, s=s: summed(partials(i, s))
        for label, fn in variants.items():
            state = {"i": 0}

            def call(fn=fn):
                fn(state["i"] % copies)
                state["i"] += 1
            row[label + "_us"] = per_call_us(call, calls=max(calls, 4))
            out = fn(0)
            out = out.sum(0) if out.dim() == 3 else out
            row[label + "_max_diff"] = (out.float() - ref).abs().max().item()
            row[label + "_kernels"] = kernel_names(lambda: fn(0))
            print(f"partials {name} [{n}, {k}] T={tokens} {label}: {row[label + '_us']:7.2f} us "
                  f"({n * k * 2 / row[label + '_us'] / 1e3:5.0f} GB/s), max diff {row[label + '_max_diff']:.2e}, "
                  f"kernels {row[label + '_kernels']}", flush=True)
        rows.append(row)
        weights.clear()
        torch.cuda.empty_cache()
    results["partials"] = rows


def bench_hc_partials(results, token_counts=(2, 8, 16, 32, 64, 128, 256), splits=(8, 16, 32), copies=24):
    """The hyper-connection mix after its norm as the model runs it at 2-256 tokens: `hc_mix_normed` (cuBLAS's
    down GEMM, split-K with its reduce kernel at decode sizes) against `ops.linear.partial_products` (a batched GEMM
    of S fp32 partial products) + `hc_mix_partials` (their sum in the activation kernel), alternating, two rounds;
    `copies` weight sets so that no call finds its weights in L2. us per call, max |diff| of both outputs."""
    from qwen4exp.ops.hyper_connection import hc_mix_normed, hc_mix_partials
    from qwen4exp.ops.linear import partial_products

    hc, hidden, rank, dev, dt = 4, 2560, 320, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    sets = hc_weight_sets(copies, g, hc, hidden, rank, dt, dev)
    rows = []
    for tokens in token_counts:
        normed = torch.randn(tokens, hc * hidden, device=dev, generator=g).to(dt)
        variants = {"normed": lambda w_di, w_up: hc_mix_normed(normed, w_di, w_up, hc, rank, True)}
        for s in splits:
            variants[f"partials{s}"] = lambda w_di, w_up, s=s: hc_mix_partials(
                normed, partial_products(normed, w_di, s), w_up, hc, rank, True)
        variants["partials16_bmm_only"] = lambda w_di, w_up: partial_products(normed, w_di, 16)[:, 0, :1]
        row = {"tokens": tokens}
        ref = variants["normed"](*sets[0])
        for label, fn in variants.items():
            out = fn(*sets[0])
            row[label + "_max_diff"] = max((a.float() - b.float()).abs().max().item()
                                           for a, b in zip(out, ref)) if isinstance(out, tuple) else float("nan")
            row[label + "_us"] = []
        for _ in range(2):
            for label, fn in variants.items():
                state = {"i": 0}

                def call(fn=fn):
                    fn(*sets[state["i"] % copies])
                    state["i"] += 1
                row[label + "_us"].append(per_call_us(call, calls=96 if tokens <= 128 else 16))
        rows.append(row)
        print(f"hc_partials T={tokens}: " + ", ".join(
            f"{label} {min(row[label + '_us']):.2f} us (diff {row[label + '_max_diff']:.2g})" for label in variants),
            flush=True)
    results["hc_partials"] = rows


def bench_output_partials(results, token_counts=(2, 8, 64, 128), splits=(2, 4, 8), copies=48):
    """A block's output projection (out_proj / o_proj [2560, 6144], 48 a step) and the next mix's combine + norm pass
    (`triton_hc.hc_prenorm`) at 2-128 tokens: F.linear (cuBLAS: a split-K GEMM and its reduce kernel) then the
    combine of its bf16 output, against `ops.linear.partial_products` (S fp32 partials from one batched GEMM) then
    the combine summing them (read once per stream: 4 times a token). Alternating, two rounds; each call reads its
    own weight copy, out of L2. us per pair of calls, max |diff| of the normed streams."""
    from qwen4exp.ops.linear import partial_products
    from qwen4exp.ops.triton_hc import hc_prenorm

    hc, hidden, k, dev, dt = 4, 2560, 6144, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    weights = weight_copies(hidden, k, copies, g, dt, dev)
    norm_w = (torch.randn(hc * hidden, device=dev, generator=g) * 0.1).to(dt)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, k, device=dev, generator=g).to(dt)
        streams = torch.randn(tokens, hc * hidden, device=dev, generator=g).to(dt)
        inject = (torch.rand(tokens, hc, device=dev, generator=g) * 2).to(dt)
        variants = {"linear": lambda w: hc_prenorm(streams, norm_w, 1e-6, hc, torch.nn.functional.linear(x, w),
                                                   inject)}
        for s in splits:
            variants[f"partials{s}"] = lambda w, s=s: hc_prenorm(streams, norm_w, 1e-6, hc,
                                                                 partial_products(x, w, s), inject)
        row = {"tokens": tokens}
        ref = variants["linear"](weights[0])[1].float()
        for label, fn in variants.items():
            row[label + "_max_diff"] = (fn(weights[0])[1].float() - ref).abs().max().item()
            row[label + "_us"] = []
        for _ in range(2):
            for label, fn in variants.items():
                state = {"i": 0}

                def call(fn=fn):
                    fn(weights[state["i"] % len(weights)])
                    state["i"] += 1
                row[label + "_us"].append(per_call_us(call, calls=48))
        rows.append(row)
        print(f"output_partials T={tokens}: " + ", ".join(
            f"{label} {min(row[label + '_us']):.2f} us (diff {row[label + '_max_diff']:.2g})" for label in variants),
            flush=True)
    results["output_partials"] = rows


def bench_autotune_linear(results, shapes=LAYOUT_SHAPES, token_counts=(64,), dev="cuda"):
    """F.linear (cuBLAS's heuristic choice) against inductor's max-autotune of the same GEMM (its Triton templates,
    split-K decompositions and cuBLAS, benchmarked at compile time for this exact shape) at the decode projections,
    alternating; each call reads a weight no longer in L2. Per step, the microseconds the autotuned GEMM would save:
    the M = 64 GEMMs of the batch-64 step take ~1.5 ms more than their weights' bytes at the copy bandwidth."""
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, n, k, calls in shapes:
        nbytes = n * k * 2
        weights = weight_copies(n, k, calls, g, dt, dev)
        copies = len(weights)
        for tokens in token_counts:
            x = torch.randn(tokens, k, device=dev, generator=g).to(dt)
            tuned = torch.compile(lambda a, w: torch.nn.functional.linear(a, w), mode="max-autotune-no-cudagraphs",
                                  dynamic=False)
            variants = {"cublas": torch.nn.functional.linear, "autotuned": tuned}
            row = dict(name=name, n=n, k=k, calls=calls, tokens=tokens, cublas_us=[], autotuned_us=[])
            try:
                ref = torch.nn.functional.linear(x, weights[0]).float()
                row["max_diff"] = (tuned(x, weights[0]).float() - ref).abs().max().item()
                for _ in range(2):
                    for label, fn in variants.items():
                        state = {"i": 0}

                        def call(fn=fn):
                            fn(x, weights[state["i"] % copies])
                            state["i"] += 1
                        row[label + "_us"].append(per_call_us(call, calls=max(calls, 4)))
            except Exception as e:  # an autotuning failure is a result too
                row["error"] = repr(e)[:300]
                print(f"autotune_linear {name} T={tokens}: {row['error']}", flush=True)
                rows.append(row)
                continue
            row["saves_us_per_step"] = calls * (min(row["cublas_us"]) - min(row["autotuned_us"]))
            rows.append(row)
            print(f"autotune_linear {name} [{n}, {k}] T={tokens}: cublas {min(row['cublas_us']):7.2f} us, "
                  f"autotuned {min(row['autotuned_us']):7.2f} us ({nbytes / min(row['autotuned_us']) / 1e3:5.0f} "
                  f"GB/s), max diff {row['max_diff']:.3g}; saves {row['saves_us_per_step']:.0f} us per step",
                  flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    for tokens in token_counts:
        total = sum(r.get("saves_us_per_step", 0) for r in rows if r["tokens"] == tokens)
        print(f"autotune_linear: the autotuned GEMMs save {total:.0f} us per step of {tokens} tokens", flush=True)
    results["autotune_linear"] = rows


def bench_blas_backends(results, shapes=LAYOUT_SHAPES + (("lm_head", 151936, 2560, 1),), token_counts=(1, 64, 8192),
                        dev="cuda"):
    """F.linear through cuBLAS (torch's default) and through cuBLASLt (`torch.backends.cuda.preferred_blas_library`),
    alternating, at the model's projections; per step, the microseconds cuBLASLt would save."""
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    default = torch.backends.cuda.preferred_blas_library()
    rows = []
    try:
        for name, n, k, calls in shapes:
            weights = weight_copies(n, k, calls, g, dt, dev)
            copies = len(weights)
            for tokens in token_counts:
                if name == "lm_head" and tokens > 64:
                    continue
                x = torch.randn(tokens, k, device=dev, generator=g).to(dt)
                row = dict(name=name, n=n, k=k, calls=calls, tokens=tokens, cublas_us=[], cublaslt_us=[])
                for _ in range(2):
                    for backend in ("cublas", "cublaslt"):
                        torch.backends.cuda.preferred_blas_library(backend)
                        state = {"i": 0}

                        def call():
                            torch.nn.functional.linear(x, weights[state["i"] % copies])
                            state["i"] += 1
                        row[backend + "_us"].append(per_call_us(call, calls=max(calls, 4) if tokens <= 64 else 8))
                torch.backends.cuda.preferred_blas_library(default)
                row["lt_saves_us_per_step"] = calls * (min(row["cublas_us"]) - min(row["cublaslt_us"]))
                rows.append(row)
                print(f"blas {name} [{n}, {k}] T={tokens}: cublas {min(row['cublas_us']):8.2f} us, cublaslt "
                      f"{min(row['cublaslt_us']):8.2f} us; Lt saves {row['lt_saves_us_per_step']:.0f} us per step",
                      flush=True)
            weights.clear()
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    for tokens in token_counts:
        total = sum(r["lt_saves_us_per_step"] for r in rows if r["tokens"] == tokens)
        print(f"blas: cuBLASLt everywhere saves {total:.0f} us per step of {tokens} tokens", flush=True)
    results["blas_backends"] = rows


def bench_norms(results, token_counts=(64, 256, 512, 8192), dev="cuda"):
    """The GDN output norm ([T, 48, 128], the gate a strided view of the in_proj output, 36 calls a step) and the
    PLE's grouped norm ([T, 4 x 2560], 3 calls a step): compiled (what the model ran before) against the Triton passes,
    alternating; the threshold ops.norm.TRITON_NORM_MIN_TOKENS follows from it."""
    from qwen4exp.ops import norm, triton_hc, triton_norm
    from qwen4exp.ops.triton_moe import silu_mul_halves

    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for tokens in token_counts:
        proj = torch.randn(tokens, 16480, device=dev, generator=g).to(dt)
        x = torch.randn(tokens, 48, 128, device=dev, generator=g).to(dt)
        z = proj[:, 6144 + 4096: 6144 + 4096 + 6144].reshape(tokens, 48, 128)
        w = (torch.rand(128, device=dev, generator=g) + 0.5).to(dt)
        streams = torch.randn(tokens, 4 * 2560, device=dev, generator=g).to(dt)
        sw = (torch.randn(4 * 2560, device=dev, generator=g) * 0.1).to(dt)
        row = dict(tokens=tokens)
        h = torch.randn(10 * tokens, 1280, device=dev, generator=g).to(dt)  # the grouped experts' gate/up output
        variants = {
            "silu_mul_compiled": lambda: silu_mul(*h.chunk(2, dim=-1)),
            "silu_mul_triton": lambda: silu_mul_halves(h),
            "gated_compiled": lambda: norm.gated_rms_norm(x, z, w, 1e-6, "sigmoid"),
            "gated_triton": lambda: triton_norm.gated_rms_norm(x, z, w, 1e-6, "sigmoid"),
            "grouped_compiled": lambda: norm.rms_norm(streams, sw, 1e-6, 2560),
            "grouped_triton": lambda: triton_hc.hc_prenorm(streams, sw, 1e-6, 4)[1],
        }
        for _ in range(2):
            for name, fn in variants.items():
                row.setdefault(name + "_us", []).append(per_call_us(fn, calls=36 if tokens <= 512 else 8))
        row["gated_max_diff"] = (variants["gated_compiled"]().float()
                                 - variants["gated_triton"]().float()).abs().max().item()
        row["grouped_max_diff"] = (variants["grouped_compiled"]().float()
                                   - variants["grouped_triton"]().float()).abs().max().item()
        rows.append(row)
        us = {k: round(min(v), 2) for k, v in row.items() if k.endswith("_us")}
        saves = {name: calls * (us[name + "_compiled_us"] - us[name + "_triton_us"])
                 for name, calls in (("gated", 36), ("silu_mul", 48), ("grouped", 3))}
        print(f"norms T={tokens}: {us}; us saved per step: " + ", ".join(f"{k} {v:.0f}" for k, v in saves.items())
              + f"; max |diff| gated {row['gated_max_diff']:.3g}, grouped {row['grouped_max_diff']:.3g}", flush=True)
    results["norms"] = rows


def bench_moe_tiles(results, tokens=64, check_tokens=(16, 32, 64, 128, 256)):
    from qwen4exp.ops.triton_moe import MoEConfig, Tile, fused_moe, get_config

    E, k, hidden, inter, dev, dt = 128, 10, 2560, 640, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * inter, hidden, device=dev, generator=g) / hidden**0.5).to(dt)
    down = (torch.randn(E, hidden, inter, device=dev, generator=g) / inter**0.5).to(dt)
    weight_gb = (gate_up.numel() + down.numel()) * 2 / 1e9

    def inputs(n):
        x = torch.randn(n, hidden, device=dev, generator=g).to(dt)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(n)])
        return x, ids, torch.softmax(torch.randn(n, k, device=dev, generator=g), -1)

    def run(n, config):
        x, ids, wts = inputs(n)
        ref = fused_moe(x, gate_up, down, ids, wts)
        try:
            got = fused_moe(x, gate_up, down, ids, wts, config=config)
            return per_call_us(lambda: fused_moe(x, gate_up, down, ids, wts, config=config), calls=16), \
                (got.float() - ref.float()).abs().max().item()
        except Exception as e:  # a tile over the shared-memory limit
            print(f"moe_tiles {config}: {type(e).__name__}", flush=True)
            return float("inf"), None

    default = get_config(tokens, E, k, hidden, inter)
    rows = []

    def measure(config, what):
        us, diff = run(tokens, config)
        rows.append(dict(what=what, block_m=config.block_m, gate_up=vars(config.gate_up), down=vars(config.down),
                         us=us, max_abs_diff=diff))
        print(f"moe_tiles T={tokens} {what}: {us:8.2f} us ({weight_gb / us * 1e6:.0f} GB/s) gate_up {config.gate_up} "
              f"down {config.down} |diff| {diff}", flush=True)
        return us

    base = measure(default, "default")
    best = (base, default)
    for bn, bk in ((16, 128), (32, 64), (32, 256), (64, 64), (64, 128)):
        c = MoEConfig(default.block_m, Tile(bn, bk, 1, 4, 4), default.down)
        best = min(best, (measure(c, "gate_up"), c), key=lambda r: r[0])
    gu = best[1].gate_up
    for w, st in ((4, 3), (4, 5), (8, 4), (8, 3), (2, 4)):
        c = MoEConfig(default.block_m, Tile(gu.block_n, gu.block_k, 1, w, st), default.down)
        best = min(best, (measure(c, "gate_up"), c), key=lambda r: r[0])
    gu = best[1].gate_up
    for bn, bk in ((32, 128), (128, 128), (64, 64), (128, 64), (32, 64)):
        c = MoEConfig(default.block_m, gu, Tile(bn, bk, 1, 4, 4))
        best = min(best, (measure(c, "down"), c), key=lambda r: r[0])
    dn = best[1].down
    for w, st in ((4, 3), (4, 5), (8, 4), (8, 3), (2, 4)):
        c = MoEConfig(default.block_m, gu, Tile(dn.block_n, dn.block_k, 1, w, st))
        best = min(best, (measure(c, "down"), c), key=lambda r: r[0])
    chosen = best[1]
    check = []
    for n in check_tokens:  # alternating, twice: the chosen tiles against each size's default
        d = get_config(n, E, k, hidden, inter)
        pair = [run(n, d)[0], run(n, chosen)[0], run(n, d)[0], run(n, chosen)[0]]
        check.append(dict(tokens=n, default_us=pair[::2], chosen_us=pair[1::2], default_tiles=str(d)))
        print(f"moe_tiles T={n}: default {pair[::2]} us, chosen {pair[1::2]} us (48 layers: "
              f"{48 * (min(pair[::2]) - min(pair[1::2])):.0f} us a step)", flush=True)
    results["moe_tiles"] = dict(tokens=tokens, rows=rows, chosen=str(chosen), check=check)


def bench_moe_spread(results, token_counts=(8192, 16384)):
    """The grouped experts' input in expert order at prefill sizes: torch's gather `x[order // k]` (as the grouped
    path did, the division included) and `index_select`, against `spread_rows` (each token read once, written to
    its k sorted rows) at 256-4096 columns a program; its bytes (x read once, the rows written) at the copy rate.
    Then the weighted sum of the pairs' outputs (`sum_pairs`, 512 columns a program by default here) at 512-4096."""
    from qwen4exp.ops.triton_moe import sort_pairs, spread_rows, sum_pairs

    E, k, hidden, dev, dt = 128, 10, 2560, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for n in token_counts:
        x = torch.randn(n, hidden, device=dev, generator=g).to(dt)
        ids = torch.randint(0, E, (n, k), device=dev, generator=g)
        order, _, rows = sort_pairs(ids, E)
        want = x[order // k]
        row = {"tokens": n, "bytes": (n + n * k) * hidden * 2,
               "gather_us": per_call_us(lambda: x[order // k], calls=8),
               "index_select_us": per_call_us(lambda: torch.index_select(x, 0, order // k), calls=8)}
        for block in (256, 512, 1024, 4096):
            assert torch.equal(spread_rows(x, rows, k, block), want)
            row[f"spread_b{block}_us"] = per_call_us(lambda: spread_rows(x, rows, k, block), calls=8)
        y = torch.randn(n * k, hidden, device=dev, generator=g).to(dt)
        wts = torch.softmax(torch.randn(n, k, device=dev, generator=g), -1)
        r2 = rows.view(n, k)
        for block in (512, 1024, 4096):
            row[f"sum_pairs_b{block}_us"] = per_call_us(lambda: sum_pairs(y, k, r2, wts, block=block), calls=8)
        best = min((c for c in row if c.startswith("spread")), key=row.get)
        print(f"moe_spread T={n}: gather {row['gather_us']:.1f} us, index_select {row['index_select_us']:.1f} us, "
              + ", ".join(f"{c} {row[c]:.1f}" for c in row if c.startswith("spread"))
              + f" (best {best}: {row['bytes'] / row[best] / 1e3:.0f} GB/s; 48 layers save "
              f"{48 * (row['gather_us'] - row[best]) / 1e3:.1f} ms a step); sum_pairs "
              + ", ".join(f"{c} {row[c]:.1f}" for c in row if c.startswith("sum_pairs")), flush=True)
        rows_out.append(row)
    results["moe_spread"] = rows_out


def bench_sum_pairs_decode(results):
    """`sum_pairs` as `fused_moe` calls it at decode (pairs in token order, already weighted, the gated shared
    expert added) at 1, 16 and 64 tokens, by columns a program (the default: 256 up to 16 tokens, 512 above)."""
    from qwen4exp.ops.triton_moe import sum_pairs

    k, hidden, dev, dt = 10, 2560, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n in (1, 16, 64):
        y = torch.randn(n * k, hidden, device=dev, generator=g).to(dt)
        shared = (torch.randn(n, hidden, device=dev, generator=g).to(dt),
                  torch.randn(n, 1, device=dev, generator=g).to(dt))
        ref = sum_pairs(y, k, shared=shared, block=1024)
        row = {"tokens": n}
        for block in (256, 512, 1024, 4096):
            assert torch.equal(sum_pairs(y, k, shared=shared, block=block), ref)
            row[f"b{block}_us"] = min(per_call_us(lambda: sum_pairs(y, k, shared=shared, block=block), calls=48)
                                      for _ in range(2))
        rows.append(row)
        print(f"sum_pairs_decode T={n}: " + ", ".join(f"{c} {v:.2f}" for c, v in row.items() if c != "tokens")
              + " us", flush=True)
    results["sum_pairs_decode"] = rows


def bench_gdn_warps(results, batch=64, layers=36):
    from qwen4exp.ops import triton_gdn

    hk, hv, d, dev, dt = 16, 48, 128, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    A_log = torch.rand(hv, device=dev, generator=g) * 2.7
    dt_bias = torch.randn(hv, device=dev, generator=g)
    q, k = (torch.randn(batch, hk, d, device=dev, generator=g).to(dt) for _ in range(2))
    v = torch.randn(batch, hv, d, device=dev, generator=g).to(dt)
    b, a = (torch.randn(batch, hv, device=dev, generator=g).to(dt) for _ in range(2))
    slots = torch.arange(1, batch + 1, device=dev)
    has_init = torch.ones(batch, dtype=torch.bool, device=dev)
    state = torch.randn(batch + 1, hv, d, d, device=dev, generator=g) * 0.05
    state_gb = 2 * batch * hv * d * d * 4 / 1e9  # read and written
    default_warps = triton_gdn._num_warps

    def us(bv, warps):
        triton_gdn._num_warps = (lambda dk, w: warps) if warps else default_warps
        try:
            return per_call_us(lambda: triton_gdn.fused_recurrent_gated_delta_rule_raw(
                q, k, v, b, a, A_log, dt_bias, state, slots, has_init, block_v=bv), calls=layers)
        finally:
            triton_gdn._num_warps = default_warps

    rows = []
    for bv in (32, 64, 128):
        for warps in (1, 2, 4, 8):
            pair = [us(None, None), us(bv, warps), us(None, None), us(bv, warps)]
            rows.append(dict(block_v=bv, num_warps=warps, default_us=pair[::2], us=pair[1::2]))
            print(f"gdn_warps B={batch} block_v {bv} warps {warps}: {min(pair[1::2]):7.2f} us "
                  f"({state_gb / min(pair[1::2]) * 1e6:.0f} GB/s); default {min(pair[::2]):7.2f} us", flush=True)
    results["gdn_warps"] = rows


def bench_norm_rope(results, token_counts=(1, 64, 8192, 16384), dev="cuda"):
    """The attention's per-head norm + partial rotation (query [T, 24, 256] as a view of q_proj's packed heads, key
    [T, 2, 256], indexer query [T, 4, 128]; 64 rotated dims): the compiled norm then the compiled rotation against
    `triton_norm.rms_norm_rope`, 12 layers' worth of calls a graph; and the output gate with the gate reshaped (a
    copy) against the gate passed as its [T, heads, D] view."""
    from qwen4exp.ops.attention import gate_output
    from qwen4exp.ops.norm import rms_norm
    from qwen4exp.ops.rotary import apply_rope, rope_cos_sin
    from qwen4exp.ops.triton_norm import rms_norm_rope

    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float, device=dev) / 64))
    rows = []
    for tokens in token_counts:
        cos, sin = rope_cos_sin(torch.arange(tokens, device=dev), inv_freq, dt)
        row = {"tokens": tokens}
        for name, heads, d, packed in (("q", 24, 256, 2), ("k", 2, 256, 1), ("index_q", 4, 128, 1)):
            x = torch.randn(tokens, heads, packed * d, device=dev, generator=g).to(dt)[..., :d]
            w = (torch.randn(d, device=dev, generator=g) * 0.1).to(dt)
            calls = 12
            two = per_call_us(lambda: apply_rope(rms_norm(x, w, 1e-6), cos, sin), calls=calls)
            one = per_call_us(lambda: rms_norm_rope(x, w, 1e-6, cos, sin), calls=calls)
            a, b = apply_rope(rms_norm(x, w, 1e-6), cos, sin), rms_norm_rope(x, w, 1e-6, cos, sin)
            row[name] = dict(compiled_us=two, triton_us=one, equal_frac=(a == b).float().mean().item(),
                             max_abs_diff=(a.float() - b.float()).abs().max().item())
        out = torch.randn(tokens, 24, 256, device=dev, generator=g).to(dt)
        gate = torch.randn(tokens, 24, 512, device=dev, generator=g).to(dt)[..., 256:]
        row["gate_reshaped_us"] = per_call_us(lambda: gate_output(out.reshape(tokens, -1), gate.reshape(tokens, -1)),
                                              calls=12)
        row["gate_view_us"] = per_call_us(lambda: gate_output(out, gate).reshape(tokens, -1), calls=12)
        print("norm_rope", row, flush=True)
        rows.append(row)
    results["norm_rope"] = rows


def bench_grouped_sort(results, token_counts=(512, 4096, 8192, 16384), dev="cuda"):
    """The grouped path's expert order (prefill): torch's radix argsort + scatter_add + cumsum + inverse scatter
    against the three-launch counting sort (`triton_moe.sort_pairs`), top-10 of 128, 48 calls a graph."""
    from qwen4exp.ops.moe_grouped import sort_pairs_ref
    from qwen4exp.ops.triton_moe import sort_pairs

    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for tokens in token_counts:
        ids = torch.randn(tokens, 128, device=dev, generator=g).topk(10, dim=-1).indices
        same = all(torch.equal(a, b) for a, b in zip(sort_pairs(ids, 128), sort_pairs_ref(ids, 128)))
        row = dict(tokens=tokens, torch_us=per_call_us(lambda: sort_pairs_ref(ids, 128), calls=48),
                   triton_us=per_call_us(lambda: sort_pairs(ids, 128), calls=48), identical=same)
        print("grouped_sort", row, flush=True)
        rows.append(row)
    results["grouped_sort"] = rows
def bench_pdl(results, kernels=192, dev="cuda"):
    """Does programmatic dependent launch shorten kernel boundaries inside a CUDA graph? A chain of small Triton
    kernels (each adds 1 to the previous one's [64, 2560] output; 40 programs) captured three ways: plain launches;
    `launch_pdl=True` with `gdc_wait` first (the next kernel's launch overlaps the previous one's tail); and the same
    with a 40 KB independent load before the wait (a weight, as a GEMV would prefetch). Prints us per kernel and
    checks the chain's result."""
    import triton
    import triton.language as tl

    @triton.jit
    def step(src, dst, w, n, BLOCK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        if PREFETCH:  # independent of the previous kernel: may run before the wait
            acc += tl.load(w + i, mask=i < n, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(src + i, mask=i < n, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(dst + i, x + 1.0 + acc * 0.0, mask=i < n)

    n, block = 64 * 2560, 4096
    bufs = [torch.zeros(n, device=dev) for _ in range(2)]
    w = torch.randn(n, device=dev)
    grid = (triton.cdiv(n, block),)
    rows = {}
    for name, pdl, prefetch in (("plain", False, False), ("pdl", True, False), ("pdl_prefetch", True, True)):
        def chain():
            for j in range(kernels):
                step[grid](bufs[j % 2], bufs[(j + 1) % 2], w, n, BLOCK=block, PDL=pdl, PREFETCH=prefetch,
                           **({"launch_pdl": True} if pdl else {}))
        try:
            bufs[0].zero_()
            chain()
            torch.cuda.synchronize()
            ok = bool((bufs[kernels % 2] == kernels).all())
            us = per_call_us(chain, calls=1) / kernels
        except Exception as e:  # this Triton cannot launch with PDL, or capture rejects it
            rows[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
            print("pdl", name, rows[name], flush=True)
            continue
        rows[name] = dict(us_per_kernel=us, result_ok=ok)
        print(f"pdl {name}: {us:.3f} us per kernel, result ok {ok}", flush=True)
    results["pdl"] = rows


def bench_lm_head(results, vocab=248320, hidden=2560, token_counts=(1, 64), dev="cuda"):
    from qwen4exp.ops.linear import fp32_out_linear

    g = torch.Generator(device=dev).manual_seed(0)
    w = weight_copies(vocab, hidden, 1, g, torch.bfloat16, dev)[0]  # 1.27 GB: never in L2
    rows = []
    for n in token_counts:
        x = torch.randn(n, hidden, device=dev, generator=g).to(torch.bfloat16)
        want = x.float() @ w.float().t()
        row = {"tokens": n,
               "bf16_out_us": per_call_us(lambda: torch.mm(x, w.t()), 4),
               "fp32_out_us": per_call_us(lambda: fp32_out_linear(x, w), 4),
               "bf16_out_argmax_us": per_call_us(lambda: torch.mm(x, w.t()).argmax(-1), 4),
               "fp32_out_argmax_us": per_call_us(lambda: fp32_out_linear(x, w).argmax(-1), 4),
               "fp32_out_max_err": float((fp32_out_linear(x, w) - want).abs().max()),
               "bf16_out_max_err": float((torch.mm(x, w.t()).float() - want).abs().max())}
        print("lm_head", row, flush=True)
        rows.append(row)
    results["lm_head"] = rows


def bench_route_big(results, token_counts=(64, 256, 1024, 4096, 16384), dev="cuda"):
    """The router (softmax + top-10 of 128 + renormalisation) at prefill sizes: the one-warp-per-token Triton kernel
    against the compiled reference (softmax, torch.topk, the renormalisation), 48 calls a graph."""
    from qwen4exp.ops.moe import route_ref
    from qwen4exp.ops.triton_moe import route_triton

    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for tokens in token_counts:
        logits = torch.randn(tokens, 128, device=dev, generator=g).to(torch.bfloat16)
        ref_w, ref_ids = route_ref(logits, 10, True)
        row = {"tokens": tokens, "ref_us": per_call_us(lambda: route_ref(logits, 10, True), calls=48)}
        for warps in (1, 2, 4):
            w, ids = route_triton(logits, 10, True, num_warps=warps)
            row[f"warps{warps}_us"] = per_call_us(lambda: route_triton(logits, 10, True, num_warps=warps), calls=48)
            # bf16 logits tie often; the kernel takes the lowest index among equals, torch.topk any of them
            row[f"warps{warps}_ids_equal_frac"] = (ids == ref_ids).all(-1).float().mean().item()
            row[f"warps{warps}_same_sets_frac"] = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).float(
            ).mean().item()
            row[f"warps{warps}_weights_maxdiff"] = (w.float() - ref_w.float()).abs().max().item()
        print("route_big", row, flush=True)
        rows.append(row)
    results["route_big"] = rows


def bench_read_bw(results, nbytes=4 << 30, dev="cuda"):
    """The read ceiling the weight-bound kernels are measured against: a streaming Triton read (contiguous ranges per
    program, and interleaved blocks), torch's sum, and the copy (bytes read + written), against `fused_moe` at 64
    tokens (batch-64 decode, 128 experts of 640, top-10: all 1.26 GB of expert weights read), GB/s."""
    import triton
    import triton.language as tl

    from qwen4exp.ops.triton_moe import fused_moe

    @triton.jit
    def read_ranges(x_ptr, out_ptr, per_prog, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        base = x_ptr + pid.to(tl.int64) * per_prog
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(0, per_prog, BLOCK):
            acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc))

    @triton.jit
    def read_interleaved(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(pid.to(tl.int64) * BLOCK, n, step):
            acc += tl.load(x_ptr + start + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc))

    n = nbytes // 2
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = {}

    def put(name, us, moved):
        rows[name] = {"us": us, "GB_s": moved / us / 1e3}
        print(f"read_bw {name:>40}: {us:9.1f} us  {moved / us / 1e3:7.0f} GB/s", flush=True)

    out = torch.empty(sms * 64, device=dev, dtype=torch.float32)
    for waves in (1, 2, 4, 8):
        for block, warps in ((4096, 8), (8192, 8), (8192, 16)):
            progs = sms * waves
            per = n // progs // block * block
            put(f"ranges progs={progs} block={block} warps={warps}",
                per_call_us(lambda: read_ranges[(progs,)](x, out, per, BLOCK=block, num_warps=warps), 4, 10),
                progs * per * 2)
            put(f"interleaved progs={progs} block={block} warps={warps}",
                per_call_us(lambda: read_interleaved[(progs,)](x, out, n, BLOCK=block, num_warps=warps), 4, 10),
                nbytes)
    put("torch sum", per_call_us(lambda: x.sum(dtype=torch.float32), 4, 10), nbytes)
    put("copy (read + written)", per_call_us(lambda: y.copy_(x), 4, 10), 2 * nbytes)
    x = y = None  # free the 8 GB before the expert weights
    torch.cuda.empty_cache()
    E, k, hidden, inter, dt = 128, 10, 2560, 640, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = (torch.randn(E, 2 * inter, hidden, device=dev, generator=g) / hidden**0.5).to(dt)
    down = (torch.randn(E, hidden, inter, device=dev, generator=g) / inter**0.5).to(dt)
    xs = torch.randn(64, hidden, device=dev, generator=g).to(dt)
    ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(64)])
    wts = torch.softmax(torch.randn(64, k, device=dev, generator=g), -1)
    put("fused_moe T=64 (expert weights)", per_call_us(lambda: fused_moe(xs, gate_up, down, ids, wts), 16),
        (gate_up.numel() + down.numel()) * 2)
    results["read_bw"] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="hc,moe,align,route,gemv,gdn")
    a = ap.parse_args()
    results = {"device": torch.cuda.get_device_name()}
    parts = {"hc": bench_hc, "moe": bench_moe, "align": bench_align, "route": bench_route, "gemv": bench_gemv,
             "gdn": bench_gdn, "conv": bench_conv, "hc_batch": bench_hc_batch,
             "prefill_attn": bench_prefill_attn, "gemm_layouts": bench_gemm_layouts,
             "moe_tiles": bench_moe_tiles, "moe_spread": bench_moe_spread, "sum_pairs_decode": bench_sum_pairs_decode,
             "gdn_warps": bench_gdn_warps,
             "blas_backends": bench_blas_backends, "norms": bench_norms,
             "route_big": bench_route_big, "lm_head": bench_lm_head, "norm_rope": bench_norm_rope,
             "grouped_sort": bench_grouped_sort,
             "autotune_linear": bench_autotune_linear,
             "hc_autotune": bench_hc_autotune,
             "pdl": bench_pdl, "partials": bench_partials, "hc_partials": bench_hc_partials,
             "output_partials": bench_output_partials, "read_bw": bench_read_bw,
             "gemm_layouts64": lambda r: bench_gemm_layouts(r, token_counts=(64,)),
             "moe_tiles128": lambda r: bench_moe_tiles(r, tokens=128, check_tokens=(72, 128, 200))}
    for part in a.parts.split(","):
        parts[part](results)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "decode_kernels.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
