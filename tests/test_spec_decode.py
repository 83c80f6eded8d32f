"""Speculative decoding (engine/spec_decode.py, engine/rejection_sampler.py): lossless against decoding without it,
with the MTP layer's drafts (random weights: mostly rejected) and with drafts forced right or half right through the
proposer interface, under chunked prefill, preemption and requests arriving over time; the sampling distribution by
a chi-square test; configuration, metrics and the draft layer's proposals."""

import itertools
import random
import time

import pytest
import torch

from qwen4exp import LLM, SamplingParams
from qwen4exp.config import ConfigError, EngineConfig
from qwen4exp.engine.spec_decode import DraftBatch, Proposer
from qwen4exp.weights.random_checkpoint import make_random

ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, page_size=8)
# chunked prefill (24 tokens a step) and too few pages for everyone (preemption)
BUSY = dict(ENGINE, num_pages=20, max_num_batched_tokens=24, max_num_seqs=12)


def speculative(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=1)


def serve(llm, requests, seed: int = 0) -> dict:
    """requests: (id, prompt ids, params), arriving a few per step; returns each request's final output."""
    engine = llm.llm_engine
    rng = random.Random(seed)
    pending, outputs, steps = list(requests), {}, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        assert steps < 5000
    return outputs


class ScriptedProposer(Proposer):
    """Drafts a request's continuation as decoding without speculation produced it (`expected`: request id -> its
    output tokens), each draft replaced by a wrong token where `wrong(position)` says so."""

    def __init__(self, expected: dict[str, list[int]], wrong=lambda position: False):
        self.expected, self.wrong = expected, wrong
        self.proposed = 0

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        out = []
        for e in batch.entries:
            req = e.request
            n = len(req.output_token_ids)
            drafts = (self.expected[req.request_id][n: n + e.num_drafts] + [3] * e.num_drafts)[: e.num_drafts]
            out.append([(t + 1) % 500 if self.wrong(n + i) else t for i, t in enumerate(drafts)])
            self.proposed += len(drafts)
        return out


def child_ids(rid: str, n: int) -> list[str]:
    return [rid] if n == 1 else [f"{i}_{rid}" for i in range(n)]


@pytest.fixture(scope="module")
def workload(tiny_dir):
    """33 greedy requests covering every sampling feature, and their outputs without speculation (BUSY engine)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))] for _ in range(32)]
    prompts.append([rng.randrange(3, 500) for _ in range(84)])  # ends by max_model_len (96)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_dir, **ENGINE, num_pages=256)
    free = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in free]
    pieces = [[llm.get_tokenizer().decode([t]) for t in out] for out in tokens]
    requests = []
    for i, p in enumerate(prompts):
        out = tokens[i]
        kind = i % 9
        kw = dict(temperature=0.0, max_tokens=rng.randrange(1, 17), ignore_eos=True)
        if kind == 1:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
        elif kind == 2:
            kw.update(logit_bias={out[3]: 4.0, out[6]: -3.0}, max_tokens=16)
        elif kind == 3:
            kw.update(logprobs=3, prompt_logprobs=2)
        elif kind == 4:
            kw.update(n=2, logprobs=1)
        elif kind == 5:  # a stop id that decoding meets
            kw.update(stop_token_ids=[out[7]], ignore_eos=False, max_tokens=16)
        elif kind == 6:  # a stop id banned until min_tokens
            kw.update(stop_token_ids=[out[2]], min_tokens=9, ignore_eos=False, max_tokens=16)
        elif kind == 7:  # a stop string
            kw.update(stop=[next(t for t in pieces[i][5:] if t.strip())], max_tokens=16)
        elif kind == 8:  # a two-token bad word that decoding would generate
            kw.update(bad_words_token_ids=[[out[4], out[5]]], max_tokens=16)
        if i == len(prompts) - 1:
            kw.update(max_tokens=None)
        requests.append((str(i), p, SamplingParams(**kw)))
    expected = serve(LLM(tiny_dir, **BUSY), requests)
    return requests, expected


def assert_same_outputs(outputs: dict, expected: dict, requests, logprob_tol: float = 1e-4) -> None:
    for rid, _, params in requests:
        got, want = outputs[rid], expected[rid]
        for g, w in zip(got.outputs, want.outputs, strict=True):
            assert g.token_ids == w.token_ids, f"request {rid} ({params})"
            assert (g.finish_reason, g.stop_reason, g.text) == (w.finish_reason, w.stop_reason, w.text), rid
            if w.logprobs is not None:
                for a, b in zip(g.logprobs, w.logprobs, strict=True):
                    assert a.keys() == b.keys()
                    for t in a:
                        assert abs(a[t].logprob - b[t].logprob) < logprob_tol and a[t].rank == b[t].rank
            if w.cumulative_logprob is not None:
                assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3
        if want.prompt_logprobs is not None:
            for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < logprob_tol for t in a)


def generate(llm, requests) -> dict:
    """Each request's final output, all submitted at once."""
    outs = llm.generate([{"prompt_token_ids": p} for _, p, _ in requests], [params for *_, params in requests],
                        use_tqdm=False)
    return {rid: out for (rid, _, _), out in zip(requests, outs)}


def wrong_half(position: int) -> bool:
    return (position * 7 + 3) % 4 < 2


