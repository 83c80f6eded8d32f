"""`qwen4exp bench suite`: the figures of docs/benchmarks.md, measured in one process on one GPU.

Stages (run in the order given; each records its figures in the results JSON as soon as it finishes, with the
command, commit and versions that produced them, so stages may also run in separate calls on the same file):
  agree_trained   GPU bf16 vs CPU fp32 top-1 agreement under teacher forcing on `small` trained briefly.
  ours            flash-next-128e, bf16 random weights (load_format="dummy"): batch-1 decode (128 in / 128 out) and
                  its HBM roofline fraction, prefill of one 8k and one 32k prompt, throughput at concurrency 1, 8,
                  32 and 64 (1k in / 256 out) with the compilations each run triggered.
  hf              transformers' Qwen4ExpForCausalLM holding the engine's very weight tensors (no copy): batch-1
                  decode and a check that both pick the same tokens. Needs `ours` earlier in the same call.
  throughput_cli  the 64-request run (1k in / 256 out) as `qwen4exp bench throughput` runs it, one fresh process a run.
  table_on_host   the released-size n-gram table (base 20,000,000, fp8: 51.2 GB) in page-locked host memory vs in
                  GPU memory: batch-1 decode, 64 concurrent requests, one layer's row gather; engines built in turn.
  fp8_128e, flash_next, agree_fp8   block-scaled fp8 (bench/fp8_stages.py): flash-next-128e in fp8 against bf16,
                  the released shape in fp8 on one GPU, and fp8's agreement with bf16 and with its CPU reference.
  spec_decode, prefix_cache, vision, structured   the features (bench/feature_stages.py): MTP speculative decoding on
                  `small` trained briefly and on flash-next-128e (also as two stages, spec_trained and spec_dummy),
                  multi-turn chat with the prefix cache on and off, one 1024 x 1024 image through the released vision
                  tower, 64 requests with a quarter under a grammar.
                  Not run by default (about 25 minutes more on an H200): name them in --stages.
  report          docs/benchmarks.md and the concurrency plot from the results JSON (CPU only).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

# the default order: training before the suite's engine holds the GPU's memory, the stages that start engines of
# their own (in this process or others) after it is freed
DEFAULT_ORDER = ("agree_trained", "agree_fp8", "ours", "hf", "throughput_cli", "table_on_host", "fp8_128e",
                 "flash_next", "report")
# named in --stages only: they would make the default run about 25 minutes longer
FEATURE_STAGES = ("spec_decode", "spec_trained", "spec_dummy", "prefix_cache", "vision", "structured")
STAGES = DEFAULT_ORDER[:-1] + FEATURE_STAGES + DEFAULT_ORDER[-1:]
DEFAULT_STAGES = ",".join(DEFAULT_ORDER)
TRAINING_STAGES = ("agree_trained", "agree_fp8", "spec_decode", "spec_trained")
RESULTS_NAME = "benchmarks_results.json"

# the suite's engine: the step budget is the device's default for LLM (16384 on an H200), as a user's engine gets it
OURS_PRESET = "flash-next-128e"
OURS_ENGINE = dict(max_model_len=33 * 1024, max_num_seqs=64, gpu_memory_utilization=0.92,
                   cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 48, 64])
CONCURRENCY = (1, 8, 32, 64)
# the host-table stage: the released model's n-gram base, engines built in this order (each figure is the median
# over the engines of its placement)
RELEASED_NGRAM_BASE = 20_000_000
TABLE_ORDER = ("gpu", "cpu", "gpu", "cpu")
THROUGHPUT_CLI_RUNS = 2

class Results(dict):
    """The results JSON's content, written back to `path` by `save()` as stages progress (a stage that fails later
    keeps what it measured)."""

    def __init__(self, path: str | None, content: dict | None = None):
        super().__init__(content or {})
        self.path = path

    def save(self) -> None:
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self, f, indent=1, default=str)
                f.write("\n")


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# ---- ours ----

def stage_ours(results: Results, device, quick: bool = False):
    """Returns the engine, which the hf stage reuses."""
    from ..config import EngineConfig
    from .compile_log import CompileLog
    from .engines import dummy_engine, preset_model_config
    from .offline import latency, prefill, throughput
    from .roofline import copy_bandwidth, decode_bytes, roofline_fraction

    engine, startup = dummy_engine(preset_model_config(OURS_PRESET), EngineConfig(**OURS_ENGINE), device)
    log(f"engine ready in {startup:.1f}s; cache {engine.cache.pages.num_usable} pages")
    r = results["ours"] = {"startup_s": startup, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                           "params_B": sum(p.numel() for p in engine.model.parameters()) / 1e9}
    bandwidth = copy_bandwidth(device)
    r["copy_bandwidth_GBs"] = bandwidth / 1e9
    r["decode_b1"] = latency(engine, 1, 128, 128 if not quick else 32, iters=3)
    step = r["decode_b1"]["median_tpot_ms"] / 1000
    r["decode_b1_bytes_per_step"] = decode_bytes(engine.model, 128 + 64)
    r["decode_b1_roofline_fraction"] = roofline_fraction(r["decode_b1_bytes_per_step"], bandwidth, step)
    r["decode_b1_tok_s"] = 1 / step
    log(f"decode b1: {1 / step:.1f} tok/s, TPOT {step * 1e3:.2f} ms, roofline {r['decode_b1_roofline_fraction']:.2%}")
    results.save()
    r["prefill_8k"] = prefill(engine, 8192, iters=2)
    log("prefill 8k", r["prefill_8k"])
    results.save()
    if quick:
        return engine
    r["prefill_32k"] = prefill(engine, 32768, iters=1)
    log("prefill 32k", r["prefill_32k"])
    results.save()
    sweep = r["concurrency"] = {}
    for conc in CONCURRENCY:
        with CompileLog() as compiled:
            sweep[str(conc)] = run = throughput(engine, conc, 1024, 256)
        # a compilation during the run (a step shape the warm-up missed) is a stall of 0.3-7 s
        run["compiled_during_run"] = {"dynamo_graphs": compiled.dynamo_graphs,
                                      "triton_kernels": [e["kernel"] for e in compiled.events],
                                      "triton_seconds": sum(e["s"] for e in compiled.events)}
        log(f"concurrency {conc}: {run['output_throughput']:.0f} output tok/s, max ITL {run['max_itl_ms']:.0f} ms, "
            f"compiled {run['compiled_during_run']}")
        results.save()
    return engine


# ---- hf ----

def point_at_engine_tensors(hf_model, engine_model) -> None:
    """Every parameter and buffer of transformers' model becomes the engine's tensor of the same checkpoint name:
    parameters are the engine's storage (no copy; a merged projection's part is a view of its rows), buffers copies
    of it. transformers' rotary `original_inv_freq` is the engine's `inv_freq`."""
    import torch

    from ..model.merged_linear import named_checkpoint_tensors

    ours = {t.name: t.tensor for t in named_checkpoint_tensors(engine_model)} | dict(engine_model.named_buffers())
    for name, _ in list(hf_model.named_parameters()) + list(hf_model.named_buffers()):
        module_name, _, leaf = name.rpartition(".")
        module = hf_model.get_submodule(module_name)
        src = ours.get(name)
        if src is None and leaf == "original_inv_freq":
            src = ours[f"{module_name}.inv_freq"]
        if src is None:
            raise KeyError(f"no tensor for {name}")
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(src, requires_grad=False)
        else:
            module._buffers[leaf] = src.clone()


def stage_hf(results: Results, engine, new_tokens: int = 16) -> None:
    """transformers on the same weights: built on the meta device, then pointed at the engine's tensors. Decode
    speed is (time of prefill + 1 + new_tokens tokens - time of prefill + 1 token) / new_tokens."""
    import torch
    import transformers
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from ..engine.request import SamplingParams
    from ..engine.step_builder import RequestChunk
    from ..weights.random_checkpoint import preset_config

    cfg_dict = preset_config(OURS_PRESET, eos_token_id=0, dtype="bfloat16")
    hf_cfg = Qwen4ExpTextConfig(**{k: v for k, v in cfg_dict.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        hf = Qwen4ExpForCausalLM(hf_cfg)
    point_at_engine_tensors(hf, engine.model)
    hf.eval()
    device = next(engine.model.parameters()).device
    ids = torch.randint(10, hf_cfg.vocab_size, (1, 128), device=device)
    times = {}
    check = results["hf_check"] = {}
    with torch.inference_mode():
        # the same prompt as ours: the two models must pick the same first tokens (greedy) before timing means much
        out = hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        check["hf_first_tokens"] = out[0, 128:].tolist()
        for n in (1, 1 + new_tokens):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t0
    engine.add_request("hf-check", {"prompt_token_ids": ids[0].tolist()},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False))
    mine = []
    while engine.has_unfinished_requests():
        mine = [o.outputs[0].token_ids for o in engine.step()] or mine
    check["ours_first_tokens"] = mine[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    cache = engine.cache
    pages, slot = cache.pages.allocate(cache.pages_needed(128)), cache.slots.allocate(1)[0]
    ours_lp = torch.log_softmax(engine.runner.execute([RequestChunk(ids[0].tolist(), 0, [], pages, slot, 0)]), -1)
    cache.pages.free(pages)
    cache.slots.free([slot])
    check |= {"prompt_top1_agreement": float((ref.argmax(-1) == ours_lp.argmax(-1)).float().mean()),
              "prompt_logprob_max_abs_diff": float((ref - ours_lp).abs().max()),
              "prompt_logprob_mean_abs_diff": float((ref - ours_lp).abs().mean()),
              "hf_nonfinite": int((~torch.isfinite(ref)).sum())}
    results["hf"] = {"decode_b1_tok_s": new_tokens / (times[1 + new_tokens] - times[1]),
                     "prefill128_plus_1_s": times[1], "new_tokens": new_tokens,
                     "transformers": transformers.__version__,
                     "experts_implementation": getattr(hf.config, "_experts_implementation", None)}
    log("hf", results["hf"], check)


# ---- agree_trained ----

def stage_agree_trained(results: Results, device, steps: int, seconds: float | None, corpus_chars: int) -> None:
    """`small` trained on the GPU (32 x 512-token steps, for `seconds` at the first steps' pace, at most `steps`),
    then its agreement: agreement.trained_agreement."""
    from .agreement import trained_agreement

    results["agree_trained"] = trained_agreement(device, steps, seconds, corpus_chars=corpus_chars, log=log)


# ---- throughput_cli ----

def throughput_cli_command(model_dir: str, output_json: str) -> list[str]:
    """`qwen4exp bench throughput` for the 64-request run on flash-next-128e random weights, defaults otherwise."""
    return [sys.executable, "-m", "qwen4exp.entrypoints.cli", "bench", "throughput", "--model", model_dir,
            "--load-format", "dummy", "--dtype", "bfloat16", "--num-prompts", "64", "--input-len", "1024",
            "--output-len", "256", "--max-num-seqs", "64", "--output-json", output_json]


def stage_throughput_cli(results: Results, runs: int = THROUGHPUT_CLI_RUNS) -> None:
    """The 64-request run `runs` times, each in a fresh process: what a user of `qwen4exp bench throughput` gets,
    startup compilation and all (each process compiles and captures its own graphs)."""
    from ..weights.random_checkpoint import preset_config

    out = results["throughput_cli"] = {"runs": []}
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(preset_config(OURS_PRESET, eos_token_id=0, dtype="bfloat16"), f)
        for i in range(runs):
            path = os.path.join(d, f"run{i}.json")
            subprocess.run(throughput_cli_command(d, path), check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                out["runs"].append(json.load(f))
            run = out["runs"][-1]
            log(f"throughput_cli run {i + 1}: {run['output_throughput']:.1f} tok/s, {run['duration_s']:.3f} s, "
                f"median ITL {run['median_itl_ms']:.2f} ms")
            results.save()


# ---- table_on_host ----

def _gather_us(engine) -> dict:
    """Median time of one PLE layer's row gather (hashing excluded) at 1, 64 and 8192 tokens."""
    import torch

    from ..ops.table_gather import gather_rows

    emb = next(layer.ple.ple_embedding for layer in engine.model.model.layers if layer.ple is not None)
    table = emb.ngram_embedding
    heads = emb.ngram_heads_offsets.numel()
    out = {}
    for tokens in (1, 64, 8192):
        ids = torch.randint(0, emb.num_rows, (tokens, heads), device="cuda")
        buf = torch.empty(tokens, emb.embed_dim, dtype=torch.bfloat16, device="cuda")
        times = []
        for i in range(23):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gather_rows(table.weight, ids, table.weight_scale, torch.bfloat16, buf)
            end.record()
            end.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end) * 1e3)
        out[str(tokens)] = statistics.median(times)
    return out


