"""One-process H200 benchmark: qwen4exp vs transformers on the same random weights, plus the HBM roofline.

    python bench/h200_suite.py --stages agree,ours,hf,report --out OUT_DIR

Stages (each writes its results into OUT_DIR/results.json as soon as it finishes):
  agree   GPU (bf16, fast paths + CUDA graphs) vs CPU reference (fp32) on the `small` preset, teacher forcing.
  agree_trained  the same on `small` trained briefly with transformers (bench/train_small.py), on held-out text.
  ours    flash-next-128e (bf16, load_format=dummy): batch-1 decode, prefill 8k / 32k, throughput vs concurrency.
  hf      transformers' Qwen4ExpForCausalLM holding the very same weight tensors (no copy): batch-1 decode.
  report  docs/benchmarks.md table + PNG plot from results.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qwen4exp.bench.compile_log import CompileLog  # noqa: E402
from qwen4exp.config import EngineConfig, load_model_config  # noqa: E402
from qwen4exp.engine.engine import LLMEngine  # noqa: E402
from qwen4exp.model.merged_linear import named_checkpoint_tensors  # noqa: E402
from qwen4exp.ops.gated_delta import fla_chunk  # noqa: E402
from qwen4exp.weights.random_checkpoint import preset_config  # noqa: E402


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def preset(name: str):
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(preset_config(name, eos_token_id=0, dtype="bfloat16"), f)
    return load_model_config(d)


def copy_bandwidth(device, nbytes=4 << 30, iters=10) -> float:
    """Device-to-device copy, bytes read + written per second (median)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(iters + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    times = sorted(times[2:])
    return 2 * nbytes / times[len(times) // 2]


def decode_bytes(model, ctx_len: int) -> int:
    """Bytes a batch-1 decode step must read: every weight except unused experts, one embedding row and the
    n-gram rows, plus recurrent/conv states (read and written) and the attention context."""
    c = model.config
    total = 0
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        if ".experts." in name:
            total += b * c.num_experts_per_tok // c.num_experts
        elif "embed_tokens" in name and not c.tie_word_embeddings:
            total += p.shape[1] * p.element_size()
        elif "ngram_embedding" in name:
            total += c.ngram_heads * p.shape[1] * p.element_size()
        else:
            total += b
    n_lin = c.layer_types.count("linear_attention")
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.gdn_conv_dim * (c.linear_conv_kernel_dim - 1) * 2
    total += 2 * n_lin * (state + conv)
    n_attn = c.num_hidden_layers - n_lin
    kv_tok = 2 * c.num_key_value_heads * c.head_dim * 2
    attended = min(ctx_len, (c.indexer_budget + c.indexer_compress_ratio - 1) if c.qsa else ctx_len)
    total += n_attn * attended * kv_tok
    return total


def top1_agreement(cfg, weights: dict, seqs: list[list[int]], device, prefill: int = 256) -> dict:
    """GPU bf16 (eager prefill of the first `prefill` tokens, then one token per step: CUDA-graph decode) against the
    CPU fp32 reference on the same weights, top-1 under teacher forcing at every position of every sequence."""
    from qwen4exp.engine.runner import RequestChunk

    def engine(dtype, dev, w, **kw):
        # a small step budget: the GPU engine's warm-up compiles prefill shapes up to it, and the longest step here
        # is one whole sequence on the CPU
        ecfg = EngineConfig(max_model_len=1024, page_size=16, max_num_seqs=8, max_num_batched_tokens=1024, **kw)
        return LLMEngine(None, ecfg, dtype=dtype, device=dev, model_config=cfg, tokenizer=None,
                         weights=iter(w.items()))

    cpu = engine("float32", "cpu", weights, num_pages=300)
    gpu = engine("bfloat16", device, weights, num_pages=200, cuda_graph_sizes=[1, 2, 4])
    # the bf16 engine on the CPU: how close bf16 arithmetic itself gets to fp32 on this model
    cpu16 = engine("bfloat16", "cpu", weights, num_pages=300)
    same = total = same16 = same_gpu16 = 0
    # the same argmaxes with the logits rounded to bf16 (transformers' logits, and ours before they were fp32), and
    # with the reference's own logits rounded: how much of the disagreement is that last rounding
    same_r = same16_r = ref_r = 0
    nonfinite = 0
    # the reference's top-2 logit gap everywhere, where the GPU's top-1 differs, its top-1 probability and logit
    gaps, differ, top1_probs, top1_logits = [], [], [], []
    for seq in seqs:
        pages_needed = -(-len(seq) // 16)
        ref = cpu.runner.execute([RequestChunk(seq, 0, [], cpu.cache.pages.allocate(pages_needed),
                                               cpu.cache.slots.allocate(1)[0], 0)]).float()
        ref16 = cpu16.runner.execute([RequestChunk(seq, 0, [], cpu16.cache.pages.allocate(pages_needed),
                                                   cpu16.cache.slots.allocate(1)[0], 0)]).float()
        same16 += int((ref16.argmax(-1) == ref.argmax(-1)).sum())
        same16_r += int((ref16.bfloat16().argmax(-1) == ref.argmax(-1)).sum())
        ref_r += int((ref.bfloat16().argmax(-1) == ref.argmax(-1)).sum())
        pages, slot = gpu.cache.pages.allocate(pages_needed), gpu.cache.slots.allocate(1)[0]
        rows = [gpu.runner.execute([RequestChunk(seq[:prefill], 0, [], pages, slot, 0)])]
        for p in range(prefill, len(seq)):  # one token per step: the CUDA-graph decode path
            # a copy: a graph step's logits are a view of its output buffer, which the next replay overwrites
            rows.append(gpu.runner.execute([RequestChunk([seq[p]], p, seq[:p], pages, slot, 0)]).clone())
        out = torch.cat(rows).float().cpu()
        nonfinite += int((~torch.isfinite(out)).sum())
        same += int((out.argmax(-1) == ref.argmax(-1)).sum())
        same_r += int((out.bfloat16().argmax(-1) == ref.argmax(-1)).sum())
        top2 = ref.topk(2, -1).values
        gaps.append(top2[:, 0] - top2[:, 1])
        differ.append(out.argmax(-1) != ref.argmax(-1))
        top1_probs.append(torch.softmax(ref, -1).max(-1).values)
        top1_logits.append(top2[:, 0])
        same_gpu16 += int((out.argmax(-1) == ref16.argmax(-1)).sum())
        total += len(seq)
    gaps, differ, top1_probs, top1_logits = map(torch.cat, (gaps, differ, top1_probs, top1_logits))
    del cpu, gpu, cpu16
    return {"positions": total, "top1_agreement": same / total,
            "cpu_bf16_reference_top1_agreement": same16 / total,
            "gpu_vs_cpu_bf16_top1_agreement": same_gpu16 / total,
            "top1_agreement_logits_rounded_to_bf16": same_r / total,
            "cpu_bf16_reference_top1_agreement_logits_rounded_to_bf16": same16_r / total,
            "reference_logits_rounded_to_bf16_top1_agreement": ref_r / total,
            "median_top1_prob": float(top1_probs.median()),
            "ref_top1_logit_median": float(top1_logits.median()),
            "ref_top2_gap_median": float(gaps.median()),
            "ref_top2_gap_max_where_top1_differs": float(gaps[differ].max()) if differ.any() else 0.0,
            "nonfinite_logits": nonfinite, "graph_decode_positions": len(seqs) * (len(seqs[0]) - prefill)}


def stage_agree(results, device):
    """Random `small` weights, random tokens: GPU bf16 (eager prefill + graph decode) vs CPU fp32 reference."""
    cfg = preset("small")
    torch.manual_seed(0)
    dummy = LLMEngine(None, EngineConfig(max_model_len=1024, num_pages=80, page_size=16, max_num_seqs=1),
                      dtype="float32", device="cpu", load_format="dummy", model_config=cfg, tokenizer=None)
    weights = {t.name: t.tensor for t in named_checkpoint_tensors(dummy.model)}
    del dummy
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(10, cfg.vocab_size, (512,), generator=gen).tolist() for _ in range(3)]
    results["agree"] = {"preset": "small"} | top1_agreement(cfg, weights, seqs, device)
    log("agree", results["agree"])


def trained_agreement(device, steps: int, seconds: float | None = None, batch: int = 32, seq_len: int = 512,
                      spans: int = 6, span_len: int = 512, corpus_chars: int = 12_000_000) -> dict:
    """`small` trained with transformers on the machine's Python standard library (bench/train_small.py), then bf16
    on `device` (the GPU, or the CPU's bf16 engine) vs CPU fp32 on `spans` spans of held-out files, teacher forcing.
    The reference runs once on the trained fp32 weights and once on the bf16 checkpoint they round to (the form a
    model is released in)."""
    from train_small import train

    from qwen4exp.config import ModelConfig

    hf, held, eos, record = train(device, steps, batch=batch, seq_len=seq_len, seconds=seconds,
                                  corpus_chars=corpus_chars, log=log)
    cfg = ModelConfig.from_hf(hf.config)
    weights = {n: t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu()
               for n, t in hf.state_dict().items()}
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seqs = [held[i * 4096: i * 4096 + span_len] for i in range(spans)]  # spans of held-out files, 4096 tokens apart
    r = {"preset": "small", "device": str(device), "training": record}
    r["fp32_weights"] = top1_agreement(cfg, weights, seqs, device, prefill=span_len // 2)
    log("trained model, fp32 weights", r["fp32_weights"])
    rounded = {n: t.to(torch.bfloat16).float() if t.is_floating_point() else t for n, t in weights.items()}
    r["bf16_checkpoint"] = top1_agreement(cfg, rounded, seqs, device, prefill=span_len // 2)
    log("trained model, bf16 checkpoint", r["bf16_checkpoint"])
    return r


def stage_agree_trained(results, device, steps: int = 3000, seconds: float | None = 150,
                        corpus_chars: int = 12_000_000):
    """`trained_agreement` on the GPU: 32 x 512-token training steps for `seconds`."""
    results["agree_trained"] = trained_agreement(device, steps, seconds, corpus_chars=corpus_chars)


def stage_ours(results, device, quick=False):
    from qwen4exp.bench.offline import latency, prefill, throughput

    cfg = preset("flash-next-128e")
    # the step budget is the device's default for LLM (16384 on an H200), as a user's engine gets it
    ecfg = EngineConfig(max_model_len=33 * 1024, max_num_seqs=64,
                        gpu_memory_utilization=0.92, cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 48, 64])
    t0 = time.perf_counter()
    engine = LLMEngine(None, ecfg, dtype="bfloat16", device=device, load_format="dummy", model_config=cfg,
                       tokenizer=None)
    log(f"engine ready in {time.perf_counter() - t0:.1f}s; cache {engine.cache.pages.num_usable} pages")
    r = results.setdefault("ours", {})
    r["startup_s"] = time.perf_counter() - t0
    r["max_num_batched_tokens"] = engine.config.max_num_batched_tokens
    r["params_B"] = sum(p.numel() for p in engine.model.parameters()) / 1e9
    bw = copy_bandwidth(device)
    r["copy_bandwidth_GBs"] = bw / 1e9
    lat = latency(engine, 1, 128, 128 if not quick else 32, iters=3)
    r["decode_b1"] = lat
    step = lat["median_tpot_ms"] / 1000
    nbytes = decode_bytes(engine.model, 128 + 64)
    r["decode_b1_bytes_per_step"] = nbytes
    r["decode_b1_roofline_fraction"] = nbytes / bw / step
    r["decode_b1_tok_s"] = 1 / step
    log(f"decode b1: {1 / step:.1f} tok/s, TPOT {step * 1e3:.2f} ms, roofline {r['decode_b1_roofline_fraction']:.2%}")
    save(results)
    r["prefill_8k"] = prefill(engine, 8192, iters=2)
    log("prefill 8k", r["prefill_8k"])
    save(results)
    if not quick:
        r["prefill_32k"] = prefill(engine, 32768, iters=1)
        log("prefill 32k", r["prefill_32k"])
        save(results)
        sweep = {}
        for conc in (1, 8, 32, 64):
            with CompileLog() as cl:
                sweep[conc] = throughput(engine, conc, 1024, 256)
            # compilations during the run (a step shape the warm-up missed) are stalls of 0.3-7 s
            sweep[conc]["compiled_during_run"] = {"dynamo_graphs": cl.dynamo_graphs,
                                                  "triton_kernels": [e["kernel"] for e in cl.events],
                                                  "triton_seconds": sum(e["s"] for e in cl.events)}
            log(f"concurrency {conc}: {sweep[conc]['output_throughput']:.0f} output tok/s, max ITL "
                f"{sweep[conc]['max_itl_ms']:.0f} ms, compiled {sweep[conc]['compiled_during_run']}")
            r["concurrency"] = sweep
            save(results)
    return engine


def stage_hf(results, engine, new_tokens=16, preset_name="flash-next-128e"):
    """transformers on the same weights: build on meta, then point every parameter at the engine's tensor."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    cfg_dict = preset_config(preset_name, eos_token_id=0, dtype="bfloat16")
    hf_cfg = Qwen4ExpTextConfig(**{k: v for k, v in cfg_dict.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        hf = Qwen4ExpForCausalLM(hf_cfg)
    ours = {t.name: t.tensor for t in named_checkpoint_tensors(engine.model)}
    ours |= dict(engine.model.named_buffers())
    for name, _ in list(hf.named_parameters()) + list(hf.named_buffers()):
        mod_name, _, leaf = name.rpartition(".")
        module = hf.get_submodule(mod_name)
        src = ours.get(name)
        if src is None and leaf == "original_inv_freq":
            src = ours[f"{mod_name}.inv_freq"]
        if src is None:
            raise KeyError(f"no tensor for {name}")
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(src, requires_grad=False)
        else:
            module._buffers[leaf] = src.clone()
    hf.eval()
    device = next(iter(ours.values())).device
    ids = torch.randint(10, hf_cfg.vocab_size, (1, 128), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {}
    with torch.inference_mode():
        # same prompt as ours: check the two models agree before timing (greedy, first tokens)
        out = hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        results.setdefault("hf_check", {})["hf_first_tokens"] = out[0, 128:].tolist()
        for n in (1, 1 + new_tokens):
            sync()
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            sync()
            times[n] = time.perf_counter() - t0
    from qwen4exp.engine.request import SamplingParams

    engine.add_request("hf-check", {"prompt_token_ids": ids[0].tolist()},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False))
    mine = []
    while engine.has_unfinished_requests():
        mine = [o.outputs[0].token_ids for o in engine.step()] or mine
    results["hf_check"]["ours_first_tokens"] = mine[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    from qwen4exp.engine.runner import RequestChunk

    cache = engine.cache
    pages, slot = cache.pages.allocate(cache.pages_needed(128)), cache.slots.allocate(1)[0]
    ours_lp = torch.log_softmax(engine.runner.execute([RequestChunk(ids[0].tolist(), 0, [], pages, slot, 0)]), -1)
    cache.pages.free(pages)
    cache.slots.free([slot])
    results["hf_check"] |= {
        "prompt_top1_agreement": float((ref.argmax(-1) == ours_lp.argmax(-1)).float().mean()),
        "prompt_logprob_max_abs_diff": float((ref - ours_lp).abs().max()),
        "prompt_logprob_mean_abs_diff": float((ref - ours_lp).abs().mean()),
        "hf_nonfinite": int((~torch.isfinite(ref)).sum())}
    tok_s = new_tokens / (times[1 + new_tokens] - times[1])
    results["hf"] = {"decode_b1_tok_s": tok_s, "prefill128_plus_1_s": times[1], "new_tokens": new_tokens,
                     "transformers": __import__("transformers").__version__,
                     "experts_implementation": getattr(hf.config, "_experts_implementation", None)}
    log("hf", results["hf"])
    del hf


def stage_profile(results, engine, batch=1):
    """Kernel time of a few eager decode steps at `batch` (where the graph's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    from qwen4exp.bench.offline import random_prompts
    from qwen4exp.engine.request import SamplingParams

    graphs, engine.runner.graphs = engine.runner.graphs, None
    for i, p in enumerate(random_prompts(batch, 128, 1000)):
        engine.add_request(f"prof{i}", {"prompt_token_ids": p},
                           SamplingParams(max_tokens=12, ignore_eos=True, detokenize=False))
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
    eager_step = (time.perf_counter() - t0) / 4
    while engine.has_unfinished_requests():
        engine.step()
    engine.runner.graphs = graphs
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    results[f"profile_b{batch}"] = {"eager_step_s": eager_step,
                          "cuda_kernels_per_step": sum(e.count for e in events) / 4,
                          "cuda_time_per_step_ms": sum(e.device_time_total for e in events) / 4 / 1000,
                          "table": table}
    log(table)


RESULTS_PATH = None


def save(results):
    with open(RESULTS_PATH, "w") as f:
        json.dump(results, f, indent=1, default=str)


def stage_report(results, out_dir):
    from report import write_report

    write_report(results, out_dir)


def main():
    global RESULTS_PATH
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="agree,ours,hf,report")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--train-steps", type=int, default=3000, help="agree_trained: at most this many training steps")
    ap.add_argument("--train-seconds", type=float, default=150,
                    help="agree_trained: as many steps as fit this time at the first steps' pace")
    ap.add_argument("--train-chars", type=int, default=12_000_000,
                    help="agree_trained: characters of standard-library source to train on (every tenth file held out)")
    args = ap.parse_args()
    # the engine logs where startup goes (weights, graph capture, warm-up): keep it in the suite's log
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("qwen4exp").setLevel(logging.INFO)
    os.makedirs(args.out, exist_ok=True)
    RESULTS_PATH = os.path.join(args.out, "results.json")
    # whether GDN prefill runs fla's kernel or the (much slower) reference: a missing fla looks like a slow GPU
    results = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                       "triton": __import__("triton").__version__, "fla_chunk_kernel": fla_chunk() is not None}}
    if os.path.exists(RESULTS_PATH):
        results = json.load(open(RESULTS_PATH)) | results
    device = torch.device("cuda")
    stages = args.stages.split(",")
    engine = None
    for stage in stages:
        t0 = time.perf_counter()
        try:
            if stage in ("hf", "profile") and engine is None:
                raise RuntimeError(f"the {stage} stage uses the engine of the ours stage: run both in one command "
                                   f"(--stages ours,{stage})")
            if stage == "agree":
                stage_agree(results, device)
            elif stage == "agree_trained":
                stage_agree_trained(results, device, args.train_steps, args.train_seconds, args.train_chars)
            elif stage == "ours":
                engine = stage_ours(results, device, args.quick)
            elif stage == "profile":
                stage_profile(results, engine, 1)
                stage_profile(results, engine, 64)
            elif stage == "hf":
                stage_hf(results, engine)
            elif stage == "report":
                if "ours" in results and "hf" in results:
                    results["ratio_decode_b1_vs_hf"] = (results["ours"]["decode_b1_tok_s"]
                                                        / results["hf"]["decode_b1_tok_s"])
                stage_report(results, args.out)
        except Exception:
            results.setdefault("errors", {})[stage] = traceback.format_exc()
            log(f"stage {stage} failed:\n{traceback.format_exc()}")
        results.setdefault("stage_seconds", {})[stage] = time.perf_counter() - t0
        save(results)
    if "ours" in results and "hf" in results:
        results["ratio_decode_b1_vs_hf"] = results["ours"]["decode_b1_tok_s"] / results["hf"]["decode_b1_tok_s"]
        save(results)
    log(json.dumps({k: v for k, v in results.items() if k != "errors"}, default=str)[:3000])


if __name__ == "__main__":
    main()