@pytest.mark.parametrize("k,drafts", [(1, "mtp"), (2, "mtp"), (3, "mtp"), (3, "right"), (2, "half right")])
def test_greedy_outputs_equal_decoding_without_speculation(tiny_dir, workload, k, drafts):
    """Token-identical outputs, logprobs within 1e-4, the same finish reasons and texts (stop ids and strings inside
    accepted drafts end the request there); preemption happened; every page and slot is free afterwards."""
    requests, expected = workload
    llm = LLM(tiny_dir, **BUSY, speculative_config=speculative(k))
    engine = llm.llm_engine
    if drafts != "mtp":
        tokens = {cid: o.token_ids for rid, out in expected.items() for cid, o in
                  zip(child_ids(rid, len(out.outputs)), out.outputs)}
        engine.spec.proposer = ScriptedProposer(tokens, wrong_half if drafts == "half right" else lambda p: False)
    outputs = serve(llm, requests)
    assert_same_outputs(outputs, expected, requests)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert engine.cache.all_free() and not engine.scheduler.running and not engine.scheduler.waiting
    m = engine.metrics
    drafted = m.total("vllm:spec_decode_num_draft_tokens_total")
    accepted = m.total("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [m.registry.get_sample_value("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                           {**m.labels, "position": str(i)}) for i in range(k)]
    assert drafted > 0 and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is accepted only after the ones before it
    if drafts == "right":
        assert accepted >= 0.8 * drafted
    elif drafts == "half right":
        assert 0.1 * drafted < accepted < 0.7 * drafted


# ----- the sampling distribution -----

TEMPERATURE, TOP_K, SAMPLES = 1.0, 3, 20_000


class TinyContexts:
    """The tiny model's raw logits after the prompt and some generated tokens (from prompt logprobs over the whole
    vocabulary, which differ from the logits by a constant per row: the same distributions)."""

    def __init__(self, llm, prompt: list[int]):
        self.llm, self.prompt, self.rows = llm, prompt, {}

    def fetch(self, contexts: list[tuple]) -> None:
        vocab = self.llm.llm_engine.model_config.vocab_size
        todo = [c for c in dict.fromkeys(contexts) if c not in self.rows]
        outs = self.llm.generate([{"prompt_token_ids": self.prompt + list(c) + [0]} for c in todo],
                                 SamplingParams(max_tokens=1, prompt_logprobs=vocab), use_tqdm=False)
        for c, out in zip(todo, outs):
            entry = out.prompt_logprobs[len(self.prompt) + len(c)]
            row = torch.full((vocab,), float("-inf"))
            row[list(entry)] = torch.tensor([lp.logprob for lp in entry.values()])
            self.rows[c] = row

    def __getitem__(self, context: tuple) -> torch.Tensor:
        return self.rows[context]

    def probs(self, context: tuple) -> dict[int, float]:
        """The sampling distribution there, by hand: softmax(logits / T) over the top k."""
        top = self.rows[context].topk(TOP_K)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values / TEMPERATURE, 0).tolist()))

    def argmax(self, context: tuple) -> int:
        return int(self.rows[context].argmax())


@pytest.fixture(scope="module")
def tiny_tree(tiny_dir):
    """Every context the first three tokens can be sampled in, and the greedy drafts after them."""
    ctx = TinyContexts(LLM(tiny_dir, **ENGINE, num_pages=64), [17, 230, 45])
    ctx.fetch([()])
    ctx.fetch([(t1,) for t1 in ctx.probs(())])
    ctx.fetch([(t1, t2) for t1 in ctx.probs(()) for t2 in ctx.probs((t1,))])
    ctx.fetch([(t1, t2, ctx.argmax((t1, t2))) for t1 in ctx.probs(()) for t2 in ctx.probs((t1,))])
    return ctx


def chi_square_p(counts: dict[tuple, int], ctx: TinyContexts) -> float:
    """p-value of the counts of (t1, t2, t3) under the exact distribution (cells expected < 5 pooled)."""
    cells = []
    for t1, p1 in ctx.probs(()).items():
        for t2, p2 in ctx.probs((t1,)).items():
            for t3, p3 in ctx.probs((t1, t2)).items():
                cells.append((SAMPLES * p1 * p2 * p3, counts.get((t1, t2, t3), 0)))
    assert sum(c for _, c in cells) == SAMPLES  # nothing outside the support
    small = [c for c in cells if c[0] < 5]
    cells = [c for c in cells if c[0] >= 5] + ([(sum(e for e, _ in small), sum(o for _, o in small))] if small else [])
    stat = sum((o - e) ** 2 / e for e, o in cells)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def seeded_requests():
    from qwen4exp.engine.request import Request

    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=i, max_tokens=4) for i in range(SAMPLES)]
    return [Request(str(i), [17, 230, 45], p, max_tokens=4) for i, p in enumerate(params)]


def commit(reqs, out, num_rows, upto):
    row = 0
    for req, n, a in zip(reqs, num_rows, upto):
        req.output_token_ids += out.token_ids[row: row + a + 1]
        row += n


def speculate(ctx: TinyContexts, k: int = 2) -> dict[tuple, int]:
    """SAMPLES seeded requests through the engine's verification, `k` drafts a step that are the target's greedy
    tokens (as a perfect draft layer would make them) and as many as the engine allows (max_tokens 4): what the
    engine's steps do, batched over every request at once."""
    from qwen4exp.engine.rejection_sampler import RejectionSampler
    from qwen4exp.engine.sampler import Sampler

    verifier = RejectionSampler(Sampler("cpu", seed=0))
    reqs = seeded_requests()
    active = reqs
    while active:
        drafts, rows = [], []
        for req in active:
            made = tuple(req.output_token_ids)
            n = min(k, req.max_tokens - len(made) - 1) if made else 0
            d = []
            for _ in range(n):
                d.append(ctx.argmax(made + tuple(d)))
            drafts.append(d)
            rows += [made + tuple(d[:j]) for j in range(n + 1)]
        ctx.fetch(rows)
        out, accepted = verifier.verify(torch.stack([ctx[r] for r in rows]), active, drafts,
                                        [[] for _ in active]).to_host()
        commit(active, out, [len(d) + 1 for d in drafts], accepted)
        active = [r for r in active if len(r.output_token_ids) < 3]
    return _counts(reqs)


