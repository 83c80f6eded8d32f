#!/bin/bash
# The 64-request run, alternating between code trees, one process per run (each run compiles and captures its
# own graphs, so the first run of a fresh machine also warms the caches for the rest):
#
#   bash bench/ab_throughput.sh OUT_DIR ROUNDS TREE_A TREE_B [...]     e.g. trees exported with
#   mkdir -p _br/next && git archive wip/next | tar -x -C _br/next
#
# A tree may carry one setting, TREE@VAR=VALUE (an environment variable, e.g. _br/next@QWEN4EXP_PDL=0) or
# TREE@--flag=value (a flag of `qwen4exp bench throughput`, e.g. _br/main@--max-num-batched-tokens=32768): that run
# gets it, and its name is the tree's with the setting appended.
#
# Writes OUT_DIR/tp_<run name>_<round>.json (vLLM's metric names; characters other than [A-Za-z0-9._-] in the name
# become _) and prints one line per run. Compare figures from one machine only. PRESET, DEVICE, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN override the defaults (flash-next-128e on the
# GPU, 64 x 1024 in / 256 out).
set -e
out=$1; rounds=$2; shift 2
mkdir -p "$out"
# without fla-core GDN prefill runs the torch reference and the run is ~40% slower, which looks like a slow machine
python -c "import fla.ops.gated_delta_rule" 2>/dev/null || echo "WARNING: fla-core is not importable from $(command -v python); prefill runs the reference"
model=$(mktemp -d)
python -c "
import json, sys
from qwen4exp.weights.random_checkpoint import preset_config
json.dump(preset_config('${PRESET:-flash-next-128e}', eos_token_id=0, dtype='bfloat16'), open(sys.argv[1], 'w'))
" "$model/config.json"
for r in $(seq 1 "$rounds"); do
  for arg in "$@"; do
    tree=${arg%%@*}; setting=; [[ $arg == *@* ]] && setting=${arg#*@}
    name=$(basename "$tree")${setting:+@$setting}; env_setting=; flag=
    if [[ $setting == --* ]]; then flag=$setting; else env_setting=$setting; fi
    fname=${name//[^A-Za-z0-9._-]/_}  # the device tool returns plain names only
    (cd "$tree" && env ${env_setting:+"$env_setting"} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -m qwen4exp.entrypoints.cli bench throughput \
      --model "$model" --load-format dummy --dtype bfloat16 ${DEVICE:+--device $DEVICE} \
      --num-prompts "${NUM_PROMPTS:-64}" --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}" \
      --max-num-seqs "${NUM_PROMPTS:-64}" ${flag:+"$flag"} --output-json "$out/tp_${fname}_$r.json" > /dev/null 2>&1) \
      || { echo "$name round $r failed"; continue; }
    python -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(f\"{sys.argv[2]:>12} round {sys.argv[3]}: {d['output_throughput']:8.1f} tok/s  {d['duration_s']:7.3f} s  \"
      f\"median ITL {d['median_itl_ms']:6.2f} ms  max TTFT {d['max_ttft_ms']:7.1f} ms\", flush=True)
" "$out/tp_${fname}_$r.json" "$name" "$r"
  done
done
rm -rf "$model"
