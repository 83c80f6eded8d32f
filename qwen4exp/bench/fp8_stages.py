"""The suite's fp8 stages (`qwen4exp bench suite --stages fp8_128e,flash_next,agree_fp8`).

  fp8_128e    flash-next-128e, bf16 then fp8 (`quantization="fp8"`, dummy weights built in fp8), one engine after the
              other in one process: batch-1 decode (128 in / 128 out), 64 concurrent requests (1k in / 256 out, median
              of two runs), prefill of one 8k prompt; fp8 / bf16 ratios.
  flash_next  the released shape (512 experts, n-gram base 20,000,000) in fp8 on one GPU, the fp8 n-gram table in
              page-locked host memory, max_model_len 32768: start-up time, the memory plan's capacity, batch-1
              decode, 32 concurrent requests (1k in / 256 out), prefill of one 8k prompt.
  agree_fp8   `small` trained briefly, then quantized to fp8: teacher-forced top-1 agreement of the fp8 model with
              the bf16 model and the held-out perplexity of both (on the GPU), and the GPU fp8 engine against the
              CPU fp8 reference (agreement.top1_agreement with fp8 weights).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

FP8_128E_ENGINE = dict(max_model_len=33 * 1024, max_num_seqs=64, gpu_memory_utilization=0.92,
                       cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 48, 64])
# the released model on one H200: 119 GiB of fp8 weights leave ~14 GiB of the 0.95 share for state slots
# (115 MiB each) and pages, and 7 GiB for activations and graphs at a step budget of 8192 tokens
FLASH_NEXT_ENGINE = dict(max_model_len=32 * 1024, max_num_seqs=32, max_num_batched_tokens=8192,
                         gpu_memory_utilization=0.95, cuda_graph_sizes=[1, 2, 4, 8, 16, 24, 32],
                         ple_table_device="cpu", ple_table_dtype="fp8", quantization="fp8")
RELEASED_NGRAM_BASE = 20_000_000


def _measure(engine, concurrency: int, log) -> dict:
    """Batch-1 decode, `concurrency` requests of 1k in / 256 out (median of two runs) and one 8k prefill."""
    from .offline import latency, prefill, throughput

    r = {"decode_b1": latency(engine, 1, 128, 128, iters=3)}
    r["decode_b1_tok_s"] = 1000.0 / r["decode_b1"]["median_tpot_ms"]
    runs = [throughput(engine, concurrency, 1024, 256) for _ in range(2)]
    r[f"concurrency_{concurrency}_runs"] = runs
    r[f"concurrency_{concurrency}_tok_s"] = statistics.median(x["output_throughput"] for x in runs)
    r["prefill_8k"] = prefill(engine, 8192, iters=2)
    r["prefill_8k_tok_s"] = r["prefill_8k"]["prefill_tok_s"]
    log(f"decode b1 {r['decode_b1_tok_s']:.1f} tok/s, {concurrency} concurrent "
        f"{[round(x['output_throughput']) for x in runs]} tok/s, 8k prefill {r['prefill_8k_tok_s']:.0f} tok/s")
    return r


def _capacity(engine) -> dict:
    cache, config = engine.cache, engine.config
    pages_per_seq = -(-config.max_model_len // cache.page_size)
    return {"cache_pages": cache.pages.num_usable, "page_size": cache.page_size,
            "max_concurrent_at_max_model_len": min(config.max_num_seqs, cache.pages.num_usable // pages_per_seq),
            "gpu_weights_GiB": sum(p.numel() * p.element_size() for p in engine.model.parameters() if p.is_cuda)
            / 2**30,
            "gpu_max_allocated_GiB": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}


def stage_fp8_128e(results, device, log, preset: str = "flash-next-128e", engine_options: dict | None = None) -> None:
    from ..config import EngineConfig
    from .engines import dummy_engine, preset_model_config, return_gpu_memory

    options = engine_options or FP8_128E_ENGINE
    out = results["fp8_128e"] = {"preset": preset, "engine": options}
    for name, quantization in (("bf16", None), ("fp8", "fp8")):
        engine, startup = dummy_engine(preset_model_config(preset), EngineConfig(**options, quantization=quantization),
                                       device)
        log(f"{preset} {name}: engine ready in {startup:.1f} s")
        out[name] = {"startup_s": startup} | _capacity(engine) | _measure(engine, 64, log)
        results.save()
        del engine
        return_gpu_memory()
    for key in ("decode_b1_tok_s", "concurrency_64_tok_s", "prefill_8k_tok_s"):
        out[f"{key}_fp8_over_bf16"] = out["fp8"][key] / out["bf16"][key]


def stage_flash_next(results, device, log, preset: str = "flash-next", engine_options: dict | None = None) -> None:
    from ..config import EngineConfig
    from .engines import dummy_engine, preset_model_config, return_gpu_memory

    options = engine_options or FLASH_NEXT_ENGINE
    t0 = time.perf_counter()
    engine, startup = dummy_engine(preset_model_config(preset), EngineConfig(**options), device)
    log(f"{preset} fp8: engine ready in {startup:.1f} s")
    out = results["flash_next"] = {"preset": preset, "engine": options, "startup_s": startup} | _capacity(engine)
    results.save()
    out |= _measure(engine, 32, log)
    out["stage_s"] = time.perf_counter() - t0
    results.save()
    del engine
    return_gpu_memory()


def _teacher_forced(engine, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence prefilled at once: (log-probabilities [positions, vocab] of every next-token prediction, the
    actual next tokens)."""
    from ..engine.step_builder import RequestChunk

    rows, targets = [], []
    for seq in seqs:
        pages = engine.cache.pages.allocate(engine.cache.pages_needed(len(seq)))
        slot = engine.cache.slots.allocate(1)[0]
        try:
            logits = engine.runner.execute([RequestChunk(seq, 0, [], pages, slot, 0)]).float().cpu()
        finally:
            engine.cache.pages.free(pages)
            engine.cache.slots.free([slot])
        rows.append(torch.log_softmax(logits[:-1], -1))
        targets.append(torch.tensor(seq[1:]))
    return torch.cat(rows), torch.cat(targets)


