"""The suite's feature stages (qwen4exp/bench/feature_stages.py) on the CPU at the tiny preset's widths, with short
workloads: each records the figures its section of docs/benchmarks.md reads, and the report shows the section with
the stage's command once the results hold them (and nothing without them)."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from qwen4exp.bench import feature_stages, report, suite

CPU = torch.device("cpu")
TINY_ENGINE = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=512)
HEADINGS = {"spec_decode": "## Speculative decoding (MTP)", "prefix_cache": "## Prefix caching: multi-turn chat",
            "vision": "## Images", "structured": "## Structured output"}


def log(*parts) -> None:
    print(*parts)


def page_of(results: suite.Results, stage: str) -> str:
    """The report of `results` as the suite records a stage's run: with its command."""
    results.setdefault("stages", {})[stage] = {"command": f"qwen4exp bench suite --stages {stage}", "commit": "abc1234"}
    page = report.render(results, suite.RESULTS_NAME)
    assert HEADINGS[stage] in page
    assert f"(`qwen4exp bench suite --stages {stage}`, commit abc1234)" in page
    return page


def test_the_feature_sections_render_nothing_without_their_results():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", suite.RESULTS_NAME)) as f:
        results = json.load(f)
    assert all(heading in report.render(results, suite.RESULTS_NAME) for stage, heading in HEADINGS.items()
               if stage in results)
    for stage in HEADINGS:
        results.pop(stage, None)
    page = report.render(results, suite.RESULTS_NAME)
    assert not any(heading in page for heading in HEADINGS.values())


def test_spec_decode_records_acceptance_step_cost_and_projection():
    """Its two parts run as stages of their own (as on a GPU with minutes a call); the projection comes once both
    are in the results, and the section names each part's command."""
    results = suite.Results(None)
    feature_stages.stage_spec_trained(results, CPU, log, steps=1, seconds=None, corpus_chars=200_000, batch=2,
                                      seq_len=64, prompts=3, prompt_len=24, output_len=8, ks=(1, 2))
    assert "projection" not in results["spec_decode"]
    results["stages"] = {"spec_trained": {"command": "qwen4exp bench suite --stages spec_trained", "commit": "abc"}}
    page = report.render(results, suite.RESULTS_NAME)  # the trained model's rows before the step costs are in
    speedups = " | ".join(f"{'**' * (k == 1)}{results['spec_decode']['trained']['k'][str(k)]['speedup_vs_k0']:.2f}x"
                          f"{'**' * (k == 1)}" for k in (1, 2))
    assert f"| ... speedup over k = 0 | >= 1.4x at k = 1 | | {speedups} |" in page
    assert "commit abc" in page and "batch-1 TPOT" not in page
    feature_stages.stage_spec_dummy(results, CPU, log, preset="tiny", engine_options=TINY_ENGINE, input_len=16,
                                    output_len=8, iters=1, concurrency=2, concurrent_input_len=16,
                                    concurrent_output_len=4, ks=(1, 2))
    data = results["spec_decode"]
    trained, dummy, projection = data["trained"], data["dummy"], data["projection"]
    assert trained["training"]["steps"] == 1 and trained["prompts"] == 2
    assert set(trained["k"]) == {"0", "1", "2"} and len(trained["k"]["0"]["tpot_ms"]) == 2
    # k = 0 runs first and again last (the figure the speedups are taken against)
    assert trained["k"]["0"]["first_engine_median_tpot_ms"] > 0
    for k in (1, 2):
        r = trained["k"][str(k)]
        rates = r["per_position_acceptance"]
        # a draft token counts at its position only after every earlier one was accepted
        assert len(rates) == k and all(1 >= a >= b >= 0 for a, b in zip(rates, rates[1:] + [0]))
        assert r["acceptance_length"] == pytest.approx(1 + sum(rates))
        assert r["acceptance_rate"] == pytest.approx(sum(rates) / k, abs=0.2)  # drafts near max_tokens are shorter
        assert r["speedup_vs_k0"] == pytest.approx(trained["k"]["0"]["median_tpot_ms"] / r["median_tpot_ms"])
        assert r["chained_share"] == 0  # steps chain only on the CUDA graphs
    assert "| ... steps chained (launched before the step before is read) | | | 0% | 0% |" in page
    assert set(dummy["k"]) == {"0", "1", "2"}
    for k, r in dummy["k"].items():
        assert r["step_ms"] == pytest.approx(r["median_tpot_ms"] * r["acceptance_length"])
        assert r["step_over_k0"] == pytest.approx(r["step_ms"] / dummy["k"]["0"]["step_ms"])
        assert ("concurrent_tok_s" in r) == (k in ("0", "1"))
    assert dummy["k"]["0"]["acceptance_length"] == 1.0
    assert dummy["k"]["1"]["concurrent"]["spec_decode_num_drafts"] > 0
    for k in ("1", "2"):
        p = projection["k"][k]
        assert p["tok_s"] == pytest.approx(1000 * trained["k"][k]["acceptance_length"] / dummy["k"][k]["step_ms"])
        assert p["speedup_vs_k0"] == pytest.approx(p["tok_s"] / projection["k0_tok_s"])
    results["stages"] = {"spec_trained": {"command": "qwen4exp bench suite --stages spec_trained", "commit": "abc"},
                         "spec_dummy": {"command": "qwen4exp bench suite --stages spec_dummy", "commit": "def"}}
    page = report.render(results, suite.RESULTS_NAME)
    assert ("(`small`: `qwen4exp bench suite --stages spec_trained`, commit abc; `tiny`: `qwen4exp bench suite "
            "--stages spec_dummy`, commit def)") in page
    for part in ("trained", "dummy"):
        data[part]["stage"] = "spec_decode"
    page = page_of(results, "spec_decode")
    ratio = f"**{dummy['k']['1']['step_over_k0']:.3f}**"
    assert f"| ... step time (TPOT x tokens per step) / decode step | <= 1.15 at k = 1 | 1.000 | {ratio} |" in page
    assert "projection at the trained model's acceptance" in page


