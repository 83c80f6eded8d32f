"""The command line: one set of engine flags for serve, generate and bench, the LLM class's keywords, and the
default random-weight model that `qwen4exp generate` and `qwen4exp serve` build when no model is given."""

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import fields

import pytest
import torch

from qwen4exp import LLM
from qwen4exp.config import ConfigError, EngineConfig
from qwen4exp.entrypoints.cli import build_parser, main
from qwen4exp.entrypoints.default_model import resolve_model

ENGINE_COMMANDS = [["serve"], ["generate"], ["bench", "latency"], ["bench", "throughput"], ["bench", "multi-turn"]]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a value other than the default for every engine flag
NON_DEFAULT_FLAGS = [
    "--dtype", "half", "--device", "cpu", "--load-format", "dummy", "--max-model-len", "128", "--max-num-seqs", "3",
    "--max-num-batched-tokens", "77", "--page-size", "8", "--gpu-memory-utilization", "0.5", "--cpu-cache-bytes",
    "1000", "--num-pages", "9", "--enforce-eager", "--no-enable-prefix-caching", "--no-async-scheduling",
    "--cuda-graph-sizes", "1", "2", "--seed", "5", "--ple-table-device", "cpu", "--ple-table-dtype", "fp8",
    "--quantization", "fp8", "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}',
    "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--limit-mm-per-prompt", '{"image": 3}',
    "--tensor-parallel-size", "2", "--enable-expert-parallel", "--ple-table-parallel", "rows",
    "--mamba-ssm-cache-dtype", "bfloat16",
]


def subparser(parser: argparse.ArgumentParser, command: list[str]) -> argparse.ArgumentParser:
    for name in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def engine_flags(parser: argparse.ArgumentParser) -> dict:
    names = {f.name for f in fields(EngineConfig)}
    return {a.dest: (tuple(a.option_strings), a.default, a.choices, a.nargs, a.type, type(a).__name__, a.help)
            for a in parser._actions if a.dest in names}


def test_every_engine_command_has_the_same_engine_flags_and_defaults():
    parser = build_parser()
    flags = [engine_flags(subparser(parser, cmd)) for cmd in ENGINE_COMMANDS]
    assert set(flags[0]) == {f.name for f in fields(EngineConfig)}
    assert all(f == flags[0] for f in flags[1:])
    assert flags[0]["max_model_len"][0] == ("--max-model-len",)
    assert flags[0]["async_scheduling"][0] == ("--async-scheduling", "--no-async-scheduling")
    assert flags[0]["dtype"][2] == ("auto", "float32", "float", "bfloat16", "float16", "half")
    for cmd in ENGINE_COMMANDS:  # no flags: EngineConfig's defaults (max_num_seqs 64 in bench too)
        assert EngineConfig.from_cli_args(parser.parse_args(cmd)) == EngineConfig()


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_engine_flags_reach_the_config(command):
    config = EngineConfig.from_cli_args(build_parser().parse_args(command + NON_DEFAULT_FLAGS))
    assert config == EngineConfig(
        dtype="half", device="cpu", load_format="dummy", max_model_len=128, max_num_seqs=3, max_num_batched_tokens=77,
        page_size=8, gpu_memory_utilization=0.5, cpu_cache_bytes=1000, num_pages=9, enforce_eager=True,
        enable_prefix_caching=False, async_scheduling=False, cuda_graph_sizes=[1, 2], seed=5, ple_table_device="cpu",
        ple_table_dtype="fp8",
        quantization="fp8", generation_config="vllm", override_generation_config={"temperature": 0.5},
        speculative_config={"method": "mtp", "num_speculative_tokens": 2}, limit_mm_per_prompt={"image": 3},
        tensor_parallel_size=2, enable_expert_parallel=True, ple_table_parallel="rows",
        mamba_ssm_cache_dtype="bfloat16")
    assert all(getattr(config, f.name) != f.default for f in fields(EngineConfig))


def test_max_model_len_takes_vllm_units(capsys):
    """k, m, g are powers of 1000 and K, M, G powers of 1024 (vLLM's parser); auto and -1 leave it to the model."""
    def parsed(value: str):
        return EngineConfig.from_cli_args(build_parser().parse_args(["serve", "--max-model-len", value])).max_model_len

    assert [parsed(v) for v in ("32k", "32K", "1M", "1m", "25.6k", "4096", "auto", "-1")] == [
        32000, 32768, 2**20, 10**6, 25600, 4096, None, None]
    assert EngineConfig(max_model_len=-1).max_model_len is None
    for bad in ("1.5K", "lots"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--max-model-len", bad])
        assert "--max-model-len" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["make-random"]] + ENGINE_COMMANDS + [["bench", "serve"]], ids=" ".join)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main(command + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qwen4exp")
    if command in ENGINE_COMMANDS:
        assert "--max-model-len" in out and "--no-async-scheduling" in out and "(default: 64)" in out


def test_llm_takes_every_engine_option_and_rejects_unknown_keywords():
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        LLM(foo=1)
    with pytest.raises(TypeError, match="'bar', 'foo'"):
        LLM(max_model_len=64, foo=1, bar=2)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(dtype="int8")


def test_llm_keywords_become_the_engine_config(tmp_path):
    from qwen4exp.weights.random_checkpoint import make_random

    make_random(str(tmp_path), "tiny", dtype="float32")
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cpu", load_format="dummy", max_model_len=64, num_pages=20,
              page_size=8, max_num_seqs=2, seed=3)
    engine = llm.llm_engine
    assert engine.dtype == torch.bfloat16 and engine.device == torch.device("cpu")
    assert (engine.config.max_model_len, engine.config.max_num_seqs, engine.config.seed) == (64, 2, 3)
    assert engine.cache.pages.num_pages == 20


