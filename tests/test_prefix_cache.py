"""Prefix caching: a request that resumes from cached pages and a saved recurrent state gives the outputs of the same
request computed from scratch (greedy tokens identical, logprobs within 1e-5 in fp32): conversation turns, shared
system prompts, prompts diverging inside a page and at a page boundary, prefixes longer than the QSA budget, and a
cache small enough to force preemption and eviction. Nothing stays held at the end, and a reset empties the cache."""

import random

import pytest

from qwen4exp import LLM, SamplingParams
from qwen4exp.config import EngineConfig
from qwen4exp.engine.prefix_cache import ROOT_KEY, PrefixCache, page_keys, salt_key
from qwen4exp.weights.random_checkpoint import make_random

PAGE = 8
VOCAB = 500


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=1)


def make_llm(model_dir, enable: bool, **kw) -> LLM:
    kw = {"max_model_len": 512, "num_pages": 200, "max_num_batched_tokens": 64, "max_num_seqs": 4, **kw}
    return LLM(model_dir, dtype="float32", device="cpu", page_size=PAGE, enable_prefix_caching=enable, **kw)


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def assert_same(got, want) -> None:
    """Same tokens, and the chosen tokens' logprobs within 1e-4: a prefill resumed from a checkpoint sums in another
    order than one from the start, and fp32 CPU kernels differ by processor (3.3e-5 seen on one)."""
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids
        for lg, lw, t in zip(g.logprobs, w.logprobs, g.token_ids, strict=True):
            assert abs(lg[t].logprob - lw[t].logprob) < 1e-4


def assert_released(llm: LLM) -> None:
    """Nothing held by a request; the checkpoints in use are exactly the ones named; a reset frees every page."""
    engine = llm.llm_engine
    prefix = engine.cache.prefix
    assert engine.cache.all_free() and not engine.scheduler.running and not engine.scheduler.waiting
    assert prefix.num_checkpoints + len(prefix._free_checkpoint_slots) == len(prefix.checkpoint_slots)
    assert set(prefix.checkpoints) <= set(prefix.page_of)
    assert llm.reset_prefix_cache()
    assert prefix.num_checkpoints == 0 and not prefix.page_of and len(prefix._free) == prefix.num_usable


def test_page_keys_name_the_whole_prefix():
    a = page_keys(list(range(40)), PAGE, 5)
    b = page_keys(list(range(40)), PAGE, 4)
    assert a[:4] == b and len(set(a)) == 5
    changed = page_keys([99] + list(range(1, 40)), PAGE, 5)
    assert not set(changed) & set(a)  # a change in page 0 renames every later page
    assert page_keys(list(range(40)), PAGE, 5, extra_keys=[b"", b"", b"image", b"", b""])[:2] == a[:2]
    assert page_keys(list(range(40)), PAGE, 5, extra_keys=[b"", b"", b"image", b"", b""])[2] != a[2]
    salted = page_keys(list(range(40)), PAGE, 5, parent=salt_key("a"))
    assert salt_key(None) == ROOT_KEY and not set(salted) & set(a)  # a salt renames every page
    assert not set(salted) & set(page_keys(list(range(40)), PAGE, 5, parent=salt_key("b")))


def test_shared_pages_are_evicted_least_recently_used_first_with_their_checkpoints():
    cache = PrefixCache(num_pages=7, checkpoint_slots=[5, 6])
    keys = page_keys(list(range(24)), PAGE, 3)
    pages = cache.allocate(3)
    assert cache.save(keys[:2], pages[:2]) == 5 and cache.save(keys, pages) == 6
    assert cache.save(keys, pages) is None  # exists already
    cache.share(pages[:2])  # a second request found the first two
    cache.free(pages)  # the first one finishes: its last page is unreferenced but stays findable
    assert cache.num_free == 4 and cache.refs[pages[0]] == 1
    assert cache.lookup(keys) == (3, 3)
    cache.free(pages[:2])
    assert cache.num_free == 6 and cache.lookup(keys) == (3, 3)
    taken = cache.allocate(4)  # the never-named pages, then the least recently used named one: the last page
    assert cache.num_evicted == 1 and cache.lookup(keys) == (2, 2) and cache.num_checkpoints == 1
    assert cache.lookup(page_keys([7] + list(range(1, 24)), PAGE, 3)) == (0, 0)
    assert not cache.reset()  # pages are held
    cache.free(taken)
    assert cache.reset() and cache.lookup(keys) == (0, 0) and cache.num_free == 6 and cache.num_checkpoints == 0


