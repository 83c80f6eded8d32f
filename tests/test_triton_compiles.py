"""Every Triton kernel compiles for the GPUs qwen4exp serves on (sm_90: H100, H200) with the launches the kernel
tests make, on a machine without a GPU (tests/triton_sm90.py). The kernel tests themselves run the kernels in
Triton's interpreter, which accepts code the compiler rejects."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def defined_kernels() -> set[str]:
    """The launchable kernels of qwen4exp/ops (`@triton.jit` functions named *_kernel)."""
    names = set()
    for path in (ROOT / "qwen4exp" / "ops").glob("*_triton.py"):
        names |= set(re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text()))
    return names


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernel tests compile and run every kernel")
def test_every_kernel_compiles_for_sm90(tmp_path):
    # the kernel tests in a process per core (at most 8: each imports torch and collects every test), each compiling
    # the launches of every n-th test
    n = max(1, min(8, os.cpu_count() or 1))
    runs = []
    for i in range(n):
        report = tmp_path / f"compiled{i}.json"
        env = dict(os.environ, TRITON_INTERPRET="0", QWEN4EXP_SM90_REPORT=str(report), QWEN4EXP_SM90_SHARD=f"{i}/{n}",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        args = [sys.executable, "-m", "pytest", "-q", "-p", "triton_sm90", "-p", "no:cacheprovider",
                str(ROOT / "tests" / "ops")]
        runs.append((report, subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True)))
    compiled = set()
    for report, proc in runs:
        out = proc.communicate()[0]
        failed = [line for line in out.splitlines() if "KernelCompileError" in line or line.startswith("FAILED")]
        assert proc.returncode == 0, "\n".join(failed[:20]) or out[-3000:]
        compiled |= set(json.loads(report.read_text()))
    missing = defined_kernels() - compiled
    assert not missing, f"kernels no test launches, so never compiled: {sorted(missing)}"
