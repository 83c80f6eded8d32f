"""Logprob drift of an fp8 n-gram table against a bf16 table (CPU, fp32 model, teacher forcing).

    python bench/ple_fp8_drift.py [--preset small] [--prompts 4] [--len 256]

The same random weights (load_format=dummy, one seed) with the table stored as bf16, as fp8 (e4m3, one scale per
table) and, as a yardstick, with the table zeroed. Prints JSON: mean / max |logprob difference| of each actual next
token and top-1 agreement, fp8 and zeroed vs bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qwen4exp import LLM  # noqa: E402
from qwen4exp.bench.offline import random_prompts, teacher_forced  # noqa: E402
from qwen4exp.config import load_model_config  # noqa: E402
from qwen4exp.weights.loader import table_names  # noqa: E402
from qwen4exp.weights.random_checkpoint import preset_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--len", type=int, default=256)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(preset_config(args.preset, eos_token_id=0, dtype="float32"), f)
    cfg = load_model_config(d)
    prompts = random_prompts(args.prompts, args.len, cfg.vocab_size, seed=5)

    def llm(table_dtype):
        return LLM(None, model_config=cfg, load_format="dummy", device="cpu", dtype="float32", seed=0,
                   max_model_len=args.len + 8, max_num_batched_tokens=args.len, cpu_cache_bytes=2 << 30,
                   ple_table_dtype=table_dtype)

    bf16 = teacher_forced(llm("bfloat16"), prompts)
    fp8_llm = llm("fp8")
    fp8 = teacher_forced(fp8_llm, prompts)
    model = fp8_llm.llm_engine.model
    for name in table_names(model):
        dict(model.named_parameters())[name].data.zero_()
    zero = teacher_forced(fp8_llm, prompts)
    result = {"preset": args.preset, "positions": bf16[0].numel()}
    for name, (lp, top) in (("fp8", fp8), ("zeroed", zero)):
        diff = (lp - bf16[0]).abs()
        result[name] = {"mean_abs_dlogprob": diff.mean().item(), "max_abs_dlogprob": diff.max().item(),
                        "top1_agreement": (top == bf16[1]).float().mean().item()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