def conversations(model_dir, enable: bool, seed: int, turns: int = 3, **kw):
    """Three conversations on one system prompt longer than the QSA budget: each turn adds a user message of 3-19
    tokens to the conversation so far (outputs included). Returns the outputs per turn, and the LLM."""
    rng = random.Random(seed)
    llm = make_llm(model_dir, enable, **kw)
    system = [rng.randrange(3, VOCAB) for _ in range(45)]
    convs = [list(system) for _ in range(3)]
    outs = []
    for _ in range(turns):
        for c in convs:
            c += [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 20))]
        res = llm.generate([{"prompt_token_ids": list(c)} for c in convs], greedy(), use_tqdm=False)
        for c, r in zip(convs, res):
            c += r.outputs[0].token_ids
        outs += res
    return outs, llm


def test_multi_turn_conversations_equal_the_uncached_outputs(tiny_dir):
    want, _ = conversations(tiny_dir, False, seed=0)
    got, llm = conversations(tiny_dir, True, seed=0)
    assert_same(got, want)
    cached = [o.num_cached_tokens for o in got]
    assert cached[:3] == [0, 0, 0]  # the first turns arrive together: nothing computed yet
    for before, o in zip(got, got[3:]):  # later turns resume at the last page boundary of the turn before's prompt
        assert o.num_cached_tokens == len(before.prompt_token_ids) // PAGE * PAGE
    m = llm.llm_engine.metrics
    assert m.total("vllm:prefix_cache_hits_total") == sum(cached)
    assert m.total("vllm:prefix_cache_queries_total") == sum(len(o.prompt_token_ids) for o in got)
    assert_released(llm)


def test_prompts_diverging_inside_a_page_and_at_a_page_boundary(tiny_dir):
    rng = random.Random(1)
    base = [rng.randrange(3, VOCAB) for _ in range(130)]  # past the QSA budget (8 blocks of 4) and its tail

    def tail(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prompts = [
        base,  # checkpoint at 128, the last page boundary before its last token
        base[:64] + tail(30),  # diverges at a boundary: matches 8 pages without a checkpoint, saves one at 64
        base[:64] + tail(20),  # resumes there
        base[:61] + tail(40),  # diverges inside page 7: matches 7 pages, saves one at 56
        base[:61] + tail(9),  # resumes at 56
        base,  # the same prompt: recomputes its last partial page only
        base + tail(12),  # a follow-up turn
        base[:128],  # ends at the checkpoint: its last token is recomputed from the checkpoint at 64
    ]
    want_cached = [0, 0, 64, 0, 56, 128, 128, 64]
    params = greedy(5)
    reference = make_llm(tiny_dir, False)
    want = [reference.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    llm = make_llm(tiny_dir, True, max_num_seqs=8)  # a checkpoint slot for each prompt's checkpoints
    got = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    assert_same(got, want)
    assert [o.num_cached_tokens for o in got] == want_cached
    # prompt logprobs need every prompt position computed: such a request reads no cached prefix
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    (g,) = llm.generate([{"prompt_token_ids": base}], params, use_tqdm=False)
    (w,) = reference.generate([{"prompt_token_ids": base}], params, use_tqdm=False)
    assert g.num_cached_tokens == 0 and g.outputs[0].token_ids == w.outputs[0].token_ids
    for lg, lw in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
        assert lg.keys() == lw.keys() and all(abs(lg[t].logprob - lw[t].logprob) < 1e-5 for t in lg)
    assert_released(llm)


def small_cache_run(model_dir, enable: bool, async_scheduling: bool = False):
    """Five conversations of three turns on one system prompt, arriving over time in 15 pages of 8 tokens: the
    messages are drawn up front, so the prompts depend on the outputs alone, not on the steps' timing. Returns the
    outputs by request id, and the LLM."""
    rng = random.Random(2)
    system = [rng.randrange(3, VOCAB) for _ in range(30)]
    messages = [[[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(3)] for _ in range(5)]
    llm = make_llm(model_dir, enable, num_pages=16, max_num_batched_tokens=24, max_num_seqs=3,
                   async_scheduling=async_scheduling, max_model_len=96)
    engine = llm.llm_engine
    convs = [list(system) for _ in messages]
    ready, outputs, arrivals = [(i, 0) for i in range(len(convs))], {}, random.Random(3)
    while ready or engine.has_unfinished_requests():
        if ready and arrivals.random() < 0.5:
            i, turn = ready.pop(0)
            convs[i] += messages[i][turn]
            seed = i if i % 2 else None  # seeded sampling: per-request generators, independent of the batch
            params = SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=5,
                                    ignore_eos=True, logprobs=1)
            engine.add_request(f"{i}-{turn}", {"prompt_token_ids": list(convs[i])}, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
                i, turn = map(int, out.request_id.split("-"))
                convs[i] += out.outputs[0].token_ids
                if turn < 2:
                    ready.append((i, turn + 1))
    return outputs, llm


def test_a_prompt_filling_its_last_page_prefills_in_one_step_and_the_next_turn_resumes_at_its_end(tiny_dir):
    rng = random.Random(2)
    prompt = [rng.randrange(3, VOCAB) for _ in range(6 * PAGE)]
    llm = make_llm(tiny_dir, True)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": prompt}, greedy(3))
    (out,) = engine.step()  # the whole prompt and the first token in one step: no chunk cut off for a checkpoint
    assert len(out.outputs[0].token_ids) == 1
    while engine.has_unfinished_requests():
        engine.step()
    turn = prompt + [rng.randrange(3, VOCAB) for _ in range(5)]
    (got,) = llm.generate([{"prompt_token_ids": turn}], greedy(), use_tqdm=False)
    (want,) = make_llm(tiny_dir, False).generate([{"prompt_token_ids": turn}], greedy(), use_tqdm=False)
    assert got.num_cached_tokens == len(prompt)
    assert_same([got], [want])
    assert_released(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_eviction_in_a_small_cache(tiny_dir, async_scheduling):
    """Requests are preempted (and resume from their cached prefix where it is still there), named pages are
    evicted and checkpoints dropped; the outputs stay those computed without a prefix cache."""
    want, _ = small_cache_run(tiny_dir, False)
    got, llm = small_cache_run(tiny_dir, True, async_scheduling)
    assert got.keys() == want.keys()
    assert_same([got[k] for k in sorted(got)], [want[k] for k in sorted(want)])
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert engine.cache.prefix.num_evicted > 0, "the test must exercise eviction"
    assert sum(o.num_cached_tokens > 0 for o in got.values()) >= 3
    assert_released(llm)


def test_cache_salt_shares_pages_only_between_prompts_with_the_same_salt(tiny_dir):
    """vLLM's `cache_salt` in a prompt: a salted prompt finds only pages cached by prompts of the same salt, and an
    unsalted one none of theirs; the outputs are those without a cache."""
    prompt = list(range(3, 40))
    llm = make_llm(tiny_dir, True)
    (want,) = make_llm(tiny_dir, False).generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)
    order = [None, "a", "a", "b", None, "b"]
    got = [llm.generate([{"prompt_token_ids": prompt} | ({"cache_salt": s} if s else {})], greedy(),
                        use_tqdm=False)[0] for s in order]
    assert [o.num_cached_tokens for o in got] == [0, 0, 32, 0, 32, 32]
    assert_same(got, [want] * len(got))
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([{"prompt_token_ids": prompt, "cache_salt": bad}], greedy(), use_tqdm=False)
    assert_released(llm)


def test_option_and_flags(tiny_dir):
    import argparse

    assert EngineConfig().enable_prefix_caching
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert not EngineConfig.from_cli_args(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching
    assert EngineConfig.from_cli_args(parser.parse_args(["--enable-prefix-caching"])).enable_prefix_caching
    llm = make_llm(tiny_dir, False)
    assert llm.llm_engine.cache.prefix is None and llm.reset_prefix_cache()
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 40))}], greedy(2), use_tqdm=False)
    assert out.num_cached_tokens == 0


