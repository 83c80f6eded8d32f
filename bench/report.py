"""Turn bench/h200_suite.py's results.json into docs/benchmarks.md and a throughput-vs-concurrency PNG."""

from __future__ import annotations

import json
import os
import sys


def _f(x, fmt="{:.1f}"):
    return fmt.format(x) if isinstance(x, (int, float)) else "n/a"


def write_report(results: dict, out_dir: str) -> str:
    ours, hf, agree = results.get("ours", {}), results.get("hf", {}), results.get("agree", {})
    env = results.get("env", {})
    lines = ["# Benchmarks", "",
             f"One {env.get('gpu', 'GPU')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {hf.get('transformers', 'n/a')}. Model: `flash-next-128e` random weights in bf16 "
             "(`load_format=\"dummy\"`); transformers runs the very same weight tensors in the same process.",
             "Produced by `python bench/h200_suite.py --out OUT` (results.json holds every raw number). Step token "
             f"budget: {ours.get('max_num_batched_tokens', 'n/a')} (the device's default for `LLM`).", ""]
    b1 = ours.get("decode_b1", {})
    p8, p32 = ours.get("prefill_8k", {}), ours.get("prefill_32k", {})
    conc = ours.get("concurrency", {})
    c64 = conc.get("64", conc.get(64, {}))
    ratio = results.get("ratio_decode_b1_vs_hf")
    lines += ["| metric | qwen4exp | target |", "|---|---|---|",
              f"| batch-1 decode (128 in / 128 out), output tok/s | {_f(ours.get('decode_b1_tok_s'))} | >= 150 |",
              f"| batch-1 decode vs transformers ({_f(hf.get('decode_b1_tok_s'), '{:.2f}')} tok/s) | "
              f"{_f(ratio)}x | >= 15x |",
              f"| batch-1 HBM roofline fraction | "
              f"{_f(100 * ours['decode_b1_roofline_fraction'] if 'decode_b1_roofline_fraction' in ours else None)}% "
              "| >= 45% |",
              f"| 64 concurrent (1k in / 256 out), output tok/s | {_f(c64.get('output_throughput'))} | >= 2000 |",
              f"| prefill 8k, tok/s | {_f(p8.get('prefill_tok_s'), '{:.0f}')} | >= 10000 |",
              f"| prefill 32k time / 8k time | "
              f"{_f(p32['ttft_s'] / p8['ttft_s'] if p32 and p8 else None, '{:.2f}')} | <= 5 |",
              f"| GPU bf16 vs CPU fp32 top-1 agreement (small, teacher forcing) | "
              f"{_f(100 * agree['top1_agreement'] if agree else None, '{:.2f}')}% | >= 99% |",
              f"| ... the CPU bf16 reference vs CPU fp32, same positions | "
              f"{_f(100 * agree['cpu_bf16_reference_top1_agreement'] if agree else None, '{:.2f}')}% | (bf16 floor) |",
              f"| ... GPU bf16 vs CPU bf16 reference | "
              f"{_f(100 * agree['gpu_vs_cpu_bf16_top1_agreement'] if agree else None, '{:.2f}')}% | |",
              f"| non-finite logits (agreement run) | {agree.get('nonfinite_logits', 'n/a')} | 0 |"]
    trained = results.get("agree_trained", {})
    for key, what in (("fp32_weights", "trained fp32 weights"), ("bf16_checkpoint", "their bf16 checkpoint")):
        r = trained.get(key)
        if r:
            lines.append(f"| ... `small` trained briefly (bench/train_small.py), {what}: GPU bf16 vs CPU fp32 "
                         f"(median top-1 probability {_f(r['median_top1_prob'], '{:.2f}')}) | "
                         f"{_f(100 * r['top1_agreement'], '{:.2f}')}% | >= 99% |")
    lines.append("")
    check = results.get("hf_check", {})
    if check:
        lines += ["## Same weights, same prompt: transformers vs qwen4exp (bf16, GPU)", "",
                  f"- prompt (128 tokens) top-1 agreement "
                  f"{_f(100 * check.get('prompt_top1_agreement', 0), '{:.1f}')}%, "
                  f"max |logprob diff| {_f(check.get('prompt_logprob_max_abs_diff'), '{:.3f}')}, mean "
                  f"{_f(check.get('prompt_logprob_mean_abs_diff'), '{:.4f}')}, non-finite in transformers "
                  f"{check.get('hf_nonfinite', 'n/a')}",
                  f"- first greedy tokens: transformers {check.get('hf_first_tokens')}, qwen4exp "
                  f"{check.get('ours_first_tokens')}", ""]
    roofline_step_ms = ours.get("decode_b1_bytes_per_step", 0) / max(ours.get("copy_bandwidth_GBs", 1), 1e-9) / 1e6
    lines += ["## Batch-1 decode", "",
              f"- median TPOT {_f(b1.get('median_tpot_ms'), '{:.2f}')} ms, "
              f"p99 ITL {_f(b1.get('p99_itl_ms'), '{:.2f}')} ms, "
              f"TTFT (128-token prompt) {_f(b1.get('median_ttft_ms'), '{:.1f}')} ms",
              f"- bytes read per step {_f(ours.get('decode_b1_bytes_per_step', 0) / 1e9, '{:.2f}')} GB; measured copy "
              f"bandwidth {_f(ours.get('copy_bandwidth_GBs'), '{:.0f}')} GB/s; roofline step "
              f"{_f(roofline_step_ms, '{:.2f}')} ms", ""]
    if conc:
        lines += ["## Throughput vs concurrency (1k-token prompts, 256 output tokens each)", "",
                  "| concurrency | output tok/s | median TTFT ms | median TPOT ms | p99 ITL ms | max ITL ms | "
                  "compiled during the run |",
                  "|---|---|---|---|---|---|---|"]
        for k in sorted(conc, key=lambda x: int(x)):
            r = conc[k]
            compiled = r.get("compiled_during_run", {})
            kernels = compiled.get("triton_kernels")
            compiled_text = (f"{len(kernels)} Triton kernels, {compiled.get('dynamo_graphs')} graphs"
                             if kernels is not None else "n/a")
            lines.append(f"| {k} | {_f(r['output_throughput'], '{:.0f}')} | {_f(r.get('median_ttft_ms'))} | "
                         f"{_f(r.get('median_tpot_ms'), '{:.2f}')} | {_f(r.get('p99_itl_ms'), '{:.2f}')} | "
                         f"{_f(r.get('max_itl_ms'), '{:.0f}')} | {compiled_text} |")
        lines += ["", "![output tok/s vs concurrency](benchmarks_concurrency.png)", ""]
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            xs = sorted(int(k) for k in conc)
            ys = [conc[str(x)]["output_throughput"] if str(x) in conc else conc[x]["output_throughput"] for x in xs]
            fig, ax = plt.subplots(figsize=(5, 3.5))
            ax.plot(xs, ys, "o-", label="qwen4exp")
            if hf.get("decode_b1_tok_s"):
                ax.plot([1], [hf["decode_b1_tok_s"]], "s", label="transformers (batch 1)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel("output tok/s")
            ax.set_title("flash-next-128e, bf16, one H200")
            ax.legend()
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, "benchmarks_concurrency.png"), dpi=120)
        except ImportError:
            lines.append("(matplotlib missing: no plot)")
    if results.get("errors"):
        lines += ["## Stages that failed", ""] + [f"- {k}: see results.json" for k in results["errors"]]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "benchmarks.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    path = sys.argv[1]
    print(write_report(json.load(open(path)), os.path.dirname(path)))
