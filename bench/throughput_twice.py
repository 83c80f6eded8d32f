"""The issue's 64-request run (1024 in / 256 out, flash-next-128e, dummy bf16 weights) twice in one process, with
the compilations each run triggers (Triton JIT kernels, dynamo graphs): separates a stall of the first run (a
compile the warm-up missed) from a slow machine (both runs slow).

    python bench/throughput_twice.py --out OUT_DIR        (writes OUT_DIR/throughput_twice.json)
"""

import argparse
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qwen4exp.bench.compile_log import CompileLog  # noqa: E402
from qwen4exp.bench.offline import throughput  # noqa: E402
from qwen4exp.config import EngineConfig  # noqa: E402
from qwen4exp.engine.engine import LLMEngine  # noqa: E402
from qwen4exp.weights.random_checkpoint import preset_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--num-prompts", type=int, default=64)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model = tempfile.mkdtemp()
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(preset_config("flash-next-128e", eos_token_id=0, dtype="bfloat16"), f)
    t0 = time.perf_counter()
    # as `qwen4exp bench throughput` builds it (bench/ab_throughput.sh)
    engine = LLMEngine(model, EngineConfig(max_model_len=4096, max_num_seqs=a.num_prompts, dtype="bfloat16",
                                           device="cuda", load_format="dummy"))
    out = {"startup_s": time.perf_counter() - t0}
    for run in (1, 2):
        with CompileLog() as cl:
            r = throughput(engine, a.num_prompts, 1024, 256)
        r["compiled"] = {"dynamo_graphs": cl.dynamo_graphs, "triton_kernels": cl.events}
        out[f"run{run}"] = r
        print(f"run {run}: {r['output_throughput']:.1f} tok/s, median TTFT {r['median_ttft_ms']:.0f} ms, max TTFT "
              f"{r['max_ttft_ms']:.0f}, median ITL {r['median_itl_ms']:.2f}, max ITL {r['max_itl_ms']:.0f}; compiled: "
              f"{cl.dynamo_graphs} dynamo graphs, {[(e['kernel'], e['s']) for e in cl.events]}", flush=True)
        with open(os.path.join(a.out, "throughput_twice.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
