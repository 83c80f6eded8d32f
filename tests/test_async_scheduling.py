"""Asynchronous scheduling (step n+1 launched before step n's samples are read) gives the synchronous engine's
outputs exactly: stops found one step late drop their extra token, aborts and preemption leak nothing, and
history-dependent sampling (penalties, min_tokens) drains the pipeline first. On by default on CUDA; forced on here."""

import random

import pytest
import torch

from qwen4exp import LLM, SamplingParams
from qwen4exp.weights.random_checkpoint import make_random


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=3)


def engine(model_dir, async_scheduling, **kw):
    args = dict(max_model_len=128, num_pages=64, page_size=8, max_num_batched_tokens=32, max_num_seqs=6)
    args.update(kw)
    llm = LLM(model_dir, dtype="float32", device="cpu", async_scheduling=async_scheduling, **args)
    return llm.llm_engine


def drive(eng, requests, abort_at=None):
    """Adds requests over time (two per step), steps to the end; returns {request_id: final RequestOutput}."""
    pending, outs, step = list(requests), {}, 0
    while pending or eng.has_unfinished_requests():
        for _ in range(2):
            if pending:
                rid, prompt, params = pending.pop(0)
                eng.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
        step += 1
        if abort_at is not None and step == abort_at[0]:
            eng.abort_request(abort_at[1])
        assert step < 2000
    assert eng.cache.all_free()
    assert not eng.scheduler.running and not eng.scheduler.waiting
    return outs


def summary(out):
    return [(c.index, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]


def test_async_equals_sync(tiny_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 40))] for _ in range(8)]
    # a token the greedy model emits mid-way becomes a stop id: async learns of it one step late
    probe = engine(tiny_dir, False)
    first = drive(probe, [("p", prompts[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))])
    stop_tok = first["p"].outputs[0].token_ids[6]

    def requests():
        out = []
        for i, p in enumerate(prompts):
            kind = i % 5
            if kind == 0:
                params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True)
            elif kind == 1:
                params = SamplingParams(temperature=0.8, top_p=0.9, seed=i, n=2, max_tokens=12, ignore_eos=True)
            elif kind == 2:
                params = SamplingParams(temperature=0.0, max_tokens=9, logprobs=3, prompt_logprobs=2,
                                        ignore_eos=True)
            elif kind == 3:
                params = SamplingParams(temperature=0.7, top_k=20, seed=100 + i, max_tokens=15, ignore_eos=True)
            else:
                params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            out.append((str(i), p, params))
        return out

    sync = drive(engine(tiny_dir, False), requests())
    eng = engine(tiny_dir, True)
    fed = []
    execute = eng.runner.execute
    eng.runner.execute = lambda chunks, pending_ids=None, *args, **kw: fed.append(
        sum(c.pending_row >= 0 for c in chunks)) or execute(chunks, pending_ids, *args, **kw)
    asyn = drive(eng, requests())
    assert sum(fed) > 50, "decode tokens must reach the model from the device, not the host"
    assert sync.keys() == asyn.keys()
    for rid in sync:
        assert summary(asyn[rid]) == summary(sync[rid]), rid
    assert sync["0"].outputs[0].finish_reason == "stop" and sync["0"].outputs[0].token_ids[-1] == stop_tok
    for a, b in zip(asyn["2"].outputs[0].logprobs, sync["2"].outputs[0].logprobs):
        assert a.keys() == b.keys()
        # batch composition differs step by step between the two, so fp32 sums round differently
        torch.testing.assert_close([v.logprob for v in a.values()], [v.logprob for v in b.values()], atol=1e-5,
                                   rtol=1e-5)
        assert [v.rank for v in a.values()] == [v.rank for v in b.values()]
    assert [None if d is None else sorted(d) for d in asyn["2"].prompt_logprobs] == [
        None if d is None else sorted(d) for d in sync["2"].prompt_logprobs]


def test_preemption_abort_and_penalties(tiny_dir):
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(10, 40))] for _ in range(8)]

    def requests():
        out = []
        for i, p in enumerate(prompts):
            if i == 5:  # repetition penalty: while it is unfinished every step runs synchronously
                params = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True)
            else:
                params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            out.append((str(i), p, params))
        return out

    # 13 usable pages of 8 tokens cannot hold six requests of up to 70 tokens: the newest get preempted
    kw = dict(num_pages=14, max_num_seqs=6, max_model_len=96)
    sync_eng = engine(tiny_dir, False, **kw)
    sync = drive(sync_eng, requests(), abort_at=(9, "3"))
    async_eng = engine(tiny_dir, True, **kw)
    asyn = drive(async_eng, requests(), abort_at=(9, "3"))
    assert sync_eng.scheduler.num_preemptions > 0 and async_eng.scheduler.num_preemptions > 0
    assert "3" not in sync and "3" not in asyn
    assert sync.keys() == asyn.keys()
    for rid in sync:
        assert summary(asyn[rid]) == summary(sync[rid]), rid


def test_token_bans_equal_sync(tiny_dir):
    """allowed_token_ids (a mask built once on the device) keeps steps overlapped; a multi-token bad word reads the
    last tokens, so its steps run synchronously: either way the outputs are the synchronous engine's."""
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = drive(engine(tiny_dir, False), [("b", [7, 8, 9], SamplingParams(**greedy))])["b"].outputs[0].token_ids
    requests = [("allowed", [7, 8, 9], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=16, ignore_eos=True,
                                                      allowed_token_ids=list(range(50, 90)))),
                ("bad", [7, 8, 9], SamplingParams(bad_words_token_ids=[base[3:5], [base[8]]], **greedy)),
                ("free", [7, 8, 9], SamplingParams(**greedy))]
    sync = drive(engine(tiny_dir, False), requests)
    asyn = drive(engine(tiny_dir, True), requests)
    assert {rid: summary(o) for rid, o in asyn.items()} == {rid: summary(o) for rid, o in sync.items()}
    bad = sync["bad"].outputs[0].token_ids
    assert bad[:4] == base[:4] and bad[4] != base[4] and base[8] not in bad
    assert sync["free"].outputs[0].token_ids == base
    assert all(set(c.token_ids) <= set(range(50, 90)) for c in sync["allowed"].outputs)
