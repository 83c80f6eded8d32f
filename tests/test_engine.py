"""Continuous batching: chunked prefill, preemption and arrival over time leave outputs unchanged and the cache
empty."""

import random

import pytest
import torch
from helpers import run_arriving

from qwen4exp import LLM, SamplingParams
from qwen4exp.weights.random_checkpoint import make_random


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=1)


def alone(model_dir, prompts, params):
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, num_pages=64, page_size=8,
              max_num_batched_tokens=256, max_num_seqs=1)
    return [llm.generate([{"prompt_token_ids": p}], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]


def test_batched_with_preemption_equals_one_at_a_time(tiny_dir):
    rng = random.Random(0)
    n = 32
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 70))] for _ in range(n)]
    params = []
    for i in range(n):
        seed = i if i % 3 == 0 else None
        greedy = seed is None
        params.append(SamplingParams(temperature=0.0 if greedy else 0.9, top_k=0 if greedy else 40, seed=seed,
                                     max_tokens=rng.randrange(1, 25), ignore_eos=True))
    expected = alone(tiny_dir, prompts, params)

    # small budgets: chunked prefill (24 tokens/step) and too few pages for everyone (forces preemption)
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=256, num_pages=40, page_size=8,
              max_num_batched_tokens=24, max_num_seqs=12)
    engine = llm.llm_engine
    outputs = run_arriving(engine, prompts, params, rng, max_arrivals=3)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert any(o.metrics["num_preemptions"] for o in outputs.values())
    for i in range(n):
        assert outputs[i].outputs[0].token_ids == expected[i].outputs[0].token_ids, f"request {i} ({params[i]})"
    assert engine.cache.all_free()
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_abort_frees_cache_at_any_time(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=256, num_pages=40, page_size=8,
              max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.llm_engine
    for i in range(6):
        engine.add_request(str(i), {"prompt_token_ids": list(range(3, 40 + i))}, SamplingParams(max_tokens=30))
    for step in range(12):
        engine.step()
        engine.abort_request(str(step % 6))
    engine.abort_request("0")
    for i in range(6):
        engine.abort_request(str(i))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache.all_free()
    assert engine.num_unfinished_requests == 0


def test_warm_up_runs_the_full_step_budget_beyond_max_model_len(tiny_dir):
    """A step budget larger than max_model_len is reached by several prompts at once in serving, so the warm-up
    runs that step size too (as several prompts); otherwise its kernels compile in the middle of serving."""
    from qwen4exp.engine.warmup import warm_up

    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=40, num_pages=64, page_size=8,
              max_num_batched_tokens=200, max_num_seqs=8)
    engine = llm.llm_engine
    config, steps, schedule = engine.scheduler.config, [], engine.scheduler.schedule

    def recorded(*args):
        assert engine.scheduler.config is config, "the warm-up passes its step budgets, it does not set them"
        steps.append(schedule(*args))
        return steps[-1]
    engine.scheduler.schedule = recorded
    mixed_graphs, execute = [], engine.runner.execute
    engine.runner.execute = lambda chunks, pending, mixed, **kw: mixed_graphs.append(mixed) or execute(chunks, pending,
                                                                                                      mixed, **kw)
    warm_up(engine)
    # the other rounds' prompts (5-300 tokens, cut to 36) make steps of at most 113 tokens
    assert max(s.num_tokens for s in steps) == 200
    # the full budget comes first: fla's chunk kernels autotune once, on their first call, and keep that choice
    # (tuned on a 64-token step their solve took 3x longer at 16 x 1k tokens on an H200)
    assert steps[0].num_tokens == 200
    assert [len(s.scheduled) for s in steps if s.num_tokens == 200] == [6]  # 5 x 36 + 20 prompt tokens
    assert engine.cache.all_free() and engine.scheduler.config.max_num_batched_tokens == 200
    # its prefill steps run eagerly where mixed-step graphs would take them: the steps they leave eager compile here
    assert mixed_graphs and not any(mixed_graphs)