def _counts(reqs) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    for r in reqs:
        key = tuple(r.output_token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_the_test_accepts_sampling_without_speculation(tiny_tree):
    """Calibration: the sampler without speculation (one token a step) passes the chi-square test."""
    from qwen4exp.engine.sampler import Sampler

    sampler, reqs = Sampler("cpu", seed=0), seeded_requests()
    for _ in range(3):
        rows = [tuple(r.output_token_ids) for r in reqs]
        out = sampler(torch.stack([tiny_tree[c] for c in rows]), reqs, [[] for _ in reqs])
        commit(reqs, out, [1] * len(reqs), [0] * len(reqs))
    assert chi_square_p(_counts(reqs), tiny_tree) > 0.01


@pytest.mark.slow
@pytest.mark.parametrize("perturbation", [None, "accept more", "accept less"])
def test_sampling_with_speculation_has_the_target_distribution(tiny_tree, monkeypatch, perturbation):
    """20,000 seeded samples of the first three tokens (top_k 3, temperature 1) through the rejection sampler
    with two greedy drafts a step match the distribution without speculation (chi-square p > 0.01); a perturbed
    acceptance rule fails the same test."""
    from qwen4exp.engine import rejection_sampler

    exact = rejection_sampler.acceptance_probability
    if perturbation == "accept more":
        monkeypatch.setattr(rejection_sampler, "acceptance_probability", lambda p, q: exact(1.25 * p, q))
    elif perturbation == "accept less":
        monkeypatch.setattr(rejection_sampler, "acceptance_probability", lambda p, q: exact(0.8 * p, q))
    p = chi_square_p(speculate(tiny_tree), tiny_tree)
    if perturbation is None:
        assert p > 0.01
    else:
        assert p < 1e-6


# ----- the draft layer's proposals -----

class RecordingProposer:
    """The engine's MTP proposer, recording each request's tokens and the drafts proposed after them."""

    def __init__(self, proposer):
        self.proposer, self.records = proposer, []

    def launch(self, *args):
        return self.proposer.launch(*args)

    def draft_ahead(self, *args):
        return self.proposer.draft_ahead(*args)

    def propose(self, batch: DraftBatch) -> list[list[int]]:
        drafts = self.proposer.propose(batch).tolist()
        for e, d in zip(batch.entries, drafts):
            if d:
                req = e.request
                self.records.append((req.prompt_token_ids + req.output_token_ids, d))
        return drafts


def reference_draft_logits(model, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """The draft layer's logits for each draft position after `tokens`, computed from scratch (model/mtp.py's
    contract on a fresh cache): the target over tokens[:-1], draft step 0 over those rows fed tokens[1:], then one
    row per further draft fed the previous draft."""
    from qwen4exp.engine.step_builder import RequestChunk, StepBuilder
    from qwen4exp.model import allocate_cache

    page = 8
    n = len(tokens)
    pages = list(range(1, 2 + (n + len(drafts)) // page))
    cache = allocate_cache(model.config, len(pages) + 1, page, 2, torch.float32, "cpu", mtp=True)
    builder = StepBuilder(model.config, page)

    def meta(ids, context):
        hist = tokens[max(0, context - 2):context]
        return builder.build([RequestChunk(ids, context, hist, pages, 1, 0)]).to_metadata("cpu")

    with torch.inference_mode():
        _, streams = model(meta(tokens[:-1], 0), cache, return_streams=True)
        hidden, streams = model.draft(meta(tokens[1:], 0), cache, streams)
        out = [model.compute_logits(hidden[-1:])[0]]
        for j in range(1, len(drafts)):
            hidden, streams = model.draft(meta([drafts[j - 1]], n - 2 + j), cache, streams[-1:], step=j)
            out.append(model.compute_logits(hidden)[0])
    return out


def test_drafts_are_the_draft_layers_greedy_tokens_from_scratch(tiny_dir):
    """Every draft the engine proposes (k = 3; chunked prefill, preemption, rejected drafts before it) is the
    argmax of the draft layer computed from scratch over the request's tokens: the draft layer's cache holds every
    position and rejected rows leave nothing in it."""
    rng = random.Random(3)
    llm = LLM(tiny_dir, **BUSY, speculative_config=speculative(3))
    engine = llm.llm_engine
    recorder = engine.spec.proposer = RecordingProposer(engine.spec.proposer)
    requests = [(str(i), [rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))],
                 SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for i in range(12)]
    serve(llm, requests)
    assert engine.scheduler.num_preemptions > 0 and len(recorder.records) > 30
    for tokens, drafts in recorder.records[::2]:
        for draft, logits in zip(drafts, reference_draft_logits(engine.model, tokens, drafts)):
            # ties within float noise of a batched computation may pick either
            assert logits[draft] >= logits.max() - 1e-4, (tokens, drafts)


@pytest.mark.slow
@pytest.mark.parametrize("k,drafts", [(1, "mtp"), (3, "half right")])
def test_small_preset_greedy_outputs_equal_decoding_without_speculation(tmp_path_factory, k, drafts):
    """The small preset (8 layers, 16 experts, QSA selecting from 67 tokens on): 32 requests arriving over time,
    chunked prefill and preemption; token-identical outputs and logprobs within 1e-4, the cache free afterwards.
    Steps of greedy requests without logprobs are verified inside the step (greedy_acceptance), the others by the
    rejection sampler: both run."""
    d = make_random(str(tmp_path_factory.mktemp("small")), "small", dtype="float32", seed=2)
    rng = random.Random(5)
    requests = [(str(i), [rng.randrange(3, 4000) for _ in range(rng.randrange(1, 90))],
                 SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 10), ignore_eos=True,
                                logprobs=2 if i % 4 == 0 else None)) for i in range(32)]
    busy = dict(ENGINE, num_pages=24, max_num_batched_tokens=48, max_num_seqs=8)
    expected = serve(LLM(d, **busy), requests)
    llm = LLM(d, **busy, speculative_config=speculative(k))
    engine = llm.llm_engine
    if drafts != "mtp":
        engine.spec.proposer = ScriptedProposer({rid: out.outputs[0].token_ids for rid, out in expected.items()},
                                                wrong_half)
    rejection, paths = engine.spec.rejection, []
    for name in ("verify", "verify_greedy"):
        def counted(*args, _name=name, _fn=getattr(rejection, name)):
            paths.append(_name)
            return _fn(*args)
        setattr(rejection, name, counted)
    assert_same_outputs(serve(llm, requests), expected, requests)
    assert set(paths) == {"verify", "verify_greedy"}
    assert engine.scheduler.num_preemptions > 0
    assert engine.cache.all_free()


@pytest.mark.parametrize("k", [1, 2])
def test_bf16_state_slots_keep_speculation_token_identical(tiny_dir, k):
    """--mamba-ssm-cache-dtype bfloat16: the GDN states are stored in bf16 (the conv windows stay in the model dtype),
    and greedy outputs with speculation equal those without it on the same state dtype, logprobs within 1e-4: the
    verification rounds the state after every row, as one-token steps store it. Each prompt prefills in one step
    both ways: a bf16 state is also rounded where a prefill is split into chunks, so outputs depend slightly on
    the split (as in vLLM), which speculation changes."""
    rng = random.Random(3)
    requests = []
    for i in range(10):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
        kw = dict(temperature=0.0, max_tokens=rng.randrange(4, 15), ignore_eos=True)
        if i % 3 == 1:
            kw.update(logprobs=2)
        requests.append((str(i), prompt, SamplingParams(**kw)))
    state = dict(ENGINE, num_pages=160, max_num_seqs=16, mamba_ssm_cache_dtype="bfloat16")
    plain = LLM(tiny_dir, **state)
    gdn = [layer for layer in plain.llm_engine.runner.cache.layers if hasattr(layer, "ssm")]
    assert gdn and all(g.ssm.dtype == torch.bfloat16 and g.conv.dtype == torch.float32 for g in gdn)
    expected = generate(plain, requests)
    llm = LLM(tiny_dir, **state, speculative_config=speculative(k))
    assert_same_outputs(generate(llm, requests), expected, requests)
    engine = llm.llm_engine
    assert engine.metrics.total("vllm:spec_decode_num_accepted_tokens_total") > 0
    assert engine.cache.all_free()


# ----- configuration, seeds, metrics -----

@pytest.mark.parametrize("value,field", [
    ({"method": "eagle", "num_speculative_tokens": 1}, "speculative_config.method"),
    ({"num_speculative_tokens": 1}, "speculative_config.method"),
    ({"method": "mtp", "num_speculative_tokens": 5}, "speculative_config.num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": "2"}, "speculative_config.num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "speculative_config"),
    ([1], "speculative_config"),
])
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ConfigError) as e:
        LLM(device="cpu", speculative_config=value)
    assert e.value.field == field