def _table_run(where: str, model_config, device) -> dict:
    """One engine with the n-gram table on `where` (gpu, or cpu: page-locked host memory), in fp8."""
    import torch

    from ..config import EngineConfig
    from ..weights.loader import table_names
    from ..weights.ngram_table import on_host
    from .engines import dummy_engine, return_gpu_memory
    from .offline import latency, throughput

    ecfg = EngineConfig(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=8192,
                        gpu_memory_utilization=0.95, cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 48, 64],
                        ple_table_device=where, ple_table_dtype="fp8")
    torch.cuda.synchronize()
    engine, startup = dummy_engine(model_config, ecfg, device)
    r = {"startup_s": startup, "ple_table_device": where}
    params = dict(engine.model.named_parameters())
    tables = [params[n] for n in table_names(engine.model)]
    r["table_on_host"] = all(on_host(t) for t in tables)
    r["table_GB"] = sum(t.numel() * t.element_size() for t in tables) / 1e9
    r["table_rows"] = sum(t.shape[0] for t in tables)
    r["gpu_weights_GB"] = sum(p.numel() * p.element_size() for p in params.values() if p.is_cuda) / 1e9
    r["cache_pages"] = engine.cache.pages.num_usable
    r["gpu_max_allocated_GB"] = torch.cuda.max_memory_allocated() / 1e9
    r["gather_us"] = _gather_us(engine)
    lat = latency(engine, 1, 128, 128, iters=5)
    r["decode_b1"] = lat
    r["decode_b1_tok_s"] = 1000.0 / lat["median_tpot_ms"]
    throughput(engine, 64, 1024, 16)  # warm-up: compiles and autotunes the prefill shapes
    runs = [throughput(engine, 64, 1024, 256) for _ in range(2)]
    r["concurrency_64_runs"] = runs
    r["concurrency_64_tok_s"] = statistics.median(x["output_throughput"] for x in runs)
    log(f"table on {where}: decode b1 {r['decode_b1_tok_s']:.1f} tok/s, 64 concurrent "
        f"{[round(x['output_throughput']) for x in runs]} tok/s, gather {r['gather_us']}")
    del engine, tables, params
    return_gpu_memory()
    return r