def test_prefix_cache_records_each_turn_both_ways():
    results = suite.Results(None)
    feature_stages.stage_prefix_cache(results, CPU, log, "tiny", TINY_ENGINE,
                                      dict(num_conversations=2, num_turns=3, system_len=40, turn_len=8, output_len=4,
                                           decode_output_len=4))
    data = results["prefix_cache"]
    assert len(data["cached"]) == len(data["uncached"]) == 3
    assert all(t["cached_tokens"] > 0 for t in data["cached"][1:])  # each later turn extends the one before
    assert all(t["cached_tokens"] == 0 for t in data["uncached"])
    assert data["decode_cached_over_uncached"] == pytest.approx(data["decode_cached"] / data["decode_uncached"])
    page = page_of(results, "prefix_cache")
    assert f"| turn-3 median TTFT, off / on | >= 5x | **{data['last_turn_ttft_speedup']:.1f}x** (" in page
    assert "| single-request decode speed, on / off | 0.98 - 1.02 |" in page


def test_vision_compares_the_image_request_with_text_of_its_length():
    results = suite.Results(None)
    feature_stages.stage_vision(results, CPU, log, "tiny", TINY_ENGINE, image_side=128, text_len=8, output_len=4,
                                runs=1, encode_runs=1)
    data = results["vision"]
    t, h, w = data["grid_thw"]
    assert (t, h, w) == (1, 8, 8) and data["image_tokens"] == 16  # patches of 16 pixels, 2 x 2 merged
    assert data["image"]["prompt_tokens"] == data["text_same_len"]["prompt_tokens"] == 8 + 2 + 16
    assert data["text"]["prompt_tokens"] == 8
    assert all(data[k]["ttft_ms"] > 0 and data[k]["tpot_ms"] > 0 for k in ("image", "text", "text_same_len"))
    assert data["preprocess_ms"] > 0 and data["encode_ms"] > 0
    page = page_of(results, "vision")
    assert "| text of as many tokens as with the image | 26 |" in page


def test_structured_alternates_free_and_constrained_runs():
    results = suite.Results(None)
    feature_stages.stage_structured(results, CPU, log, "tiny", TINY_ENGINE, num_prompts=4, input_len=16,
                                    output_len=8, repeats=2)
    data = results["structured"]
    assert [r["num_structured"] for r in data["runs"]] == [0, 1, 0, 1]
    free = sorted(r["output_throughput"] for r in data["runs"][::2])
    assert data["free_tok_s"] == pytest.approx(sum(free) / 2)
    assert data["constrained_over_free"] == pytest.approx(data["constrained_tok_s"] / data["free_tok_s"])
    page = page_of(results, "structured")
    assert f"| output tok/s, 1 constrained / all free (medians) | >= 0.90 | **{data['constrained_over_free']:.3f}**" \
        in page


def test_the_spec_decode_command_records_the_training_options():
    p = argparse.ArgumentParser()
    suite.add_suite_arguments(p)
    args = p.parse_args(["--train-seconds", "60"])
    command = "qwen4exp bench suite --stages"
    assert suite.canonical_command(args, ["spec_decode"]) == f"{command} spec_decode --train-seconds 60"
    assert suite.canonical_command(args, ["vision", "structured"]) == f"{command} vision,structured"