def test_cached_tokens_in_the_api_usage_with_prompt_tokens_details(tiny_dir):
    from fastapi.testclient import TestClient

    from qwen4exp.engine.engine import LLMEngine
    from qwen4exp.entrypoints.async_engine import AsyncEngine
    from qwen4exp.entrypoints.server import build_app

    engine = LLMEngine(tiny_dir, EngineConfig(dtype="float32", device="cpu", max_model_len=256, num_pages=64,
                                              page_size=PAGE))
    async_engine = AsyncEngine(engine).start()
    prompt = list(range(3, 40))
    body = {"model": "m", "prompt": prompt, "max_tokens": 2}
    try:
        with TestClient(build_app(async_engine, "m", enable_prompt_tokens_details=True)) as c:
            first = c.post("/v1/completions", json=body).json()["usage"]
            again = c.post("/v1/completions", json=body).json()["usage"]
            chat = c.post("/v1/completions", json={**body, "prompt": prompt + [50, 51]}).json()["usage"]
            salted = [c.post("/v1/completions", json={**body, "cache_salt": s}).json()["usage"] for s in "aab"]
            messages = {"model": "m", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2,
                        "cache_salt": "c"}
            chats = [c.post("/v1/chat/completions", json=messages).json()["usage"] for _ in range(2)]
        with TestClient(build_app(async_engine, "m")) as c:  # vLLM's default: no details
            plain = c.post("/v1/completions", json=body).json()["usage"]
    finally:
        async_engine.shutdown()
    assert "prompt_tokens_details" not in first  # nothing cached yet
    assert again["prompt_tokens_details"] == {"cached_tokens": 32} and again["prompt_tokens"] == 37
    assert chat["prompt_tokens_details"] == {"cached_tokens": 32}
    # a salt keeps a prompt's pages apart from every prompt without that salt
    assert [u.get("prompt_tokens_details") for u in salted] == [None, {"cached_tokens": 32}, None]
    assert "prompt_tokens_details" not in chats[0] and chats[1]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "prompt_tokens_details" not in plain