def stage_table_on_host(results: Results, device) -> None:
    from .engines import preset_model_config

    cfg = preset_model_config(OURS_PRESET, ngram_vocab_size_base=RELEASED_NGRAM_BASE)
    out = results["table_on_host"] = {"ngram_base": RELEASED_NGRAM_BASE, "order": list(TABLE_ORDER), "runs": []}
    for where in TABLE_ORDER:
        out["runs"].append(_table_run(where, cfg, device))
        results.save()


# ---- the command ----

def canonical_command(args, stages: list[str]) -> str:
    """The command that reproduces these stages' figures: the stages and every option that changes a measurement
    (paths left out)."""
    parts = ["qwen4exp bench suite", "--stages", ",".join(stages)]
    if args.quick:
        parts.append("--quick")
    if any(s in TRAINING_STAGES for s in stages):
        for flag, value, default in (("--train-steps", args.train_steps, 3000),
                                     ("--train-seconds", args.train_seconds, 130),
                                     ("--train-chars", args.train_chars, 12_000_000)):
            if value != default:
                parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join(parts)


def _commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _environment() -> dict:
    import torch
    import transformers
    import triton

    from ..ops.gated_delta import fla_chunk

    # whether GDN prefill runs fla's kernel or the much slower reference: a missing fla looks like a slow GPU
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "fla_chunk_kernel": fla_chunk() is not None}