def test_speculative_config_is_vllms_json():
    config = EngineConfig(speculative_config={"num_speculative_tokens": 3, "method": "mtp"})
    assert config.num_speculative_tokens == 3 and EngineConfig().num_speculative_tokens == 0


def test_checkpoint_without_mtp_weights_cannot_speculate(tiny_dir, tmp_path):
    from test_mtp import without_mtp

    from qwen4exp.weights.loader import MissingMTPError

    d = without_mtp(tiny_dir, str(tmp_path / "no_mtp"))
    LLM(d, **ENGINE, num_pages=16)  # fine without speculation
    with pytest.raises(MissingMTPError, match=r"no MTP weights \(mtp\.\*\)"):
        LLM(d, **ENGINE, num_pages=16, speculative_config=speculative(1))


def test_seeded_requests_sample_the_same_alone_and_in_any_batch(tiny_dir):
    """With speculation, a seeded request's tokens depend on its seed only, not on what else runs with it."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))] for _ in range(8)]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=i, max_tokens=12, ignore_eos=True,
                             presence_penalty=0.4 if i % 2 else 0.0) for i in range(4)]
    others = [SamplingParams(temperature=t, max_tokens=10, ignore_eos=True) for t in (0.0, 1.0, 0.0, 0.7)]
    alone = LLM(tiny_dir, **ENGINE, num_pages=64, max_num_seqs=1, speculative_config=speculative(2))
    want = [alone.generate([{"prompt_token_ids": p}], q, use_tqdm=False)[0].outputs[0].token_ids
            for p, q in zip(prompts[:4], seeded)]
    llm = LLM(tiny_dir, **BUSY, speculative_config=speculative(2))
    requests = [(str(i), p, q) for i, (p, q) in enumerate(zip(prompts, seeded + others))]
    requests = requests[4:6] + requests[:2] + requests[6:] + requests[2:4]
    got = serve(llm, requests)
    assert [got[str(i)].outputs[0].token_ids for i in range(4)] == want
    assert len({tuple(w) for w in want}) == 4


def test_spec_decode_metrics_as_vllm_exports_them(tiny_dir):
    from prometheus_client import generate_latest

    llm = LLM(tiny_dir, **ENGINE, num_pages=64, speculative_config=speculative(2))
    tokens = {"0": [5] * 20}
    llm.llm_engine.spec.proposer = ScriptedProposer(tokens, lambda position: position % 3 == 2)
    llm.llm_engine.add_request("0", {"prompt_token_ids": [3, 4]}, SamplingParams(temperature=0.0, max_tokens=9,
                                                                                  ignore_eos=True,
                                                                                  logit_bias={5: 100.0}))
    outputs = []
    while llm.llm_engine.has_unfinished_requests():
        outputs += llm.llm_engine.step()
    assert outputs[-1].outputs[0].token_ids == [5] * 9
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 3, 6, 9]
    text = generate_latest(llm.llm_engine.metrics.registry).decode()
    labels = f'engine="0",model_name="{tiny_dir}"'
    # the target's token is always 5; drafts are wrong at outputs 2, 5, 8. Outputs 1-2: [5, x] (one kept, then 5),
    # 3-4: [5, 5] (both kept, then the bonus 5), 6-7: [5, 5] (both kept, and the bonus is the 9th token)
    for name, value in [("vllm:spec_decode_num_drafts_total", 3.0), ("vllm:spec_decode_num_draft_tokens_total", 6.0),
                        ("vllm:spec_decode_num_accepted_tokens_total", 5.0)]:
        assert f"{name}{{{labels}}} {value}" in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 3.0' in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} 2.0' in text
    plain = LLM(tiny_dir, **ENGINE, num_pages=64)
    assert "spec_decode" not in generate_latest(plain.llm_engine.metrics.registry).decode()


def test_stats_line_reports_the_acceptance(tiny_dir, caplog):
    import logging

    from qwen4exp.engine.metrics import StatsLogger

    caplog.set_level(logging.INFO, logger="qwen4exp")
    llm = LLM(tiny_dir, **ENGINE, num_pages=64, speculative_config=speculative(2))
    llm.llm_engine.spec.proposer = ScriptedProposer({"0": [5] * 20}, lambda position: position % 3 == 2)
    stats = StatsLogger(llm.llm_engine, interval=10.0)
    start = time.monotonic()
    llm.llm_engine.add_request("0", {"prompt_token_ids": [3, 4]},
                               SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logit_bias={5: 100.0}))
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    caplog.clear()
    stats.log(start + 10.0)
    # as in test_spec_decode_metrics_as_vllm_exports_them: 3 drafts of 6 tokens, 5 accepted (3 first, 2 second)
    assert ("SpecDecoding metrics: Mean acceptance length: 2.67, Accepted throughput: 0.50 tokens/s, Drafted "
            "throughput: 0.60 tokens/s, Accepted: 5 tokens, Drafted: 6 tokens, Per-position acceptance rate: 1.000, "
            "0.667, Avg Draft acceptance rate: 83.3%") in caplog.text
    caplog.clear()
    stats.log(start + 20.0)
    assert "SpecDecoding" not in caplog.text  # no drafts in the interval


# ----- the GPU dispatch -----

class EagerSpeculativeGraphs:
    """The CUDA-graph runner's speculative steps (buffer filling, padding request, state token slots) executed
    eagerly on the metadata a graph captures (CPU: no capture), recording the buckets replayed."""

    def __new__(cls, llm, k: int, buckets: list[int], max_num_batched_tokens: int):
        from qwen4exp.engine.cuda_graph import CUDAGraphRunner

        class Runner(CUDAGraphRunner):
            def _run(self, key):
                self.replayed.append(key[1])
                return self.graph_step(*self.graph_inputs(key))

        engine = llm.llm_engine
        runner = Runner(engine.model, engine.runner.cache, engine.cache.page_size, engine.config.max_model_len,
                        max(buckets), "cpu", buckets, max_num_batched_tokens, k)
        runner.replayed = []
        return runner


@pytest.mark.slow
def test_gpu_dispatch_and_graph_buffers_verify_as_the_reference(tmp_path, monkeypatch):
    """The ops' GPU paths (Triton kernels in the interpreter): decodes, verified requests and prefill chunks in one
    step (GDN's recurrent kernel storing the state after each verified row, the conv's token states before its
    varlen kernels), eagerly and on the speculative CUDA graphs' buffers (steps of at most 6 tokens), give decoding's
    tokens and logprobs without speculation, with drafts half right. (QSA is dense here: its batched selection may
    break ties between equal block scores otherwise than the reference. The draft layer's drafts, left on the
    device, reach the graph buffers as pending tokens in tests/test_gpu.py.)"""
    from qwen4exp import ops

    tiny_dir = make_random(str(tmp_path / "dense"), "tiny", dtype="float32", seed=1, overrides={"indexer_budget": 128})
    rng = random.Random(11)
    requests = [(str(i), [rng.randrange(3, 500) for _ in range(rng.randrange(2, 24))],
                 SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 7), ignore_eos=True, logprobs=1))
                for i in range(4)]
    small = dict(ENGINE, num_pages=64, max_num_batched_tokens=12, max_num_seqs=4)
    expected = serve(LLM(tiny_dir, **small), requests)
    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    llm = LLM(tiny_dir, **small, speculative_config=speculative(2))
    engine = llm.llm_engine
    engine.spec.proposer = ScriptedProposer({rid: o.outputs[0].token_ids for rid, o in expected.items()},
                                            wrong_half)
    graphs = engine.runner.graphs = EagerSpeculativeGraphs(llm, 2, [1, 2], 12)
    steps = []
    execute = engine.runner.execute

    def recorded(chunks, *args, **kwargs):
        steps.append([(len(c.token_ids), c.state_token_slots is not None) for c in chunks])
        return execute(chunks, *args, **kwargs)
    engine.runner.execute = recorded
    assert_same_outputs(serve(llm, requests), expected, requests)
    assert any({(1, False)} & set(s) and any(v for _, v in s) and any(n > 1 and not v for n, v in s) for s in steps), \
        "a step must hold a decode, a verified request and a prefill chunk"
    assert set(graphs.replayed) == {3, 6} and len(graphs.replayed) < len(steps), "graphs and eager steps both"
    assert engine.cache.all_free()


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_draft_layer_graph_buffers_draft_as_the_eager_layer(tmp_path, monkeypatch, k):
    """The draft layer's CUDA-graph steps (cuda_graph.py, draft=True: the mixed layout, the states copied into their
    buffer, the greedy token of every row), executed eagerly on the metadata a graph captures (CPU: no capture) with
    the ops' GPU paths, propose the very drafts the eager draft layer proposes on the torch reference, in draft step 0
    (kept rows of decodes, verified requests and prefill chunks) and the further draft steps, those launched after
    the host read the verification and those launched before it (draft_ahead: rows moved on the device to the kept
    positions); outputs stay decoding's. With the target's graphs too, draft step 0 runs on the buffers of the
    target's step (execute_draft_on_step)."""
    from qwen4exp import ops
    from qwen4exp.engine.cuda_graph import CUDAGraphRunner

    class EagerDraftGraphs(CUDAGraphRunner):
        def execute_draft(self, chunks, streams, pending_ids=None):
            self.replayed.append(self.phase)
            return super().execute_draft(chunks, streams, pending_ids)

        def execute_draft_on_step(self, chunks, streams, pending_ids=None):
            self.replayed.append("on the step's buffers")
            return super().execute_draft_on_step(chunks, streams, pending_ids)

        def execute_draft_shifted(self, chunks, streams, pending_ids, shift):
            self.replayed.append("ahead")
            return super().execute_draft_shifted(chunks, streams, pending_ids, shift)

        def _run(self, key):
            meta = self._mixed_meta(*key[1:])
            return self.forward(meta, meta.logits_indices)

    d = make_random(str(tmp_path / "dense"), "tiny", dtype="float32", seed=2, overrides={"indexer_budget": 128})
    rng = random.Random(5)
    requests = [(str(i), [rng.randrange(3, 500) for _ in range(rng.randrange(2, 24))],
                 SamplingParams(temperature=0.0, max_tokens=rng.randrange(3, 7), ignore_eos=True))
                for i in range(4)]
    small = dict(ENGINE, num_pages=64, max_num_batched_tokens=16, max_num_seqs=4)
    expected = serve(LLM(d, **small), requests)
    proposed = {}
    for graphs in (False, True):
        llm = LLM(d, **small, speculative_config=speculative(k))
        engine = llm.llm_engine
        proposer = engine.spec.proposer
        if graphs:
            monkeypatch.setattr(ops.settings, "fast_on_cpu", True)  # the eager drafts are the torch reference's
            # the target's graphs take every other step they could: draft step 0 then runs on the buffers of the
            # target's step, or (after an eager target step) on its own
            target = engine.runner.graphs = EagerSpeculativeGraphs(llm, k, [1, 2, 4], 16)
            turns = itertools.count()
            target.can_run = lambda chunks, mixed=True, can_run=target.can_run: (next(turns) % 2 == 0
                                                                                  and can_run(chunks, mixed))
            proposer.graphs = runner = EagerDraftGraphs(engine.model, engine.runner.cache, engine.cache.page_size,
                                                        engine.config.max_model_len, 4, "cpu", [1, 2, 4], 16, k,
                                                        draft=True, target=target)
            runner.replayed = []
            runner.phase = "further"
            launch = proposer.launch

            def launch_first(*args, launch=launch, runner=runner):
                runner.phase = "first"
                try:
                    return launch(*args)
                finally:
                    runner.phase = "further"
            proposer.launch = launch_first
        drafts = proposed[graphs] = []
        propose = proposer.propose
        proposer.propose = lambda batch: (lambda out: drafts.append(out.tolist()) or out)(propose(batch))
        assert_same_outputs(serve(llm, requests), expected, requests)
        assert engine.cache.all_free()
    assert proposed[True] == proposed[False] and any(any(len(x) > 1 for x in out) for out in proposed[True])
    assert set(runner.replayed) == {"on the step's buffers", "first", "further", "ahead"}, \
        "draft step 0 (on the target step's buffers and on its own) and the further draft steps replay graphs"