def fp8_against_bf16(cfg, weights: dict, seqs: list[list[int]], device) -> dict:
    """The same weights in bf16 and quantized to fp8 on load: top-1 agreement of the fp8 model with the bf16 model
    under teacher forcing, and both models' perplexity on the actual next tokens."""
    from ..config import EngineConfig
    from ..engine.engine import LLMEngine

    out = {}
    lps = {}
    for name, quantization in (("bf16", None), ("fp8", "fp8")):
        config = EngineConfig(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=1024, num_pages=200,
                              dtype="bfloat16", device=str(device), quantization=quantization, enforce_eager=True)
        engine = LLMEngine(None, config, model_config=cfg, tokenizer=None, weights=iter(weights.items()),
                           warm_up_steps=False)
        lps[name], targets = _teacher_forced(engine, seqs)
        del engine
        token_lp = lps[name].gather(1, targets[:, None])[:, 0]
        out[f"{name}_perplexity"] = math.exp(-float(token_lp.mean()))
        out[f"{name}_nonfinite"] = int((~torch.isfinite(lps[name])).sum())
    out["positions"] = int(targets.numel())
    out["fp8_vs_bf16_top1_agreement"] = float((lps["fp8"].argmax(-1) == lps["bf16"].argmax(-1)).float().mean())
    out["perplexity_fp8_over_bf16"] = out["fp8_perplexity"] / out["bf16_perplexity"]
    return out


def stage_agree_fp8(results, device, steps: int, seconds: float | None, corpus_chars: int, log,
                    spans: int = 6, span_len: int = 512) -> None:
    from .agreement import top1_agreement
    from .train_small import train_for_engines

    cfg, weights, held, record = train_for_engines(device, steps, log, seconds=seconds, corpus_chars=corpus_chars)
    seqs = [held[i * 4096: i * 4096 + span_len] for i in range(spans)]
    r = {"preset": "small", "spans": spans, "span_len": span_len, "training": record}
    r["fp8_vs_bf16"] = fp8_against_bf16(cfg, weights, seqs, device)
    log("fp8 against bf16", r["fp8_vs_bf16"])
    r["gpu_fp8_vs_cpu_fp8"] = top1_agreement(cfg, weights, seqs, device, prefill=span_len // 2,
                                             quantization="fp8")
    log("GPU fp8 against the CPU fp8 reference", r["gpu_fp8_vs_cpu_fp8"])
    results["agree_fp8"] = r
