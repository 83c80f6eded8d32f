"""The benchmarks' CPU-checkable parts: the suite's command line and report (docs/benchmarks.md is generated from
docs/benchmarks_results.json and must equal what the report makes of it), the timing and roofline helpers,
transformers pointed at the engine's tensors, and every kernel benchmark run at tiny widths in the interpreter."""

from __future__ import annotations

import glob
import json
import os
import runpy
import sys

import pytest
import torch

from qwen4exp.bench import report, suite
from qwen4exp.bench.roofline import decode_bytes, roofline_fraction
from qwen4exp.bench.timing import (
    GRAPH_MAX_TOKENS,
    Rotation,
    copies_out_of_l2,
    in_graph,
    max_abs_diff,
    time_per_call_us,
)
from qwen4exp.entrypoints.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
RESULTS = os.path.join(DOCS, suite.RESULTS_NAME)
KERNEL_BENCHMARKS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "kernels", "bench_*.py")))


def committed_results() -> dict:
    with open(RESULTS) as f:
        return json.load(f)


# ---- the page and its data ----

def test_benchmarks_page_is_the_report_of_the_committed_results():
    with open(os.path.join(DOCS, report.PAGE)) as f:
        page = f.read()
    assert page == report.render(committed_results(), suite.RESULTS_NAME), (
        "docs/benchmarks.md differs from its results: run `qwen4exp bench suite --stages report --results "
        "docs/benchmarks_results.json --out docs`")
    assert page.count("\n") <= 180  # a section per measured feature, each short enough to read in one sitting