def test_structured_output_requests_decode_without_drafts_beside_speculation(tiny_dir):
    """A request under a grammar gets no drafts and samples under its mask; its output, and its free neighbours',
    equal those without speculation (greedy), with drafts half right for the free ones."""
    from qwen4exp import StructuredOutputsParams

    rng = random.Random(13)
    grammar = 'root ::= "[" num ("," " "? num){0,2} "]"\nnum ::= "-"? [1-9] [0-9]{0,2}'
    requests = []
    for i in range(8):
        kw = dict(temperature=0.0, max_tokens=14, ignore_eos=i % 2 == 1)
        if i % 2 == 0:
            kw["structured_outputs"] = StructuredOutputsParams(grammar=grammar)
        requests.append((str(i), [rng.randrange(3, 500) for _ in range(rng.randrange(2, 20))], SamplingParams(**kw)))
    small = dict(ENGINE, num_pages=64, max_num_batched_tokens=24, max_num_seqs=8)
    expected = serve(LLM(tiny_dir, **small), requests)
    llm = LLM(tiny_dir, **small, speculative_config=speculative(2))
    proposer = llm.llm_engine.spec.proposer = ScriptedProposer(
        {rid: o.outputs[0].token_ids for rid, o in expected.items()}, wrong_half)
    drafted = []
    propose = proposer.propose
    proposer.propose = lambda batch: drafted.extend(
        e.request.request_id for e in batch.entries if e.num_drafts) or propose(batch)
    assert_same_outputs(serve(llm, requests), expected, requests)
    assert all(expected[str(i)].outputs[0].finish_reason == "stop" for i in range(0, 8, 2))  # the grammar's end
    assert drafted and not {str(i) for i in range(0, 8, 2)} & set(drafted)
    assert llm.llm_engine.cache.all_free()


