"""How much top-1 agreement with the fp32 reference a bf16 model of the `small` preset can reach at all (CPU only).

    python bench/agreement_ceiling.py [--out FILE.json]
    ONEDNN_MAX_CPU_ISA=AVX2 python bench/agreement_ceiling.py   # the H200 host's kernels

Same model, sequences and positions as h200_suite's stage_agree (3 x 512 tokens, teacher-forced full prefill):
  bf16_engine                   the bf16 CPU engine vs the fp32 engine (stage_agree's CPU bf16 floor)
  fp32_arithmetic_bf16_weights  an fp32 engine on the weights rounded to bf16 vs the fp32 engine: the ceiling for any
                                engine serving a bf16 checkpoint of this random model, whatever its arithmetic
  bf16_engine_vs_rounded_fp32   the bf16 engine vs that rounded fp32 engine: arithmetic error alone, same weights
Also per comparison: the reference's median top-1 probability, the RMS logit error relative to the reference logits'
std (both mean-removed per position: softmax ignores a shift), and the fraction of positions whose reference top-2
gap is below one bf16 ulp of the top logit, i.e. near-ties that any bf16 rounding may flip; the median reference
top-2 gap, and the largest reference gap at a position where the two disagree.

bf16 matmul results on the CPU depend on the oneDNN ISA (ONEDNN_MAX_CPU_ISA=AVX2 reproduces the H200 host's 95.83%
for bf16_engine); the figures move by about +-0.5 point between kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h200_suite import preset  # noqa: E402

from qwen4exp.config import EngineConfig  # noqa: E402
from qwen4exp.engine.engine import LLMEngine  # noqa: E402
from qwen4exp.engine.runner import RequestChunk  # noqa: E402
from qwen4exp.model.merged_linear import named_checkpoint_tensors  # noqa: E402


def engine(cfg, dtype: str, weights: dict | None = None) -> LLMEngine:
    ecfg = EngineConfig(max_model_len=1024, num_pages=300, page_size=16, max_num_seqs=8)
    if weights is None:
        return LLMEngine(None, ecfg, dtype=dtype, device="cpu", load_format="dummy", model_config=cfg, tokenizer=None)
    return LLMEngine(None, ecfg, dtype=dtype, device="cpu", model_config=cfg, tokenizer=None,
                     weights=iter(weights.items()))


def logits(eng: LLMEngine, seqs: list[list[int]]) -> torch.Tensor:
    rows = [eng.runner.execute([RequestChunk(s, 0, [], eng.cache.pages.allocate(32), eng.cache.slots.allocate(1)[0],
                                             0)]) for s in seqs]
    return torch.cat(rows).float()


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    err = out - ref
    err = err - err.mean(-1, keepdim=True)
    centred = ref - ref.mean(-1, keepdim=True)
    top2 = ref.topk(2, -1).values
    ulp = torch.exp2(torch.floor(torch.log2(top2[:, 0].abs())) - 7)  # bf16 keeps 8 significant bits
    n = len(ref)  # fractions as count / n: a float32 mean would print 0.9583333134651184 for 1472/1536
    gap = top2[:, 0] - top2[:, 1]
    differ = out.argmax(-1) != ref.argmax(-1)
    return {"top1_agreement": int((~differ).sum()) / n,
            # how close to a tie the reference was where the two disagree, against all positions
            "ref_top2_gap_median": float(gap.median()),
            "ref_top2_gap_max_where_top1_differs": float(gap[differ].max()) if differ.any() else 0.0,
            "ref_median_top1_prob": float(torch.softmax(ref, -1).max(-1).values.median()),
            "rel_rms_logit_error": float(err.pow(2).mean().sqrt() / centred.pow(2).mean().sqrt()),
            "ref_top2_gap_below_bf16_ulp": int((top2[:, 0] - top2[:, 1] < ulp).sum()) / n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cfg = preset("small")
    torch.manual_seed(0)
    fp32 = engine(cfg, "float32")
    sd = {t.name: t.tensor for t in named_checkpoint_tensors(fp32.model)}
    bf16 = engine(cfg, "bfloat16", sd)
    # round exactly what the bf16 engine stores in bf16 (it keeps A_log and dt_bias in fp32), so that the third
    # comparison sees identical weights on both sides
    kept = {t.name: t.tensor.dtype for t in named_checkpoint_tensors(bf16.model)}
    rounded = engine(cfg, "float32", {n: t.to(torch.bfloat16).to(torch.float32) if kept[n] == torch.bfloat16 else t
                                      for n, t in sd.items()})
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(10, cfg.vocab_size, (512,), generator=gen).tolist() for _ in range(3)]
    ref, out16, out_r = (logits(e, seqs) for e in (fp32, bf16, rounded))
    res = {"positions": len(ref), "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "(default)"),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
           "bf16_engine": compare(out16, ref),
           "fp32_arithmetic_bf16_weights": compare(out_r, ref),
           "bf16_engine_vs_rounded_fp32": compare(out16, out_r)}
    res["wall_s"] = time.perf_counter() - t0
    print(f"small preset, {res['positions']} positions, ONEDNN_MAX_CPU_ISA={res['onednn_max_cpu_isa']}, "
          f"torch {res['cpu_capability']}, {res['threads']} threads, {res['wall_s']:.0f}s")
    print(f"{'comparison':30s} {'top-1 agree':>11s} {'ref p(top1)':>11s} {'rel rms err':>11s} {'gap<1ulp':>9s} "
          f"{'median gap':>10s} {'max gap where differ':>20s}")
    for name in ("bf16_engine", "fp32_arithmetic_bf16_weights", "bf16_engine_vs_rounded_fp32"):
        r = res[name]
        print(f"{name:30s} {100 * r['top1_agreement']:10.2f}% {r['ref_median_top1_prob']:11.3f} "
              f"{r['rel_rms_logit_error']:11.2e} {100 * r['ref_top2_gap_below_bf16_ulp']:8.1f}% "
              f"{r['ref_top2_gap_median']:10.4f} {r['ref_top2_gap_max_where_top1_differs']:20.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