def test_bad_flag_values_name_the_field_before_a_model_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QWEN4EXP_CACHE_DIR", str(tmp_path))
    for argv, field in [(["generate", "--max-model-len", "0"], "max_model_len"),
                        (["bench", "latency", "--num-pages", "-1"], "num_pages"),
                        (["serve", "--gpu-memory-utilization", "2"], "gpu_memory_utilization"),
                        (["serve", "--max-queued-requests", "-1"], "--max-queued-requests"),
                        (["generate", "--dtype", "int8"], "--dtype"),
                        (["serve", "--override-generation-config", "[1]"], "--override-generation-config"),
                        (["serve", "--override-generation-config", '{"temprature": 1}'],
                         "override_generation_config"),
                        (["generate", "--generation-config", str(tmp_path / "none")], "generation_config"),
                        (["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
                         "speculative_config.method"),
                        (["generate", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 9}'],
                         "speculative_config.num_speculative_tokens")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert field in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


def test_interrupted_default_model_build_leaves_nothing(tmp_path, monkeypatch):
    from qwen4exp.weights import random_checkpoint

    def interrupted(out_dir, *args, **kwargs):
        open(os.path.join(out_dir, "config.json"), "w").close()
        raise KeyboardInterrupt

    monkeypatch.setenv("QWEN4EXP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(random_checkpoint, "make_random", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(None)
    assert os.listdir(tmp_path) == []
    assert resolve_model(str(tmp_path / "given")) == str(tmp_path / "given")


def test_python_m_qwen4exp_generate_builds_the_default_model_once(tmp_path):
    """On a fresh machine `python -m qwen4exp generate` needs no checkpoint: the first run builds the random tiny
    model into QWEN4EXP_CACHE_DIR, later runs reuse it."""
    env = {**os.environ, "PYTHONPATH": ROOT, "QWEN4EXP_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "qwen4exp", "generate", "--prompt", "hi", "--max-tokens", "4"]
    runs = []
    for _ in range(2):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        runs.append(out)
        if len(runs) == 1:
            (name,) = os.listdir(tmp_path / "cache")
            # named after the code that writes it: an older version's checkpoint is not reused
            assert re.fullmatch(r"tiny-random-[0-9a-f]{12}", name)
            config = tmp_path / "cache" / name / "config.json"
            built = config.stat().st_mtime_ns
    lines = runs[0].stdout.splitlines()
    assert lines[0] == "--- prompt: 'hi'" and lines[-1] == "--- 4 tokens, finish_reason=length"
    assert runs[1].stdout == runs[0].stdout  # greedy on the same weights
    assert os.listdir(tmp_path / "cache") == [name]
    assert config.stat().st_mtime_ns == built
    path = str(tmp_path / "cache" / name)
    # vLLM's log format: level, month-day time, [file:line], message
    assert re.search(rf"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[default_model\.py:\d+\] no model given: built a "
                     rf"random-weight tiny model in {re.escape(path)} \(its output is gibberish\)", runs[0].stderr,
                     re.MULTILINE), runs[0].stderr
    assert f"using the random-weight tiny model in {path}" in runs[1].stderr


def test_serve_tool_calling_flags(capsys):
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                                      "--reasoning-parser", "qwen3", "--exclude-tools-when-tool-choice-none"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser,
            args.exclude_tools_when_tool_choice_none) == (True, "qwen3_coder", "qwen3", True)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.enable_auto_tool_choice, defaults.tool_call_parser, defaults.reasoning_parser,
            defaults.exclude_tools_when_tool_choice_none) == (False, None, None, False)
    for flags, error in [(["--tool-call-parser", "nope"], "--tool-call-parser"),
                         (["--reasoning-parser", "deepseek"], "--reasoning-parser"),
                         # refused before a model is loaded or built
                         (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser")]:
        with pytest.raises(SystemExit) as e:
            main(["serve", *flags])
        assert e.value.code == 2 and error in capsys.readouterr().err


def test_version(capsys):
    import qwen4exp

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"{qwen4exp.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", qwen4exp.__version__)


def test_serve_on_a_port_in_use_fails_at_once_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import qwen4exp.entrypoints.server  # noqa: F401 - imported ahead, so that the timing is serve's own

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setenv("QWEN4EXP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("qwen4exp.engine.engine.LLMEngine.__init__", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(SystemExit) as e:
            main(["serve", "--host", "127.0.0.1", "--port", str(port)])
        elapsed = time.monotonic() - start
    assert e.value.code == 2 and elapsed < 1.0
    err = capsys.readouterr().err
    assert "--port" in err and f"127.0.0.1:{port}" in err and "in use" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []  # not even the default model was built
