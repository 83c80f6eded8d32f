"""Top-1 agreement of the GPU engine (bf16, fast paths, CUDA-graph decode) with the CPU reference (fp32) under
teacher forcing, on `small` trained briefly (qwen4exp.bench.train_small): the suite's `agree_trained` stage."""

from __future__ import annotations

import torch

from ..config import EngineConfig
from ..engine.engine import LLMEngine
from ..engine.step_builder import RequestChunk


def top1_agreement(cfg, weights: dict, seqs: list[list[int]], device, prefill: int = 256,
                   quantization: str | None = None) -> dict:
    """GPU bf16 (eager prefill of the first `prefill` tokens, then one token per step: CUDA-graph decode) against the
    CPU fp32 reference on the same weights, top-1 under teacher forcing at every position of every sequence. Also
    the CPU's bf16 engine against the same reference (how close bf16 arithmetic itself gets to fp32 on this model).
    `quantization="fp8"`: every engine quantizes the weights to fp8 on load (the CPU's runs the fp8 reference)."""
    def engine(dtype, dev, w, **kw):
        # no warm-up: the steps here are a prefill and one-token decodes, compiled as they come
        ecfg = EngineConfig(max_model_len=1024, page_size=16, max_num_seqs=8, max_num_batched_tokens=1024,
                            dtype=dtype, device=str(dev), quantization=quantization, **kw)
        return LLMEngine(None, ecfg, model_config=cfg, tokenizer=None, weights=iter(w.items()), warm_up_steps=False)

    cpu = engine("float32", "cpu", weights, num_pages=300)
    gpu = engine("bfloat16", device, weights, num_pages=200, cuda_graph_sizes=[1, 2, 4])
    cpu16 = engine("bfloat16", "cpu", weights, num_pages=300)
    same = total = same16 = same_gpu16 = 0
    # the same argmaxes with the logits rounded to bf16, and with the reference's own logits rounded: how much of
    # the disagreement is that last rounding
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


def trained_agreement(device, steps: int, seconds: float | None = None, batch: int = 32, seq_len: int = 512,
                      spans: int = 6, span_len: int = 512, corpus_chars: int = 12_000_000, log=print) -> dict:
    """`small` trained with transformers on the machine's Python standard library (train_small.train), then bf16 on
    `device` vs CPU fp32 on `spans` spans of held-out files, teacher forcing. The reference runs once on the trained
    fp32 weights and once on the bf16 checkpoint they round to (the form a model is released in)."""
    from .train_small import train_for_engines

    cfg, weights, held, record = train_for_engines(device, steps, log, batch=batch, seq_len=seq_len, seconds=seconds,
                                                   corpus_chars=corpus_chars)
    seqs = [held[i * 4096: i * 4096 + span_len] for i in range(spans)]  # spans of held-out files, 4096 tokens apart
    r = {"preset": "small", "device": str(device), "spans": spans, "span_len": span_len, "training": record}
    r["fp32_weights"] = top1_agreement(cfg, weights, seqs, device, prefill=span_len // 2)
    log("trained model, fp32 weights", r["fp32_weights"])
    rounded = {n: t.to(torch.bfloat16).float() if t.is_floating_point() else t for n, t in weights.items()}
    r["bf16_checkpoint"] = top1_agreement(cfg, rounded, seqs, device, prefill=span_len // 2)
    log("trained model, bf16 checkpoint", r["bf16_checkpoint"])
    return r