# ----- chained steps (the speculative overlap) -----

@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_verified_steps_layout_advanced_on_the_device_equals_the_next_steps_host_layout(tiny_dir, k):
    """ops.verified_layout.advance_verified turns the graph buffers of a step of verified requests (k drafts each) into
    those of the next step, from the kept drafts, emitted tokens and drafts on the device (for k >= 2 the further
    drafts made ahead), as the host builds them once it has read the step: ids, positions, cache slots, state slots
    (the kept row's becomes the request's own, the own one that row's spare), n-gram context and the QSA blocks
    completed (as a set: the device layout keeps entries per request), with contexts that cross pages and blocks at
    every phase."""
    from qwen4exp.engine.step_builder import RequestChunk
    from qwen4exp.ops.verified_layout import advance_verified

    llm = LLM(tiny_dir, **ENGINE, num_pages=64, speculative_config=speculative(k))
    runner = EagerSpeculativeGraphs(llm, k, [1, 2, 4], 16)
    ps, C = runner.page_size, runner.C
    rng = random.Random(3 + k)
    fields = ("input_ids", "positions", "slot_mapping", "context_lens", "state_slots", "state_token_slots",
              "ngram_context", "has_initial", "query_start_loc", "token_req", "token_local", "logits_indices")

    def blocks(buf):
        slots = buf["new_block_slots"]
        return sorted((int(slots[i]), tuple(buf["new_block_token_slots"][i].tolist()),
                       int(buf["new_block_positions"][i])) for i in range(slots.shape[0]) if slots[i])

    moved = set()
    for trial in range(12):
        n = rng.choice([1, 2, 3, 4])
        contexts = [rng.randrange(1, 40) for _ in range(n)]
        pages = [rng.sample(range(1, 64), 6) for _ in range(n)]  # 48 positions each
        slots = [rng.sample(range(1, 30), 1 + k) for _ in range(n)]  # own, then the spares
        history = [[rng.randrange(3, 500) for _ in range(rng.randrange(0, 3) if c < 2 else 2)] for c in contexts]
        ids = [[rng.randrange(3, 500) for _ in range(1 + k)] for _ in range(n)]
        chunks = [RequestChunk(ids[r], contexts[r], history[r], pages[r], slots[r][0], 0,
                               state_token_slots=slots[r][1:]) for r in range(n)]
        key, _ = runner.prepare_mixed(chunks)
        accepted = torch.tensor([rng.randrange(1 + k) for _ in range(n)])
        emitted = torch.tensor([rng.randrange(3, 500) for _ in range((1 + k) * n)])
        drafts = torch.tensor([rng.randrange(3, 500) for _ in range((1 + k) * n)])
        ahead = torch.tensor([[rng.randrange(3, 500) for _ in range(k)] for _ in range(n)]) if k > 1 else None
        advance_verified(runner.mbuf, n, ps, C, accepted, emitted, drafts, ahead)
        T = key[1]
        device = {f: runner.mbuf[f].clone() for f in fields}
        device_blocks = blocks(runner.mbuf)
        nxt = []
        for r in range(n):
            a = int(accepted[r])
            own, spares = slots[r][0], list(slots[r][1:])
            if a < k:
                own, spares[a] = spares[a], own
            moved.add(a)
            drafted = ahead[r].tolist() if k > 1 else [int(drafts[(1 + k) * r + a])]
            next_ids = [int(emitted[(1 + k) * r + a]), *drafted]
            nxt.append(RequestChunk(next_ids, contexts[r] + a + 1, history[r] + ids[r][: a + 1], pages[r], own, 0,
                                    state_token_slots=spares))
        runner.prepare_mixed(nxt)
        for f in fields:
            rows = T if runner.mbuf[f].shape[0] >= T else runner.mbuf[f].shape[0]
            assert torch.equal(device[f][:rows], runner.mbuf[f][:rows]), (trial, f)
        assert device_blocks == blocks(runner.mbuf), trial
    assert moved == set(range(k + 1)), "every number of kept drafts"