def add_suite_arguments(p) -> None:
    p.add_argument("--stages", default=DEFAULT_STAGES,
                   help=f"comma-separated, run in this order, from {', '.join(STAGES)} (default: all but "
                        f"{', '.join(FEATURE_STAGES)})")
    p.add_argument("--out", default="out", help="directory for the results JSON, benchmarks.md and the plot")
    p.add_argument("--results", default=None,
                   help=f"results JSON to update, and to report from (default: OUT/{RESULTS_NAME})")
    p.add_argument("--quick", action="store_true", help="ours: 32 output tokens at batch 1, no 32k prefill or sweep")
    training = ", ".join(TRAINING_STAGES)
    p.add_argument("--train-steps", type=int, default=3000, help=f"{training}: at most this many training steps")
    p.add_argument("--train-seconds", type=float, default=130,
                   help=f"{training}: as many steps as fit this time at the first steps' pace")
    p.add_argument("--train-chars", type=int, default=12_000_000,
                   help=f"{training}: characters of standard-library source to train on (every tenth file held out)")


def parse_stages(text: str) -> list[str]:
    stages = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise ValueError(f"--stages: unknown stage(s) {unknown}, choose from {', '.join(STAGES)}")
    if "hf" in stages and ("ours" not in stages or stages.index("ours") > stages.index("hf")):
        raise ValueError("--stages: hf runs on the engine of the ours stage: give ours before hf in one call")
    return stages


