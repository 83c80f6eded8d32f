#!/usr/bin/env bash
# Sets up .venv in the repository with torch and qwen4exp (editable); with --test, also the test tools.
# TORCH (default torch==2.13.0) names the torch to install first: on a GPU machine use your CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".${extras}"
