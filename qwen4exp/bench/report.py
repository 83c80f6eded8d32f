"""docs/benchmarks.md and its concurrency plot, generated from the suite's results JSON (`qwen4exp bench suite
--stages report`). The page is a pure function of the results: tests regenerate it from docs/benchmarks_results.json
and compare, so the page cannot drift from the data."""

from __future__ import annotations

import os
import statistics

PAGE = "benchmarks.md"
PLOT = "benchmarks_concurrency.png"


def _f(x, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _pct(x, digits: int = 2) -> str:
    return _f(100 * x if isinstance(x, (int, float)) else None, f"{{:.{digits}f}}") + "%"


def _commands(results: dict, stages: list[str]) -> list[str]:
    """One line per distinct command among `stages`: the command, the commit and the stages it produced."""
    seen: dict[tuple, list[str]] = {}
    for stage in stages:
        p = results.get("stages", {}).get(stage)
        if p and stage in results:
            seen.setdefault((p.get("command"), p.get("commit")), []).append(stage)
    return [f"- `{command}` (commit {commit or 'n/a'}): {', '.join(f'`{s}`' for s in names)}"
            for (command, commit), names in seen.items()]


def _ran(results: dict, stage: str) -> str:
    """How a section's stage ran, for its intro: the command and the commit, and the GPU where it is not the one of
    the setup (the `ours` stage's)."""
    stages = results.get("stages", {})
    p = stages.get(stage, {})
    gpu, setup_gpu = p.get("env", {}).get("gpu"), stages.get("ours", {}).get("env", {}).get("gpu")
    on = f", on one {gpu}" if gpu and gpu != setup_gpu else ""
    return f"`{p.get('command', 'qwen4exp bench suite --stages ' + stage)}`, commit {p.get('commit') or 'n/a'}{on}"


def _setup(results: dict) -> list[str]:
    ours = results.get("ours", {})
    env = results.get("stages", {}).get("ours", {}).get("env", {})
    hf = results.get("hf", {})
    fla = {True: "importable", False: "missing: GDN prefill ran the torch reference"}.get(env.get("fla_chunk_kernel"),
                                                                                         "n/a")
    return [
        "## Setup", "",
        f"- One {env.get('gpu', 'GPU')} (device-to-device copy bandwidth {_f(ours.get('copy_bandwidth_GBs'), '{:.0f}')}"
        f" GB/s, bytes read + written); torch {env.get('torch', 'n/a')}, triton {env.get('triton', 'n/a')}, "
        f"transformers {hf.get('transformers', env.get('transformers', 'n/a'))}, fla-core's chunk kernel {fla}.",
        f"- Model: `flash-next-128e`, the released widths with 128 experts and an n-gram base of 2,000,000 "
        f"({_f(ours.get('params_B'))}B parameters), random bf16 weights (`load_format=\"dummy\"`, seeded). "
        "transformers' `Qwen4ExpForCausalLM` runs the very same weight tensors in the same process: its parameters "
        "point at the engine's tensors, nothing is copied.",
        "- Engine: `max_model_len` 33792, `max_num_seqs` 64, `gpu_memory_utilization` 0.92, CUDA graphs for decode "
        f"batches of 1-64, step token budget {_f(ours.get('max_num_batched_tokens'), '{:d}')} (the device's default); "
        f"startup {_f(ours.get('startup_s'))} s, graph capture and warm-up included.",
        "- Requests: random token ids (seeded), greedy, each generating its full length (`ignore_eos`); figures "
        "use vLLM's metric names (TTFT, TPOT, ITL). fla tunes its kernels in every process (the suite sets "
        "`FLA_CACHE_RESULTS=0`).", ""]


def _reproduce(results_name: str) -> list[str]:
    return [
        "## Reproduce", "",
        "```bash",
        "python -m pip install -e .",
        "qwen4exp bench suite --out out   # every stage, one H200, ~20 minutes",
        "```", "",
        "It writes `out/benchmarks_results.json` (every raw number), `out/benchmarks.md` (this page) and the plot. "
        "Stages may run in separate calls on the same `--out` (`--stages ours,hf`, then `--stages agree_trained`, "
        "...); each records its command, commit and versions. This page is generated from "
        f"[{results_name}]({results_name}): "
        f"`qwen4exp bench suite --stages report --results docs/{results_name} --out docs`.", ""]


def _results_table(results: dict) -> list[str]:
    ours, hf = results.get("ours", {}), results.get("hf", {})
    b1 = ours.get("decode_b1", {})
    p8, p32 = ours.get("prefill_8k", {}), ours.get("prefill_32k", {})
    c64 = ours.get("concurrency", {}).get("64", {})
    ratio = ours["decode_b1_tok_s"] / hf["decode_b1_tok_s"] if "decode_b1_tok_s" in ours and hf else None
    bandwidth = ours.get("copy_bandwidth_GBs")
    step_bytes = ours.get("decode_b1_bytes_per_step")
    roofline_ms = step_bytes / bandwidth / 1e6 if step_bytes and bandwidth else None
    rows = [
        ("batch-1 decode (128 in / 128 out), output tok/s", ">= 150",
         f"**{_f(ours.get('decode_b1_tok_s'))}** (median TPOT {_f(b1.get('median_tpot_ms'), '{:.2f}')} ms)", "ours"),
        (f"batch-1 decode vs transformers ({_f(hf.get('decode_b1_tok_s'), '{:.2f}')} tok/s, same weights)", ">= 15x",
         f"**{_f(ratio)}x**", "hf"),
        (f"batch-1 HBM roofline fraction ({_f(step_bytes / 1e9 if step_bytes else None, '{:.2f}')} GB a step "
         f"at {_f(bandwidth, '{:.0f}')} GB/s = {_f(roofline_ms, '{:.2f}')} ms)", ">= 45%",
         f"**{_pct(ours.get('decode_b1_roofline_fraction'), 1)}**", "ours"),
        ("64 concurrent requests (1k in / 256 out), output tok/s", ">= 2000",
         f"**{_f(c64.get('output_throughput'))}**", "ours"),
    ]
    cli = results.get("throughput_cli", {}).get("runs")
    if cli:
        rows.append(("... `qwen4exp bench throughput`, a fresh process a run", ">= 2000",
                     "**" + " / ".join(_f(r["output_throughput"]) for r in cli) + "**", "throughput_cli"))
    rows += [
        ("prefill of one 8k prompt, tok/s", ">= 10000",
         f"**{_f(p8.get('prefill_tok_s'), '{:.0f}')}** (TTFT {_f(1e3 * p8['ttft_s'] if p8 else None, '{:.0f}')} ms)",
         "ours"),
        ("prefill time, 32k prompt / 8k prompt", "<= 5",
         f"**{_f(p32['ttft_s'] / p8['ttft_s'] if p32 and p8 else None, '{:.2f}')}** "
         f"({_f(p32.get('ttft_s'), '{:.3f}')} s)", "ours"),
    ]
    trained = results.get("agree_trained", {})
    for key, what in (("fp32_weights", "trained fp32 weights"), ("bf16_checkpoint", "their bf16 checkpoint")):
        if key in trained:
            rows.append((f"GPU bf16 vs CPU fp32 top-1 agreement, `small` trained briefly, {what}", ">= 99%",
                         f"**{_pct(trained[key]['top1_agreement'])}**", "agree_trained"))
    if trained:
        nonfinite = sum(trained[k]["nonfinite_logits"] for k in ("fp32_weights", "bf16_checkpoint") if k in trained)
        nonfinite += results.get("hf_check", {}).get("hf_nonfinite", 0)
        rows.append(("non-finite logits (agreement runs, transformers' check)", "0", str(nonfinite), "agree_trained"))
    lines = ["## Results", "", "| measure | target | measured | stage |", "|---|---|---|---|"]
    lines += [f"| {m} | {t} | {v} | `{s}` |" for m, t, v, s in rows]
    return lines + ["", "Each stage's command:", ""] + _commands(
        results, ["ours", "hf", "throughput_cli", "agree_trained"]) + [""]


def _concurrency(results: dict) -> list[str]:
    conc = results.get("ours", {}).get("concurrency")
    if not conc:
        return []
    lines = ["## Throughput vs concurrency", "",
             "1k-token prompts, 256 output tokens each, all submitted at once (stage `ours`).", "",
             "| concurrency | output tok/s | median TTFT ms | median TPOT ms | median ITL ms | p99 ITL ms | max ITL ms "
             "| compiled during the run |", "|---|---|---|---|---|---|---|---|"]
    for k in sorted(conc, key=int):
        r = conc[k]
        compiled = r.get("compiled_during_run", {})
        kernels, graphs = compiled.get("triton_kernels"), compiled.get("dynamo_graphs")
        what = ("nothing" if not kernels and not graphs else f"{len(kernels)} Triton kernels, {graphs} graphs") \
            if kernels is not None else "n/a"
        lines.append(f"| {k} | {_f(r['output_throughput'], '{:.0f}')} | {_f(r.get('median_ttft_ms'), '{:.0f}')} | "
                     f"{_f(r.get('median_tpot_ms'), '{:.2f}')} | {_f(r.get('median_itl_ms'))} | "
                     f"{_f(r.get('p99_itl_ms'))} | {_f(r.get('max_itl_ms'), '{:.0f}')} | {what} |")
    return lines + ["", f"![output tok/s vs concurrency]({PLOT})", ""]


def _same_weights(results: dict) -> list[str]:
    check, hf = results.get("hf_check"), results.get("hf", {})
    if not check:
        return []
    same = check.get("hf_first_tokens") == check.get("ours_first_tokens")
    return ["## transformers and qwen4exp on the same weights", "",
            f"On the 128-token prompt of the batch-1 run both pick the same top-1 token at "
            f"{_pct(check.get('prompt_top1_agreement'), 1)} of positions (|logprob difference| mean "
            f"{_f(check.get('prompt_logprob_mean_abs_diff'), '{:.3f}')}, max "
            f"{_f(check.get('prompt_logprob_max_abs_diff'), '{:.3f}')}: bf16 rounding in a 48-layer model with random "
            f"weights), and {'the same' if same else 'different'} first four greedy tokens "
            f"({check.get('ours_first_tokens')}). transformers {hf.get('transformers', 'n/a')} ran its experts with "
            f"`{hf.get('experts_implementation')}`; its decode speed is {hf.get('new_tokens')} tokens over the time "
            f"`generate` takes for {_f(hf.get('new_tokens', 0) + 1, '{:d}')} new tokens minus its time for one.", ""]


def _agreement(results: dict) -> list[str]:
    trained = results.get("agree_trained")
    if not trained or "fp32_weights" not in trained:
        return []
    t, a, b = trained["training"], trained["fp32_weights"], trained.get("bf16_checkpoint", {})
    rows = [("GPU bf16 vs CPU fp32", "top1_agreement", _pct),
            ("CPU bf16 vs CPU fp32 (bf16 arithmetic alone)", "cpu_bf16_reference_top1_agreement", _pct),
            ("GPU bf16 vs CPU bf16", "gpu_vs_cpu_bf16_top1_agreement", _pct),
            ("GPU bf16 vs CPU fp32, logits rounded to bf16", "top1_agreement_logits_rounded_to_bf16", _pct),
            ("the reference's median top-1 probability", "median_top1_prob", lambda x: _f(x, "{:.2f}")),
            ("largest reference top-2 logit gap where the GPU's top-1 differs",
             "ref_top2_gap_max_where_top1_differs", lambda x: _f(x, "{:.3f}")),
            ("non-finite logits", "nonfinite_logits", str)]
    lines = ["## Agreement with the fp32 reference", "",
             f"`small` trained with transformers for {_f(t['train_s'], '{:.0f}')} s on the GPU ({t['steps']} steps of "
             f"{t['batch']} x {t['seq_len']} tokens of the Python standard library, loss "
             f"{_f(t['first_loss'], '{:.2f}')} -> {_f(t['last_loss_mean10'], '{:.2f}')}), then teacher forcing over "
             f"{a['positions']} held-out "
             f"positions ({trained.get('spans', 'n/a')} spans of {trained.get('span_len', 'n/a')} tokens, "
             f"{a['graph_decode_positions']} of them through CUDA-graph decode, the rest prefilled). The CPU fp32 "
             "engine is the reference.", "",
             "| top-1 agreement | trained fp32 weights | their bf16 checkpoint |", "|---|---|---|"]
    lines += [f"| {what} | {fmt(a.get(key))} | {fmt(b.get(key))} |" for what, key, fmt in rows]
    return lines + [""]


def _table_on_host(results: dict) -> list[str]:
    data = results.get("table_on_host")
    if not data or not data.get("runs"):
        return []
    runs = data["runs"]
    host = [r for r in runs if r["table_on_host"]]
    gpu = [r for r in runs if not r["table_on_host"]]
    if not host or not gpu:
        return []

    def med(rs, key):
        return statistics.median(r[key] for r in rs)

    t = host[0]
    lines = ["## The released-size n-gram table in host memory", "",
             f"`flash-next-128e` with the released n-gram base {data['ngram_base']:,}: one PLE table of "
             f"{t['table_rows']:,} rows x 160 in fp8 (e4m3, one scale) = {_f(t['table_GB'])} GB, in page-locked host "
             f"memory (`--ple-table-device cpu`) or in GPU memory. Engines built one after another in one process "
             f"({', '.join(data['order'])}); each figure is the median over the engines of its placement "
             f"({_ran(results, 'table_on_host')}).", "",
             "| measure | table in host memory | table in GPU memory | host / GPU |", "|---|---|---|---|"]
    for what, key, fmt, ratio in (("batch-1 decode (128 in / 128 out), tok/s", "decode_b1_tok_s", "{:.1f}", "{:.3f}"),
                                  ("64 concurrent (1k in / 256 out), output tok/s", "concurrency_64_tok_s", "{:.0f}",
                                   "{:.3f}"),
                                  ("weights on the GPU, GB", "gpu_weights_GB", "{:.1f}", None),
                                  ("KV cache pages (16 tokens)", "cache_pages", "{:.0f}", None)):
        h, g = med(host, key), med(gpu, key)
        lines.append(f"| {what} | {_f(h, fmt)} | {_f(g, fmt)} | {_f(h / g, ratio) if ratio else ''} |")
    for tokens in ("1", "64", "8192"):
        h = statistics.median(r["gather_us"][tokens] for r in host)
        g = statistics.median(r["gather_us"][tokens] for r in gpu)
        lines.append(f"| one layer's row gather, {tokens} tokens x 16 rows, us | {_f(h)} | {_f(g)} | "
                     f"{_f(h / g, '{:.2f}')} |")
    return lines + [""]


def _note(data: dict) -> str:
    """A stage's `note` (how a figure was read from its runs), when it has one, for the end of its intro."""
    return f" Concurrent figures: {data['note']}." if data.get("note") else ""


def _fp8(results: dict) -> list[str]:
    """The fp8 stages' figures, where the results hold them."""
    lines = []
    data = results.get("flash_next")
    if data and "decode_b1_tok_s" in data:
        lines += ["## The released shape in fp8 on one GPU", "",
                  f"`{data['preset']}` (512 experts, n-gram base 20,000,000) with block-scaled fp8 weights built in "
                  f"place ({_f(data['gpu_weights_GiB'])} GiB on the GPU), the fp8 n-gram table in page-locked host "
                  f"memory, max_model_len {data['engine']['max_model_len']}, max_num_seqs "
                  f"{data['engine']['max_num_seqs']} ({_ran(results, 'flash_next')})." + _note(data), "",
                  "| measure | target | measured |", "|---|---|---|",
                  f"| start-up (weights, graphs, warm-up), s | <= 300 | **{_f(data['startup_s'])}** |",
                  f"| batch-1 decode (128 in / 128 out), tok/s | >= 200 | **{_f(data['decode_b1_tok_s'])}** |",
                  f"| 32 concurrent (1k in / 256 out), output tok/s | >= 1200 | "
                  f"**{_f(data['concurrency_32_tok_s'], '{:.0f}')}** |",
                  f"| prefill of one 8k prompt, tok/s | >= 10000 | **{_f(data['prefill_8k_tok_s'], '{:.0f}')}** |",
                  f"| sequences of max_model_len the cache holds at once | | "
                  f"{data['max_concurrent_at_max_model_len']} ({data['cache_pages']} pages of {data['page_size']}) |",
                  ""]
    data = results.get("fp8_128e")
    if data and "fp8" in data and "bf16" in data:
        lines += ["## fp8 against bf16 on flash-next-128e", "",
                  f"One engine after the other in one process ({_ran(results, 'fp8_128e')})." + _note(data), "",
                  "| measure | bf16 | fp8 | fp8 / bf16 | target |", "|---|---|---|---|---|"]
        for what, key, fmt, target in (("batch-1 decode, tok/s", "decode_b1_tok_s", "{:.1f}", ">= 1.3"),
                                       ("64 concurrent (1k in / 256 out), output tok/s", "concurrency_64_tok_s",
                                        "{:.0f}", ">= 1.3"),
                                       ("prefill of one 8k prompt, tok/s", "prefill_8k_tok_s", "{:.0f}", ">= 1"),
                                       ("weights on the GPU, GiB", "gpu_weights_GiB", "{:.1f}", "")):
            b, q = data["bf16"].get(key), data["fp8"].get(key)
            ratio = _f(q / b, "**{:.2f}**") if isinstance(b, (int, float)) and isinstance(q, (int, float)) else ""
            lines.append(f"| {what} | {_f(b, fmt)} | {_f(q, fmt)} | {ratio} | {target} |")
        lines += [""]
    data = results.get("agree_fp8")
    if data:
        fb, gc = data["fp8_vs_bf16"], data["gpu_fp8_vs_cpu_fp8"]
        lines += ["## fp8 fidelity", "",
                  f"`small` trained briefly, quantized to fp8 on load; teacher forcing over {fb['positions']} "
                  f"held-out positions ({_ran(results, 'agree_fp8')}).", "",
                  "| measure | target | measured |", "|---|---|---|",
                  f"| fp8 vs bf16 top-1 agreement | >= 98% | **{_pct(fb['fp8_vs_bf16_top1_agreement'])}** |",
                  f"| held-out perplexity, fp8 / bf16 | <= 1.03 | **{_f(fb['perplexity_fp8_over_bf16'], '{:.3f}')}** "
                  f"({_f(fb['fp8_perplexity'], '{:.2f}')} / {_f(fb['bf16_perplexity'], '{:.2f}')}) |",
                  f"| GPU fp8 vs CPU fp8 reference top-1 agreement | >= 99% | **{_pct(gc['top1_agreement'])}** |",
                  f"| ... the CPU's bf16 engine (fp8 weights) vs the same reference: bf16 arithmetic alone | | "
                  f"{_pct(gc['cpu_bf16_reference_top1_agreement'])} |",
                  f"| non-finite logits | 0 | {fb['fp8_nonfinite'] + gc['nonfinite_logits']} |",
                  ""]
    return lines


def _spec_decode(results: dict) -> list[str]:
    """The trained model's figures, and the dummy-weight step costs and projection once spec_dummy has run too."""
    data = results.get("spec_decode", {})
    trained, dummy = data.get("trained"), data.get("dummy")
    if not trained:
        return []
    if "projection" not in data:
        dummy = None
    t, tk, dk = trained["training"], trained["k"], dummy["k"] if dummy else {}
    ks = sorted(set(tk) | set(dk), key=int)
    stages = (trained.get("stage", "spec_decode"), dummy.get("stage", "spec_decode") if dummy else None)
    ran = _ran(results, stages[0]) if stages[0] == stages[1] or not dummy else \
        f"`small`: {_ran(results, stages[0])}; `{dummy['preset']}`: {_ran(results, stages[1])}"

    def row(what: str, target: str, part: dict, key: str, fmt: str, base: str | None = None, bold: str = "") -> str:
        """One cell per k: part[k][key], and its ratio to part["0"][base]'s."""
        cells = []
        for k in ks:
            x = part.get(k, {}).get(key)
            cell = "" if x is None else " / ".join(_pct(p, 0) for p in x) if isinstance(x, list) else _f(x, fmt)
            b = part["0"].get(base) if base and k != "0" and x is not None else None
            cells.append((f"**{cell}**" if k == bold else cell) + (f" ({_f(x / b, '{:.2f}')}x)" if b else ""))
        return "|" + "".join(f" {c} |" if c else " |" for c in (what, target, *cells))

    text = (f"`small` trained with its MTP layer for {_f(t['train_s'], '{:.0f}')} s ({t['steps']} steps, loss "
            f"{_f(t['first_loss'], '{:.2f}')} -> {_f(t['last_loss_mean10'], '{:.2f}')}, MTP loss "
            f"{_f(t.get('mtp_last_loss_mean10'), '{:.2f}')}), batch-1 greedy decode of {trained['prompts']} held-out "
            f"code prompts, {trained['prompt_len']} in / {trained['output_len']} out")
    rows = [row("`small` trained: median TPOT, ms", "", tk, "median_tpot_ms", "{:.2f}"),
            row("... draft tokens accepted at each position", "", tk, "per_position_acceptance", ""),
            row("... tokens per step (acceptance length)", "", tk, "acceptance_length", "{:.2f}")]
    if any("chained_share" in x for x in tk.values()):  # results without it leave the row out
        rows.append(row("... steps chained (launched before the step before is read)", "", tk, "chained_share",
                        "{:.0%}"))
    rows.append(row("... speedup over k = 0", ">= 1.4x at k = 1", tk, "speedup_vs_k0", "{:.2f}x", bold="1"))
    if dummy:
        projected = {"0": {"tok_s": data["projection"]["k0_tok_s"]}} | data["projection"]["k"]
        text += (f". `{dummy['preset']}` on random bf16 weights: batch 1 ({dummy['input_len']} in / "
                 f"{dummy['output_len']} out), {dummy['concurrency']} concurrent ({dummy['concurrent_input_len']} in "
                 f"/ {dummy['concurrent_output_len']} out). Random weights' drafts are almost never accepted, but a "
                 "step computes all 1 + k rows whatever is accepted: its time is TPOT x tokens per step, and the "
                 "projection is the trained model's tokens per step over that time")
        rows += [row(f"`{dummy['preset']}`: batch-1 TPOT, ms", "", dk, "median_tpot_ms", "{:.2f}"),
                 row("... step time (TPOT x tokens per step) / decode step", "<= 1.15 at k = 1", dk, "step_over_k0",
                     "{:.3f}", bold="1"),
                 row("... batch-1 tok/s, a projection at the trained model's acceptance", "", projected, "tok_s",
                     "{:.1f}", base="tok_s"),
                 row(f"... {dummy['concurrency']} concurrent, output tok/s", "", dk, "concurrent_tok_s", "{:.0f}",
                     base="concurrent_tok_s")]
    return ["## Speculative decoding (MTP)", "", f"{text} ({ran}).", "",
            "| measure | target | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---|---|" + "---|" * len(ks),
            *rows, ""]


def _prefix_cache(results: dict) -> list[str]:
    data = results.get("prefix_cache")
    if not data or "uncached" not in data:
        return []
    on, off = data["cached"], data["uncached"]
    per_turn = {what: " / ".join(_f(x["median_ttft_ms"], "{:.0f}") for x in turns) for what, turns in
                (("on", on), ("off", off))}
    return ["## Prefix caching: multi-turn chat", "",
            f"`{data['preset']}` on random bf16 weights: {data['num_conversations']} conversations sharing a "
            f"{data['system_len']}-token system prompt, {data['num_turns']} turns of {data['turn_len']}-token messages "
            f"and {data['output_len']}-token replies, every conversation's turn at once; the same conversations with "
            f"the prefix cache on, then off, on one engine ({_ran(results, 'prefix_cache')}).", "",
            "| measure | target | measured |", "|---|---|---|",
            f"| turn-{len(on)} median TTFT, off / on | >= 5x | **{_f(data['last_turn_ttft_speedup'], '{:.1f}x')}** "
            f"({_f(off[-1]['median_ttft_ms'], '{:.0f}')} / {_f(on[-1]['median_ttft_ms'], '{:.0f}')} ms) |",
            f"| single-request decode speed, on / off | 0.98 - 1.02 | "
            f"**{_f(data['decode_cached_over_uncached'], '{:.3f}')}** ({_f(data['decode_cached'])} / "
            f"{_f(data['decode_uncached'])} tok/s) |",
            *(f"| median TTFT of each turn, {what}, ms | | {ttfts} |" for what, ttfts in per_turn.items()),
            f"| whole workload, off / on; prompt tokens found cached | | {_f(data['total_speedup'], '{:.2f}x')}; "
            f"{_pct(data['hit_rate'], 1)} |", ""]


def _vision(results: dict) -> list[str]:
    data = results.get("vision")
    if not data or "text_same_len" not in data:
        return []
    v = data["vision_config"]
    lines = ["## Images", "",
             f"`{data['preset']}` with a vision tower of {v['depth']} layers, {v['hidden_size']} wide, random bf16 "
             f"weights. One {' x '.join(map(str, data['image_size']))} image: {data['image_tokens']} image tokens "
             f"(grid {' x '.join(map(str, data['grid_thw']))}), preprocessed on the host in "
             f"{_f(data['preprocess_ms'])} ms and encoded in {_f(data['encode_ms'])} ms (medians of "
             f"{data['encode_runs']}). Each request alone, {data['output_len']} tokens out, from an empty prefix "
             f"cache, medians of {data['runs']} ({_ran(results, 'vision')}).", "",
             "| request | prompt tokens | TTFT ms | TPOT ms |", "|---|---|---|---|"]
    for key, what in (("image", "text with the image"), ("text", "the same text"),
                      ("text_same_len", "text of as many tokens as with the image")):
        r = data[key]
        lines.append(f"| {what} | {r['prompt_tokens']} | {_f(r['ttft_ms'])} | {_f(r['tpot_ms'], '{:.2f}')} |")
    return lines + [""]


def _structured(results: dict) -> list[str]:
    data = results.get("structured")
    if not data or "constrained_over_free" not in data:
        return []
    runs = data["runs"]
    n = max(r["num_structured"] for r in runs)
    return ["## Structured output", "",
            f"`{data['preset']}` on random bf16 weights with the repository's tokenizer: {data['num_prompts']} "
            f"requests at once ({data['input_len']} in / {data['output_len']} out), all free or {n} of them under a "
            f"JSON-records grammar (bench/offline.py), alternating ({_ran(results, 'structured')}).", "",
            "| measure | target | measured |", "|---|---|---|",
            f"| output tok/s, {n} constrained / all free (medians) | >= 0.90 | "
            f"**{_f(data['constrained_over_free'], '{:.3f}')}** ({_f(data['constrained_tok_s'], '{:.0f}')} / "
            f"{_f(data['free_tok_s'], '{:.0f}')}) |",
            "| each run in turn (free, constrained, ...), output tok/s | | "
            + " / ".join(_f(r["output_throughput"], "{:.0f}") for r in runs) + " |", ""]


def _known_limits(results: dict) -> list[str]:
    lines = ["## Known limits", ""]
    conc = results.get("ours", {}).get("concurrency", {})
    c64 = conc.get("64")
    if c64 and c64["output_throughput"] < 2000:
        lines.append(f"- 64 concurrent requests reach {_f(c64['output_throughput'])} output tok/s, "
                     f"{_pct(1 - c64['output_throughput'] / 2000, 1)} short of 2000 (a run of "
                     f"{_f(c64['duration_s'], '{:.3f}')} s against 8.192 s); machines of the same type differ by "
                     "about 2% on this run.")
    large = [k for k in sorted(conc, key=int) if conc[k].get("max_itl_ms", 0) > 10 * conc[k].get("median_itl_ms", 1)]
    if large:
        lines.append(f"- The max ITL at concurrency {' and '.join(large)} is a prefill step of up to "
                     f"{results['ours'].get('max_num_batched_tokens')} tokens, run eagerly, which the decodes already "
                     "running wait for.")
    lines.append("- Random weights: speed does not depend on the values except through routing (experts are hit "
                 "about uniformly here) and QSA's block choice. Top-1 agreement does: with random weights the "
                 "predictions are near-uniform and bf16 rounding flips the argmax at near-ties, so agreement is "
                 "measured on a trained model.")
    trained = results.get("agree_trained", {})
    if "fp32_weights" in trained:
        floor = [trained[k]["cpu_bf16_reference_top1_agreement"] for k in ("fp32_weights", "bf16_checkpoint")
                 if k in trained]
        lines.append(f"- Even on the trained model, bf16 arithmetic itself (the CPU's bf16 engine against its fp32 "
                     f"engine) agrees with fp32 at {' / '.join(_pct(x) for x in floor)}: 99% is close to what any "
                     "bf16 engine reaches on it.")
    stages = results.get("stages", {})
    host_commit = stages.get("table_on_host", {}).get("commit")
    if host_commit and host_commit != stages.get("ours", {}).get("commit"):
        lines.append(f"- The host-table figures were measured at commit {host_commit}, not the commit of the "
                     "others: compare its two placements with each other.")
    runs = results.get("table_on_host", {}).get("runs", [])
    host = [r["gather_us"]["8192"] for r in runs if r["table_on_host"]]
    gpu = [r["gather_us"]["8192"] for r in runs if not r["table_on_host"]]
    if host and gpu:
        lines.append(f"- The host table's gather of 8192 tokens' rows crosses PCIe in random 160-byte reads, "
                     f"{_f(statistics.median(host) / statistics.median(gpu), '{:.0f}')}x slower than from HBM; it "
                     "runs on a side stream during the layers before the PLE layer, which hide it at these step "
                     "sizes.")
    f8 = results.get("fp8_128e", {})
    if "fp8" in f8 and "bf16" in f8:
        ratio = f8["fp8"]["gpu_weights_GiB"] / f8["bf16"]["gpu_weights_GiB"]
        lines.append(f"- fp8 decodes at {_f(f8['decode_b1_tok_s_fp8_over_bf16'], '{:.2f}')}x bf16's speed at batch "
                     f"1 although its weights take {_f(ratio, '{:.2f}')}x the bytes: the batch-1 step is bound by "
                     "more than its weight reads, and the released shape's batch-1 decode misses 200 tok/s with it.")
    for stage in results.get("errors", {}):
        lines.append(f"- Stage `{stage}` failed in its last run: see `errors` in the results JSON.")
    return lines


def write_plot(results: dict, out_dir: str) -> bool:
    """The concurrency sweep's output tok/s (and transformers at batch 1) as a PNG; False without data."""
    conc = results.get("ours", {}).get("concurrency")
    if not conc:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(int(k) for k in conc)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(xs, [conc[str(x)]["output_throughput"] for x in xs], "o-", label="qwen4exp")
    hf = results.get("hf", {})
    if hf.get("decode_b1_tok_s"):
        ax.plot([1], [hf["decode_b1_tok_s"]], "s", label="transformers (batch 1)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s")
    gpu = results.get("stages", {}).get("ours", {}).get("env", {}).get("gpu", "one GPU")
    ax.set_title(f"flash-next-128e, bf16, {gpu}")
    ax.legend()
    fig.tight_layout()
    # no metadata: the file depends on the results only
    fig.savefig(os.path.join(out_dir, PLOT), dpi=120, metadata={"Software": None})
    plt.close(fig)
    return True


def render(results: dict, results_name: str) -> str:
    """The page's markdown."""
    lines = ["# Benchmarks", "",
             "<!-- generated by `qwen4exp bench suite --stages report` (qwen4exp/bench/report.py) from "
             f"{results_name}; edit those, not this file -->", ""]
    for section in (_setup(results), _reproduce(results_name), _results_table(results), _concurrency(results),
                    _same_weights(results), _agreement(results), _table_on_host(results), _fp8(results),
                    _spec_decode(results), _prefix_cache(results), _vision(results), _structured(results),
                    _known_limits(results)):
        lines += section
    return "\n".join(lines).rstrip("\n") + "\n"


def write_report(results: dict, out_dir: str, results_name: str) -> str:
    """Writes out_dir/benchmarks.md and the plot; returns the markdown."""
    text = render(results, results_name)
    with open(os.path.join(out_dir, PAGE), "w") as f:
        f.write(text)
    write_plot(results, out_dir)
    return text