def run(args) -> dict:
    from . import feature_stages, fp8_stages
    from .report import write_report

    stages = parse_stages(args.stages)
    os.makedirs(args.out, exist_ok=True)
    path = args.results or os.path.join(args.out, RESULTS_NAME)
    content = None
    if os.path.exists(path):
        with open(path) as f:
            content = json.load(f)
    # the report stage alone leaves the results file as it is
    results = Results(path if any(s != "report" for s in stages) else None, content)
    measuring = [s for s in stages if s != "report"]
    if measuring:
        # fla tunes its kernels in every process instead of loading another process's choice from Triton's cache,
        # so that each figure comes with its own tuning (the throughput_cli runs inherit it)
        os.environ.setdefault("FLA_CACHE_RESULTS", "0")
        import torch

        from .engines import return_gpu_memory

        # the engine logs where startup goes (weights, graph capture, warm-up): keep it in the suite's log
        logging.getLogger("qwen4exp").setLevel(logging.INFO)
        device = torch.device("cuda")
        provenance = {"command": canonical_command(args, measuring), "commit": _commit(), "env": _environment()}
    engine = None
    for stage in stages:
        t0 = time.perf_counter()
        if stage == "report":
            text = write_report(results, args.out, os.path.basename(path))
            log(f"wrote {os.path.join(args.out, 'benchmarks.md')} ({text.count(chr(10))} lines)")
            continue
        if stage not in ("ours", "hf") and engine is not None:  # the other stages need the GPU's memory
            engine = None
            return_gpu_memory()
        try:
            if stage == "ours":
                engine = stage_ours(results, device, args.quick)
            elif stage == "hf":
                if engine is None:
                    raise RuntimeError("hf: the ours stage of this call built no engine")
                stage_hf(results, engine)
            elif stage == "agree_trained":
                stage_agree_trained(results, device, args.train_steps, args.train_seconds, args.train_chars)
            elif stage == "throughput_cli":
                stage_throughput_cli(results)
            elif stage == "table_on_host":
                stage_table_on_host(results, device)
            elif stage == "fp8_128e":
                fp8_stages.stage_fp8_128e(results, device, log)
            elif stage == "flash_next":
                fp8_stages.stage_flash_next(results, device, log)
            elif stage == "agree_fp8":
                fp8_stages.stage_agree_fp8(results, device, args.train_steps, args.train_seconds, args.train_chars,
                                           log)
            elif stage == "spec_decode":
                feature_stages.stage_spec_decode(results, device, log, args.train_steps, args.train_seconds,
                                                 args.train_chars)
            elif stage == "spec_trained":
                feature_stages.stage_spec_trained(results, device, log, args.train_steps, args.train_seconds,
                                                  args.train_chars)
            elif stage == "spec_dummy":
                feature_stages.stage_spec_dummy(results, device, log)
            elif stage == "prefix_cache":
                feature_stages.stage_prefix_cache(results, device, log)
            elif stage == "vision":
                feature_stages.stage_vision(results, device, log)
            elif stage == "structured":
                feature_stages.stage_structured(results, device, log)
            results.setdefault("errors", {}).pop(stage, None)
        except Exception:
            results.setdefault("errors", {})[stage] = traceback.format_exc()
            log(f"stage {stage} failed:\n{traceback.format_exc()}")
        if engine is None:  # the engines a stage left behind, a failed one's included, before the next stage
            return_gpu_memory()
        if not results.get("errors"):
            results.pop("errors", None)
        results.setdefault("stages", {})[stage] = provenance | {"seconds": time.perf_counter() - t0}
        results.save()
    return results