def test_a_draft_steps_rows_moved_on_the_device_equal_the_host_layout_at_their_positions(tiny_dir):
    """shift_draft_rows (a further draft step launched before the verification is read): the rows of one token per
    request laid out by the host at positions p, moved on the device by each request's kept drafts, equal the host's
    layout at those positions, QSA blocks included (a block entry per row that completes one), for contexts crossing
    pages and blocks."""
    from qwen4exp.engine.step_builder import RequestChunk
    from qwen4exp.ops.verified_layout import shift_draft_rows

    llm = LLM(tiny_dir, **ENGINE, num_pages=64, speculative_config=speculative(3))
    runner = EagerSpeculativeGraphs(llm, 3, [1, 2, 4], 16)
    ps, C = runner.page_size, runner.C
    rng = random.Random(5)
    fields = ("input_ids", "positions", "slot_mapping", "context_lens", "query_start_loc", "token_req", "token_local",
              "logits_indices")

    def blocks(buf):
        slots = buf["new_block_slots"]
        return sorted((int(slots[i]), tuple(buf["new_block_token_slots"][i].tolist()),
                       int(buf["new_block_positions"][i])) for i in range(slots.shape[0]) if slots[i])

    moved_blocks = 0
    for trial in range(16):
        n = rng.choice([1, 2, 3, 4])
        positions = [rng.randrange(0, 40) for _ in range(n)]
        shift = [rng.randrange(4) for _ in range(n)]
        pages = [rng.sample(range(1, 64), 6) for _ in range(n)]  # 48 positions each
        ids = [rng.randrange(3, 500) for _ in range(n)]

        def chunks(at):
            return [RequestChunk([ids[r]], at[r], [], pages[r], 1 + r, 0) for r in range(n)]

        runner.prepare_mixed(chunks(positions))
        shift_draft_rows(runner.mbuf, n, ps, C, torch.tensor(shift))
        device = {f: runner.mbuf[f].clone() for f in fields}
        device_blocks = blocks(runner.mbuf)
        runner.prepare_mixed(chunks([p + s for p, s in zip(positions, shift)]))
        for f in fields:
            assert torch.equal(device[f], runner.mbuf[f]), (trial, f)
        assert device_blocks == blocks(runner.mbuf), trial
        moved_blocks += device_blocks != []
    assert moved_blocks >= 4, "rows that complete QSA blocks"


def share_one_pool(target, drafter) -> None:
    """The memory pool the target's and the draft layer's graphs share, as eager runners (no capture) would not
    show it: a graph's outputs may lie where a graph captured before it keeps its intermediates (the target's
    mixed graphs, largest first, then the draft layer's, then the chained ones), so a replay here spoils the
    outputs of every graph captured after it, and its own earlier ones (ints to -1, floats to NaN); outputs kept
    outside the pool (`allocate_chained_results`) survive. A step that reads a graph's results after a replay that
    may overwrite them then gives wrong tokens on CPU too."""
    live = []  # (capture rank, output tensors)

    def wrap(run, draft: bool):
        def replay(key):
            kind = 2 if key[0] == "chained" else int(draft)
            rank = (kind, -key[1], target.variants.index(key[2]))
            for _, tensors in [x for x in live if x[0] >= rank]:
                for t in tensors:
                    t.fill_(-1 if not t.is_floating_point() else float("nan"))
            live[:] = [x for x in live if x[0] < rank]
            out = run(key)
            kept = {x.untyped_storage().data_ptr() for x in target.chained_out or ()}
            live.append((rank, [t for t in (out if isinstance(out, tuple) else (out,))
                                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in kept]))
            return out
        return replay

    target._run, drafter._run = wrap(target._run, False), wrap(drafter._run, True)