def test_report_stage_writes_the_page_and_plot_and_leaves_the_results_alone(tmp_path, capsys):
    with open(RESULTS, "rb") as f:
        before = f.read()
    main(["bench", "suite", "--stages", "report", "--results", RESULTS, "--out", str(tmp_path)])
    with open(RESULTS, "rb") as f:
        assert f.read() == before
    with open(os.path.join(DOCS, report.PAGE)) as f:
        assert (tmp_path / report.PAGE).read_text() == f.read()
    assert (tmp_path / report.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_partial_results_leaves_out_what_was_not_measured():
    results = committed_results()
    partial = {"stages": {"agree_trained": results["stages"]["agree_trained"]},
               "agree_trained": results["agree_trained"]}
    page = report.render(partial, suite.RESULTS_NAME)
    assert "99.15%" in page and "## Agreement with the fp32 reference" in page
    assert "## Throughput vs concurrency" not in page and "host memory" not in page


def test_every_figure_of_the_page_has_the_command_that_produced_it():
    results = committed_results()
    page = report.render(results, suite.RESULTS_NAME)
    for stage in ("ours", "hf", "agree_trained", "throughput_cli", "table_on_host"):
        assert f"`{results['stages'][stage]['command']}`" in page, stage
        assert results["stages"][stage]["command"].startswith("qwen4exp bench suite --stages ")


def test_recorded_roofline_fraction_is_bytes_over_bandwidth_over_step_time():
    ours = committed_results()["ours"]
    fraction = roofline_fraction(ours["decode_b1_bytes_per_step"], ours["copy_bandwidth_GBs"] * 1e9,
                                 ours["decode_b1"]["median_tpot_ms"] / 1e3)
    assert fraction == pytest.approx(ours["decode_b1_roofline_fraction"], rel=1e-12)


# ---- the suite's command line ----

def test_suite_help_lists_the_stages(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "suite", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for stage in suite.STAGES:
        assert stage in out
    for flag in ("--stages", "--out", "--results", "--quick", "--train-seconds"):
        assert flag in out


@pytest.mark.parametrize("stages, message", [("ours,speed", "unknown stage"), ("hf,ours", "ours before hf"),
                                             ("hf", "ours before hf")])
def test_suite_rejects_bad_stages_naming_the_flag(stages, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "suite", "--stages", stages, "--out", "unused"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--stages" in err and message in err


def test_recorded_command_names_the_stages_and_the_options_that_change_a_measurement():
    p = __import__("argparse").ArgumentParser()
    suite.add_suite_arguments(p)
    args = p.parse_args(["--out", "somewhere", "--train-seconds", "60"])
    assert suite.canonical_command(args, ["ours", "hf"]) == "qwen4exp bench suite --stages ours,hf"
    assert (suite.canonical_command(args, ["agree_trained"])
            == "qwen4exp bench suite --stages agree_trained --train-seconds 60")
    args = p.parse_args(["--quick"])
    assert suite.canonical_command(args, ["ours"]) == "qwen4exp bench suite --stages ours --quick"


def test_throughput_cli_command_parses_as_bench_throughput():
    from qwen4exp.entrypoints.cli import build_parser

    command = suite.throughput_cli_command("MODEL", "out.json")
    assert command[:3] == [sys.executable, "-m", "qwen4exp.entrypoints.cli"]
    args = build_parser().parse_args(command[3:])
    assert (args.bench_command, args.model, args.load_format, args.num_prompts, args.input_len, args.output_len,
            args.max_num_seqs) == ("throughput", "MODEL", "dummy", 64, 1024, 256, 64)


# ---- timing and roofline helpers ----

def test_time_per_call_makes_the_calls_it_reports_on_the_cpu():
    count = [0]

    def fn():
        count[0] += 1

    us = time_per_call_us(fn, calls=3, graph=True, reps=4, device="cpu")
    assert us > 0 and count[0] == 1 + 3 * 4
    count[0] = 0
    time_per_call_us(fn, calls=2, graph=False, reps=5, device="cpu", warm_up=False)
    assert count[0] == 10


def test_operand_copies_fill_the_l2_flush_budget_but_no_more_than_a_round_reads():
    assert copies_out_of_l2(100 << 20, calls=48) == 3  # 300 MB >= 256 MB
    assert copies_out_of_l2(1 << 20, calls=48) == 48  # a round reads 48
    assert copies_out_of_l2(1 << 20, calls=1) == 4
    assert copies_out_of_l2(2 << 30, calls=48) == 1


def test_rotation_cycles_and_rewinds():
    r = Rotation(["a", "b", "c"])
    assert [r.next() for _ in range(4)] == ["a", "b", "c", "a"]
    r.rewind()
    assert r.next() == "a"
    with pytest.raises(ValueError, match="items"):
        Rotation([])


def test_max_abs_diff_counts_equal_infinities_as_equal():
    a = torch.tensor([1.0, float("-inf"), 3.0])
    assert max_abs_diff(a, torch.tensor([1.5, float("-inf"), 3.0])) == 0.5
    assert max_abs_diff((a, None, a), (a + 2, torch.zeros(1), a)) == 2.0
    assert max_abs_diff(torch.zeros(0), torch.zeros(0)) == 0.0


def test_graph_sizes_follow_the_engine():
    from qwen4exp.engine.cuda_graph import MIXED_GRAPH_TOKENS

    assert GRAPH_MAX_TOKENS == max(MIXED_GRAPH_TOKENS)
    assert in_graph(1) and in_graph(GRAPH_MAX_TOKENS) and not in_graph(GRAPH_MAX_TOKENS + 1)


def test_decode_bytes_reads_routed_experts_only_and_the_context_up_to_the_qsa_selection():
    from qwen4exp.bench.engines import preset_model_config
    from qwen4exp.model import Qwen4ExpForCausalLM

    cfg = preset_model_config("tiny", dtype="float32")
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(cfg)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    attention_layers = cfg.num_hidden_layers - cfg.layer_types.count("linear_attention")
    per_token = attention_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    selection = cfg.indexer_budget + cfg.indexer_compress_ratio - 1
    assert decode_bytes(model, 10) - decode_bytes(model, 9) == per_token
    assert decode_bytes(model, selection + 100) == decode_bytes(model, selection)
    assert decode_bytes(model, 1) < params - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts) + 1e6


# ---- transformers on the engine's tensors ----

def test_transformers_pointed_at_the_engine_tensors_computes_transformers_logits():
    """stage_hf's mapping: transformers built on the meta device and pointed at our engine's tensors by name gives
    the logits transformers gives on the weights it was built with, holding the engine's storage (no copy)."""
    from helpers import hf_config, hf_model, our_llm
    from transformers import Qwen4ExpForCausalLM

    cfg = hf_config()
    original = hf_model(cfg)
    engine_model = our_llm(original).llm_engine.model
    with torch.device("meta"):
        pointed = Qwen4ExpForCausalLM(cfg)
    suite.point_at_engine_tensors(pointed, engine_model)
    storages = {p.untyped_storage().data_ptr() for p in engine_model.parameters()}
    assert all(p.untyped_storage().data_ptr() in storages for p in pointed.parameters())
    ids = torch.randint(2, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(pointed.eval()(ids).logits, original(ids).logits, atol=1e-4, rtol=1e-4)


# ---- agreement ----

@pytest.mark.slow
def test_agreement_counts_every_position_and_bf16_flips_only_near_ties():
    """top1_agreement with the CPU standing in for the GPU: the bf16 engine stepping one token at a time after the
    prefill (as graph decode does) against the fp32 and the bf16 engine over whole sequences."""
    from qwen4exp.bench.agreement import top1_agreement
    from qwen4exp.bench.engines import preset_model_config
    from qwen4exp.config import EngineConfig
    from qwen4exp.engine.engine import LLMEngine
    from qwen4exp.model.merged_linear import named_checkpoint_tensors

    cfg = preset_model_config("tiny", dtype="float32")
    dummy = LLMEngine(None, EngineConfig(max_model_len=1024, num_pages=80, page_size=16, max_num_seqs=1,
                                         dtype="float32", device="cpu", load_format="dummy"),
                      model_config=cfg, tokenizer=None)
    weights = {t.name: t.tensor for t in named_checkpoint_tensors(dummy.model)}
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(10, cfg.vocab_size, (48,), generator=g).tolist() for _ in range(2)]
    r = top1_agreement(cfg, weights, seqs, torch.device("cpu"), prefill=32)
    assert (r["positions"], r["graph_decode_positions"], r["nonfinite_logits"]) == (96, 32, 0)
    assert r["gpu_vs_cpu_bf16_top1_agreement"] >= 0.95
    assert 0.9 <= r["top1_agreement"] < 1.0
    assert r["ref_top2_gap_max_where_top1_differs"] < r["ref_top2_gap_median"]


# ---- the kernel benchmarks and the step profiler ----

def run_script(path: str, argv: list[str], monkeypatch):
    monkeypatch.setattr(sys, "argv", [path, *argv])
    runpy.run_path(path, run_name="__main__")


@pytest.mark.parametrize("path", KERNEL_BENCHMARKS + [os.path.join(ROOT, "benchmarks", "profile_step.py")],
                         ids=os.path.basename)
def test_benchmark_help(path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_script(path, ["--help"], monkeypatch)
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_a_kernel_benchmark_for_every_op_family():
    names = {os.path.basename(p)[len("bench_"):-len(".py")] for p in KERNEL_BENCHMARKS}
    assert names == {"attention", "conv", "fp8", "gated_delta", "hyper_connection", "linear", "moe", "norm", "qsa",
                     "sampler", "table_gather"}


@pytest.mark.slow
@pytest.mark.parametrize("path", KERNEL_BENCHMARKS, ids=os.path.basename)
def test_kernel_benchmark_variants_agree_at_tiny_widths(path, tmp_path, monkeypatch, capsys):
    """Each benchmark at the tiny preset's widths in fp32, its Triton kernels in the interpreter: every
    implementation it times returns what its case's first one (the reference) returns."""
    out = tmp_path / "rows.json"
    tokens = "1" if path.endswith("bench_linear.py") else "1,2"  # the interpreted GEMV is slow
    run_script(path, ["--tiny", "--tokens", tokens, "--json", str(out)], monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert rows
    for row in rows:
        timed = [k for k in row if k.endswith("_us")]
        assert timed and all(row[k] > 0 for k in timed), row
        for k in row:
            if k.endswith("_diff") and row[k] is not None:
                assert row[k] <= 1e-5, (row["case"], row["tokens"], k, row[k])
    assert "tokens" in capsys.readouterr().out


# ---- fp8 ----

def test_fp8_against_bf16_reports_agreement_and_perplexity_on_the_cpu():
    """The agree_fp8 stage's comparison, on the CPU: the same weights in bf16 and quantized to fp8 on load give
    finite logits, every position counted, and an fp8 perplexity close to bf16's."""
    from qwen4exp.bench.engines import preset_model_config
    from qwen4exp.bench.fp8_stages import fp8_against_bf16
    from qwen4exp.config import EngineConfig
    from qwen4exp.engine.engine import LLMEngine
    from qwen4exp.model.merged_linear import named_checkpoint_tensors

    cfg = preset_model_config("small", dtype="float32")
    dummy = LLMEngine(None, EngineConfig(max_model_len=1024, num_pages=80, max_num_seqs=1, dtype="float32",
                                         device="cpu", load_format="dummy"), model_config=cfg, tokenizer=None)
    weights = {t.name: t.tensor.clone() for t in named_checkpoint_tensors(dummy.model)}
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(10, cfg.vocab_size, (64,), generator=g).tolist() for _ in range(2)]
    r = fp8_against_bf16(cfg, weights, seqs, torch.device("cpu"))
    assert r["positions"] == 126 and r["bf16_nonfinite"] == r["fp8_nonfinite"] == 0
    assert 0.7 <= r["fp8_vs_bf16_top1_agreement"] < 1.0  # random weights: near ties flip, most do not
    assert abs(r["perplexity_fp8_over_bf16"] - 1) < 0.05


def test_the_page_reports_the_fp8_stages_when_the_results_hold_them():
    from qwen4exp.bench.report import render

    with open(os.path.join(DOCS, "benchmarks_results.json")) as f:
        results = json.load(f)
    flash = {"preset": "flash-next", "engine": {"max_model_len": 32768, "max_num_seqs": 32}, "startup_s": 250.0,
             "gpu_weights_GiB": 119.0, "decode_b1_tok_s": 210.0, "concurrency_32_tok_s": 1300.0,
             "prefill_8k_tok_s": 15000.0, "max_concurrent_at_max_model_len": 9, "cache_pages": 19000,
             "page_size": 16}
    page = render(results | {"flash_next": flash}, "benchmarks_results.json")
    assert "| batch-1 decode (128 in / 128 out), tok/s | >= 200 | **210.0** |" in page
    without = {k: v for k, v in results.items() if k != "flash_next"}
    assert "## The released shape in fp8 on one GPU" not in render(without, "benchmarks_results.json")
    agree = {"fp8_vs_bf16": {"positions": 3066, "fp8_vs_bf16_top1_agreement": 0.969, "perplexity_fp8_over_bf16": 1.003,
                             "fp8_perplexity": 9.33, "bf16_perplexity": 9.30, "fp8_nonfinite": 0},
             "gpu_fp8_vs_cpu_fp8": {"top1_agreement": 0.972, "cpu_bf16_reference_top1_agreement": 0.9723,
                                    "nonfinite_logits": 0}}
    page = render(results | {"agree_fp8": agree}, "benchmarks_results.json")
    assert "| fp8 vs bf16 top-1 agreement | >= 98% | **96.90%** |" in page
    assert "vs the same reference: bf16 arithmetic alone | | 97.23% |" in page
    # a stage measured on another GPU than the setup's says so
    ran = "`qwen4exp bench suite --stages agree_fp8`, commit abc1234"
    for gpu, says in ((results["stages"]["ours"]["env"]["gpu"], ran + ")"),
                      ("NVIDIA H100 80GB HBM3", ran + ", on one NVIDIA H100 80GB HBM3)")):
        stages = results["stages"] | {"agree_fp8": {"command": "qwen4exp bench suite --stages agree_fp8",
                                                    "commit": "abc1234", "env": {"gpu": gpu}}}
        assert says in render(results | {"agree_fp8": agree, "stages": stages}, "benchmarks_results.json")


# ---- bench latency, throughput and serve: vLLM's result keys ----

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from qwen4exp.weights.random_checkpoint import make_random

    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32")


def test_bench_latency_and_throughput_write_vllms_keys(tiny_dir, tmp_path, capsys):
    engine = ["--model", tiny_dir, "--device", "cpu", "--max-model-len", "64", "--input-len", "5",
              "--output-len", "3"]
    main(["bench", "latency", *engine, "--num-iters", "2", "--output-json", str(tmp_path / "latency.json")])
    latency = json.loads((tmp_path / "latency.json").read_text())
    assert latency["model_id"] == tiny_dir and len(latency["latencies"]) == 2
    assert latency["avg_latency"] == pytest.approx(sum(latency["latencies"]) / 2)
    assert set(latency["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(latency["latencies"]) <= latency["percentiles"]["50"] <= max(latency["latencies"])
    assert latency["median_tpot_ms"] > 0  # what the suite reads
    main(["bench", "throughput", *engine, "--num-prompts", "3", "--output-json", str(tmp_path / "throughput.json")])
    throughput = json.loads((tmp_path / "throughput.json").read_text())
    assert (throughput["num_requests"], throughput["total_num_tokens"]) == (3, 3 * (5 + 3))
    assert throughput["elapsed_time"] == throughput["duration_s"] > 0
    assert throughput["requests_per_second"] == pytest.approx(3 / throughput["elapsed_time"])
    assert throughput["tokens_per_second"] == pytest.approx(3 * 8 / throughput["elapsed_time"])
    assert throughput["output_throughput"] > 0 and throughput["median_itl_ms"] > 0  # what the suite reads
    out, decoder = capsys.readouterr().out, json.JSONDecoder()
    printed, end = decoder.raw_decode(out)
    assert (printed, decoder.raw_decode(out[end:].lstrip())[0]) == (latency, throughput)  # printed as well


def test_bench_reports_the_acceptance_of_speculative_decoding(tiny_dir, tmp_path):
    """With --speculative-config, latency and throughput results carry vLLM's spec_decode keys; without, none."""
    engine = ["--model", tiny_dir, "--device", "cpu", "--max-model-len", "64", "--input-len", "5", "--output-len", "6",
              "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    main(["bench", "latency", *engine, "--num-iters", "1", "--output-json", str(tmp_path / "latency.json")])
    main(["bench", "throughput", *engine, "--num-prompts", "2", "--output-json", str(tmp_path / "throughput.json")])
    for name, requests in (("latency", 1), ("throughput", 2)):
        result = json.loads((tmp_path / f"{name}.json").read_text())
        # each request drafts after its first token, twice per step while 2 drafts fit before the 6th token
        assert result["spec_decode_num_drafts"] >= requests * 2
        drafts, tokens = result["spec_decode_num_drafts"], result["spec_decode_draft_tokens"]
        accepted = result["spec_decode_accepted_tokens"]
        assert drafts <= tokens <= 2 * drafts and 0 <= accepted <= tokens
        assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / tokens)
        assert result["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert len(result["spec_decode_per_position_acceptance_rates"]) == 2
    main(["bench", "latency", *engine[:-2], "--num-iters", "1", "--output-json", str(tmp_path / "plain.json")])
    assert not any(k.startswith("spec_decode") for k in json.loads((tmp_path / "plain.json").read_text()))


def failing_server():
    """An OpenAI completions endpoint whose requests, in arrival order, cycle through: a stream of 3 tokens with
    its usage, an HTTP 503, an error event in the stream, a connection closed mid-stream."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    count = [0]

    async def completions(request):
        body = await request.json()
        kind = count[0] % 4
        count[0] += 1
        if kind == 1:
            return JSONResponse({"error": {"message": "overloaded", "type": "ServiceUnavailableError",
                                           "param": None, "code": 503}}, status_code=503)

        async def events():
            if kind == 2:
                yield 'data: {"error": {"message": "engine step failed", "code": 500}}\n\n'
            else:
                for _ in range(3):
                    yield 'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n'
                    if kind == 3:
                        raise RuntimeError("connection lost")
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 3, "total_tokens": 0}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "flaky", "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])


def test_bench_serve_counts_failed_requests_and_goes_on(tmp_path, capsys):
    from helpers import serve_on_loopback

    with serve_on_loopback(failing_server(), log_level="critical") as url:
        main(["bench", "serve", "--base-url", url, "--num-prompts", "8", "--max-concurrency", "1",
              "--input-len", "4", "--output-len", "3", "--metric-percentiles", "50,99", "--save-result",
              "--result-dir", str(tmp_path / "results"), "--result-filename", "flaky.json"])
    result = json.loads((tmp_path / "results" / "flaky.json").read_text())
    assert result["model_id"] == "flaky"  # the server's first model
    assert (result["completed"], result["failed"]) == (2, 6)
    errors = dict(result["error_summary"])
    assert errors.pop("HTTP 503: overloaded") == 2 and errors.pop("error event: engine step failed") == 2
    ((message, count),) = errors.items()
    assert count == 2 and "RemoteProtocolError" in message
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (2 * 4, 2 * 3)
    assert result["output_throughput"] == pytest.approx(6 / result["duration"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p50_{metric}_ms",
                f"p99_{metric}_ms"} <= set(result)
    assert "ttfts" not in result  # per-request lists only with --save-detailed
    assert not any(k.startswith("spec_decode") for k in result)  # no /metrics here: no speculation keys
    assert json.loads(capsys.readouterr().out) == result


def speculating_server():
    """A completions endpoint whose /metrics exports vLLM's spec_decode counters as a server with k = 2 drafts
    does (two label sets, `_created` series beside the `_total` ones); each request adds 2 verified drafts of 2
    tokens: 3 accepted, 2 at the first position and 1 at the second."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    served = [5]  # counted before the run starts: the run's figures are what it adds

    async def completions(request):
        body = await request.json()
        served[0] += 1

        async def events():
            yield 'data: {"choices": [{"index": 0, "text": "x", "finish_reason": null}]}\n\n'
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1, "total_tokens": 0}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(request):
        n, lines = served[0], []
        for engine in ("0", "1"):  # each engine served half
            labels = f'engine="{engine}",model_name="m"'
            for name, per_request in (("num_drafts", 1), ("num_draft_tokens", 2), ("num_accepted_tokens", 1.5)):
                lines += [f"vllm:spec_decode_{name}_total{{{labels}}} {n * per_request}",
                          f"vllm:spec_decode_{name}_created{{{labels}}} 1.7e9"]
            for pos, per_request in ((0, 1), (1, 0.5)):
                lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{pos}"}} '
                             f"{n * per_request}")
        return PlainTextResponse("\n".join(["# HELP vllm:spec_decode_num_drafts Number of drafts."] + lines))

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/metrics", metrics)])


def test_bench_serve_reports_the_runs_speculative_decoding_as_vllm(tmp_path):
    from helpers import serve_on_loopback

    with serve_on_loopback(speculating_server(), log_level="critical") as url:
        main(["bench", "serve", "--base-url", url, "--model", "m", "--num-prompts", "4", "--input-len", "4",
              "--output-len", "1", "--output-json", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    # 4 requests x 2 engines: 8 drafts of 2 tokens, 12 accepted (8 at the first position, 4 at the second)
    assert (result["spec_decode_num_drafts"], result["spec_decode_draft_tokens"],
            result["spec_decode_accepted_tokens"]) == (8, 16, 12)
    assert result["spec_decode_acceptance_rate"] == pytest.approx(75.0)
    assert result["spec_decode_acceptance_length"] == pytest.approx(2.5)
    assert result["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.5])


def test_bench_serve_rejects_unknown_percentile_metrics(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--percentile-metrics", "ttft,goodput"])
    assert e.value.code == 2 and "--percentile-metrics" in capsys.readouterr().err


def test_repeated_benchmark_runs_of_the_same_prompts_find_nothing_cached(tiny_dir):
    """A timed run starts from an empty prefix cache, as a fresh server would: the second of two throughput runs
    over the same prompts must prefill them again, not find them cached."""
    from qwen4exp.bench.offline import throughput
    from qwen4exp.config import EngineConfig
    from qwen4exp.engine.engine import LLMEngine

    engine = LLMEngine(tiny_dir, EngineConfig(max_model_len=256, device="cpu", enable_prefix_caching=True))
    hits = [engine.metrics.total("vllm:prefix_cache_hits_total")]
    for _ in range(2):
        throughput(engine, 4, 80, 2)
        hits.append(engine.metrics.total("vllm:prefix_cache_hits_total"))
    assert engine.metrics.total("vllm:prefix_cache_queries_total") > 0
    assert hits[2] == hits[1] == hits[0]
