"""Asynchronous against synchronous scheduling on one engine, alternating in one process (flash-next-128e, bf16,
load_format=dummy, CUDA graphs): batch-1 decode (128 in, 128 out) TPOT and 64 concurrent requests (1024 in, 256 out)
output tok/s.

    python bench/async_scheduling.py --out OUT_DIR [--rounds 2]

Writes OUT_DIR/async_scheduling.json with every run and the medians per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h200_suite import log, preset  # noqa: E402

from qwen4exp.bench.offline import latency, throughput  # noqa: E402
from qwen4exp.config import EngineConfig  # noqa: E402
from qwen4exp.engine.engine import LLMEngine  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ecfg = EngineConfig(max_model_len=33 * 1024, max_num_seqs=64, max_num_batched_tokens=8192,
                        gpu_memory_utilization=0.92, cuda_graph_sizes=[1, 2, 4, 8, 16, 32, 48, 64],
                        dtype="bfloat16", device="cuda", load_format="dummy")
    engine = LLMEngine(None, ecfg, model_config=preset("flash-next-128e"), tokenizer=None)
    runs = []
    for r in range(args.rounds):
        for mode in (True, False):  # the engine reads the flag at every step; nothing is in flight between runs
            engine.async_scheduling = mode
            lat = latency(engine, 1, 128, 128, iters=3)
            thr = throughput(engine, args.concurrency, 1024, 256)
            runs.append({"async": mode, "round": r, "b1_tpot_ms": lat["median_tpot_ms"],
                         "b1_tok_s": 1000 / lat["median_tpot_ms"], "concurrent_output_tok_s": thr["output_throughput"],
                         "concurrent_median_itl_ms": thr["median_itl_ms"], "concurrent_duration_s": thr["duration_s"]})
            log(runs[-1])
    summary = {}
    for mode in (True, False):
        mine = [x for x in runs if x["async"] == mode]
        summary["async" if mode else "sync"] = {k: statistics.median(x[k] for x in mine) for k in
                                                ("b1_tpot_ms", "b1_tok_s", "concurrent_output_tok_s",
                                                 "concurrent_median_itl_ms")}
    summary["b1_speedup"] = summary["async"]["b1_tok_s"] / summary["sync"]["b1_tok_s"]
    summary["concurrent_speedup"] = (summary["async"]["concurrent_output_tok_s"]
                                     / summary["sync"]["concurrent_output_tok_s"])
    log(summary)
    with open(os.path.join(args.out, "async_scheduling.json"), "w") as f:
        json.dump({"runs": runs, "summary": summary, "concurrency": args.concurrency}, f, indent=1)


if __name__ == "__main__":
    main()