def test_warm_up_rounds_run_each_kernel_size_largest_first_within_the_cache():
    """The warm-up's steps: every token count at which a MoE or GDN kernel choice changes, up to the full budget,
    largest first, each as prompts of at most max_model_len - 4 tokens; the full step shrinks (by pages) until its
    prompts fit the cache; then two small-budget rounds of short prompts and one past the QSA budget."""
    from helpers import hf_config

    from qwen4exp import ops
    from qwen4exp.config import EngineConfig, ModelConfig
    from qwen4exp.engine.warmup import MAX_TOKENS, warm_up_rounds

    # fla's l2norm buckets every 32 tokens: several sizes within the budget
    mc = ModelConfig.from_hf(hf_config(linear_num_key_heads=2048, linear_num_value_heads=2048))
    config = EngineConfig(max_model_len=300, max_num_batched_tokens=200, max_num_seqs=8, page_size=8)

    def pages(lengths):
        return sum(-(-(n + MAX_TOKENS) // 8) for n in lengths)

    for usable in (400, 20):
        rounds = warm_up_rounds(config, mc, usable)
        *sized, small, large = rounds
        full = sized[0][0]
        assert pages(sized[0][1]) <= usable
        if usable == 400:
            assert full == 200
        else:
            assert full < 200 and pages([full + 8]) > usable  # the largest step (by pages) that fits
        expected = ({full} | set(ops.moe.warm_up_token_counts(mc.num_experts, mc.num_experts_per_tok, full))
                    | set(ops.gated_delta.warm_up_token_counts(mc.linear_num_key_heads, full))) - {1}
        assert [b for b, _ in sized] == sorted(expected, reverse=True)
        assert all(sum(lengths) == b and max(lengths) <= 296 for b, lengths in sized)
        short = [5, 100, 37, 296]
        past_qsa_budget = mc.indexer_budget + mc.indexer_compress_ratio + 200
        assert small == (64, short) and large == (200, short + [past_qsa_budget])
    assert warm_up_rounds(EngineConfig(max_model_len=4, max_num_batched_tokens=64), mc, 400) == []


def test_warm_up_leaves_no_trace(tiny_dir):
    """The startup warm-up (run on CUDA; called here on the CPU path) frees every page and slot, restores the step
    budget, resets the metrics, and later requests generate exactly what a fresh engine generates."""
    prompts = [[3 + (5 * i) % 400 for i in range(n)] for n in (9, 61)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def fresh():
        return LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=256, num_pages=64, page_size=8,
                   max_num_batched_tokens=128, max_num_seqs=4)

    expected = fresh().generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    from qwen4exp.engine.warmup import warm_up

    llm = fresh()
    engine = llm.llm_engine
    warm_up(engine)
    assert engine.cache.all_free() and not engine.has_unfinished_requests()
    assert engine.scheduler.config.max_num_batched_tokens == 128
    assert engine.metrics.registry.get_sample_value("vllm:prompt_tokens_total", engine.metrics.labels) == 0
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_seeded_sampling_is_batch_invariant(tiny_dir):
    prompts = [[5, 6, 7, 8], list(range(10, 60)), [9] * 17]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    solo = alone(tiny_dir, prompts[:1], [params])[0].outputs[0].token_ids
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=256, num_pages=64, page_size=8)
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [params, SamplingParams(temperature=1.0, max_tokens=20), SamplingParams(temperature=0.5)],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == solo
    other_seed = llm.generate([{"prompt_token_ids": prompts[0]}],
                              SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True),
                              use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != solo


def test_limits_and_errors(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=64, num_pages=32, page_size=8)
    with pytest.raises(ValueError, match="60 in the messages, 10 in the completion"):
        llm.generate([{"prompt_token_ids": [5] * 60}], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False)
    # max_tokens=None runs to max_model_len
    out = llm.generate([{"prompt_token_ids": [5] * 60}], SamplingParams(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert llm.llm_engine.cache.all_free()


def test_startup_logs_capacity(tiny_dir, caplog):
    caplog.set_level("INFO", logger="qwen4exp")
    LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=64, cpu_cache_bytes=1 << 23, page_size=8)
    line = [r.message for r in caplog.records if "pages" in r.message][0]
    pages = int(line.split()[2])
    assert f"{pages} pages = {pages * 8} tokens" in line and "state slots" in line
    assert pages > 8


def test_too_small_budget_is_a_clear_error(tiny_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=4096, cpu_cache_bytes=1 << 14, page_size=8)


def test_greedy_generation_is_deterministic(tiny_dir):
    torch.manual_seed(0)
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=128, num_pages=32, page_size=8)
    a = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    b = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text


def test_bad_values_do_not_break_a_step(tiny_dir):
    """Stop ids past the vocabulary and a top_k beyond it are harmless; outputs are snapshots."""
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=64, num_pages=32, page_size=8)
    out = llm.generate([{"prompt_token_ids": [5, 6]}],
                       SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[10**6], top_k=2**40, temperature=1.0,
                                      seed=0, logprobs=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    engine = llm.llm_engine
    engine.add_request("snap", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=5, logprobs=1))
    first = None
    while first is None:
        outs = engine.step()
        first = outs[0] if outs else None
    n = len(first.outputs[0].token_ids)
    engine.step()
    assert len(first.outputs[0].logprobs) == n == len(first.outputs[0].token_ids)
    engine.abort_request("snap")
    assert engine.cache.all_free()
    assert engine.metrics.running._value.get() == 0


def test_request_token_ids_slices_prompt_and_output_alike():
    """Every [start, end) of a request's tokens, within the prompt, across the boundary or in the output."""
    from qwen4exp.engine.request import Request

    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(), output_token_ids=[6, 7, 8])
    every = [1, 2, 3, 4, 5, 6, 7, 8]
    for start in range(9):
        for end in range(start, 9):
            assert req.token_ids(start, end) == every[start:end], (start, end)