class ScriptedDraftGraphs:
    """The draft layer's CUDA-graph runner executed eagerly (no capture), its drafts replaced by a script: at
    the row of position p of a request, the token at p + 2 of its sequence as decoding without speculation produced
    it (`expected`: request id -> prompt + output), wrong where wrong_half(p). Requests are told apart by their first
    page (block table column 0)."""

    def __new__(cls, engine, target, expected: dict[str, list[int]], k: int = 1):
        from qwen4exp.engine.cuda_graph import CUDAGraphRunner

        class Runner(CUDAGraphRunner):
            def _run(self, key):
                meta = self._mixed_meta(*key[1:])
                return self.forward(meta, meta.logits_indices)

            def draft_forward(self, meta, streams):  # also the draft layer's part of a chained step's graph
                tokens, streams = super().draft_forward(meta, streams)
                owner = {r.pages[0]: r.request_id for r in engine.scheduler.running if r.pages}
                first_page = self.mbuf["block_tables"][:, 0][meta.token_req]
                for t in range(meta.num_tokens):
                    rid = owner.get(int(first_page[t]))
                    if rid is None:
                        continue
                    p, seq = int(meta.token_pos[t]), expected[rid]
                    draft = seq[p + 2] if p + 2 < len(seq) else 3
                    tokens[t] = (draft + 1) % 500 if wrong_half(p) else draft
                return tokens, streams

        c = engine.config
        return Runner(engine.model, engine.runner.cache, engine.cache.page_size, c.max_model_len, target.max_batch,
                      engine.device, target.buckets, c.max_num_batched_tokens, k, draft=True, target=target)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_chained_steps_give_decodings_outputs(tiny_dir, monkeypatch, k):
    """Steps launched before the step before them is read (SpecDecoder.chain: the layout derived on the device, on
    the graphs' buffers run eagerly; for k >= 2 with the further drafts made before the read, the rows moved on the
    device) give the outputs of decoding without speculation, with drafts half right:
    requests stopping on a token inside a chain (its chained step's tokens dropped), one aborted while a chained step
    is in flight, one arriving during a chain (which then stops for its prefill), chains stopped by pages running
    short; every chained step verifies the drafts the draft layer made for its positions; every page and slot is
    free afterwards."""
    from qwen4exp import ops

    rng = random.Random(21)
    requests = [(str(i), [rng.randrange(3, 500) for _ in range(rng.randrange(12, 40))],
                 SamplingParams(temperature=0.0, max_tokens=rng.randrange(14, 30) + 16 * (k - 1), ignore_eos=True))
                for i in range(4)]  # longer with more drafts: as many steps
    small = dict(ENGINE, num_pages=22, max_num_batched_tokens=64, max_num_seqs=4)
    expected = generate(LLM(tiny_dir, **small), requests)
    rid, prompt, params = requests[1]  # stops on its sixth token
    requests[1] = (rid, prompt, SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                                               stop_token_ids=[expected[rid].outputs[0].token_ids[5]]))
    expected = generate(LLM(tiny_dir, **small), requests)
    sequences = {rid: prompt + expected[rid].outputs[0].token_ids for rid, prompt, _ in requests}
    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    llm = LLM(tiny_dir, **small, speculative_config=speculative(k))
    engine = llm.llm_engine
    target = engine.runner.graphs = EagerSpeculativeGraphs(llm, k, [1, 2, 4], 64)
    engine.spec.proposer.graphs = ScriptedDraftGraphs(engine, target, sequences, k)
    target.chains = True  # its chained steps' graphs run eagerly too, with the scripted drafts
    target.allocate_chained_results()
    share_one_pool(target, engine.spec.proposer.graphs)
    run, checked = target._run, []

    def run_and_check_drafts(key):
        """A chained step: its draft rows (a request's rows after its first) hold the script's drafts there."""
        if key[0] == "chained":
            meta = target._mixed_meta(*key[1:])
            owner = {r.pages[0]: r.request_id for r in engine.scheduler.running if r.pages}
            first_page = target.mbuf["block_tables"][:, 0][meta.token_req]
            for t in range(int(meta.query_start_loc[-2])):
                rid = owner.get(int(first_page[t]))
                if rid is not None and int(meta.token_local[t]) > 0:
                    q, seq = int(meta.token_pos[t]), sequences[rid]
                    draft = seq[q] if q < len(seq) else 3
                    checked.append(int(meta.input_ids[t]) == ((draft + 1) % 500 if wrong_half(q - 2) else draft))
        return run(key)
    target._run = run_and_check_drafts
    chain, chained = engine.spec.chain, []
    engine.spec.chain = lambda eng, step: (lambda nxt: chained.append(nxt is not None) or nxt)(chain(eng, step))
    reserve, reservations = engine.scheduler.reserve, []

    def short_every_seventh(reqs, reach):  # as when the free pages run short: the chain stops for an ordinary step
        reservations.append(len(reservations) % 7 != 6)
        return reserve(reqs, reach) if reservations[-1] else None
    engine.scheduler.reserve = short_every_seventh
    outputs, aborted = {}, False
    for rid, prompt, params in requests[:3]:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if engine._inflight is not None and sum(chained) == 3:  # a chained step in flight
            engine.abort_request("2")
            aborted = True
        if sum(chained) == 6 and "3" not in engine.output_processor.parents and "3" not in outputs:
            rid, prompt, params = requests[3]
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    assert aborted and "2" not in outputs
    assert_same_outputs(outputs, expected, [r for r in requests if r[0] != "2"])
    assert sum(chained) > 10 and not all(chained), "chained steps and steps that could not chain"
    assert engine.spec.chained_steps == sum(chained)  # the share spec_trained reports
    assert len(checked) >= k * sum(chained) and all(checked), "the drafts of the chained steps"
    assert not all(reservations), "chains stopped for want of pages"
    assert engine.cache.all_free()