def test_step_metadata_matches_per_token_definition():
    """The step layout's vectorised fields, on the device as StepMetadata, equal their per-token definitions:
    decodes and prefill chunks of random lengths at random offsets, on shuffled pages (page_size 8, QSA blocks of
    4 tokens)."""
    from helpers import hf_config

    from qwen4exp.config import ModelConfig
    from qwen4exp.engine.step_builder import RequestChunk, StepBuilder, fill_pending

    cfg = ModelConfig.from_hf(hf_config())
    ps, C, eos = 8, cfg.indexer_compress_ratio, cfg.eos_token_id
    rng = random.Random(3)
    chunks = []
    for n, ctx in [(1, 0), (1, 13), (1, 15), (7, 0), (1, 1), (1, 3), (30, 5), (2, 22)]:
        pages = rng.sample(range(1, 200), -(-(ctx + n) // ps))
        chunks.append(RequestChunk(token_ids=[rng.randrange(300) for _ in range(n)], context_len=ctx,
                                   history=[rng.randrange(300) for _ in range(min(ctx, 5))], pages=pages,
                                   state_slot=len(chunks) + 1, logits_from=rng.choice([n - 1, 0, n]),
                                   pending_row=rng.choice([-1, 40 * len(chunks)]), num_pending=rng.randint(1, n)))
    chunks.sort(key=lambda c: len(c.token_ids) != 1)  # decodes first, as the runner orders them
    assert any(c.pending_row >= 0 and c.num_pending > 1 for c in chunks)
    layout = StepBuilder(cfg, ps).build(chunks)
    meta = layout.to_metadata("cpu")

    def slot(ch, p):
        return ch.pages[p // ps] * ps + p % ps

    tokens = [(r, i, ch) for r, ch in enumerate(chunks) for i in range(len(ch.token_ids))]
    decodes = sum(len(ch.token_ids) == 1 for ch in chunks)
    qsl = [0]
    for ch in chunks:
        qsl.append(qsl[-1] + len(ch.token_ids))
    assert meta.query_start_loc_cpu == meta.query_start_loc.tolist() == qsl
    assert meta.context_lens_cpu == meta.context_lens.tolist() == [ch.context_len for ch in chunks]
    assert meta.state_slots_cpu == meta.state_slots.tolist() == [ch.state_slot for ch in chunks]
    assert meta.has_initial.tolist() == meta.has_initial_state == [ch.context_len > 0 for ch in chunks]
    assert (meta.num_reqs, meta.num_tokens, meta.num_decode_reqs) == (len(chunks), len(tokens), decodes)
    assert meta.max_seq_len == max(ch.context_len + len(ch.token_ids) for ch in chunks)
    # a chunk's last num_pending tokens come from rows pending_row.. of the ids on the device
    device_ids = torch.arange(1000, 1000 + 40 * len(chunks) + 30)
    fill_pending(meta.input_ids, layout.pending, device_ids)
    assert meta.input_ids.tolist() == [
        t if ch.pending_row < 0 or i < len(ch.token_ids) - ch.num_pending
        else 1000 + ch.pending_row + i - (len(ch.token_ids) - ch.num_pending) for ch in chunks
        for i, t in enumerate(ch.token_ids)]
    assert meta.positions.tolist() == meta.token_pos.tolist() == [ch.context_len + i for r, i, ch in tokens]
    assert meta.slot_mapping.tolist() == [slot(ch, ch.context_len + i) for r, i, ch in tokens]
    assert meta.token_req.tolist() == [r for r, i, ch in tokens]
    assert meta.token_local.tolist() == [i for r, i, ch in tokens]
    assert meta.logits_indices.tolist() == [qsl[r] + i for r, i, ch in tokens if i >= ch.logits_from]
    assert meta.ngram_context.tolist() == [([eos, eos] + ch.history)[-2:] for ch in chunks]
    blocks = [(ch, b * C) for ch in chunks
              for b in range(ch.context_len // C, (ch.context_len + len(ch.token_ids)) // C)]
    assert meta.new_block_token_slots.tolist() == [[slot(ch, f + j) for j in range(C)] for ch, f in blocks]
    assert meta.new_block_slots.tolist() == [ch.pages[f // ps] * (ps // C) + (f % ps) // C for ch, f in blocks]
    assert meta.new_block_positions.tolist() == [f for ch, f in blocks]
    # fla's varlen layout: the distinct (prefill request, token index // chunk) pairs, in token order
    pieces = [(r - decodes, i // 4) for r, i, ch in tokens if r >= decodes]
    assert meta.prefill_chunk_indices(4).tolist() == [list(p) for p in dict.fromkeys(pieces)]
    for r, ch in enumerate(chunks):
        assert meta.block_tables[r, : len(ch.pages)].tolist() == ch.pages
        assert not meta.block_tables[r, len(ch.pages):].any()
