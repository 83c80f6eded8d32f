"""Sampling parameters and detokenization behave as in vLLM."""

import pytest
import torch

from qwen4exp import LLM, SamplingParams
from qwen4exp.engine.detokenizer import IncrementalDetokenizer
from qwen4exp.engine.request import Request
from qwen4exp.engine.sampler import apply_penalties
from qwen4exp.weights.random_checkpoint import make_random


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=2)
    return LLM(d, dtype="float32", device="cpu", max_model_len=128, num_pages=64, page_size=8)


PROMPT = {"prompt_token_ids": [20, 21, 22, 23, 24]}


def gen(llm, **kw):
    kw.setdefault("max_tokens", 8)
    return llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)[0]


def test_filters_that_leave_one_token_equal_greedy(llm):
    greedy = gen(llm, temperature=0).outputs[0].token_ids
    assert gen(llm, temperature=1.0, top_k=1, seed=1).outputs[0].token_ids == greedy
    assert gen(llm, temperature=1.0, top_p=1e-6, seed=2).outputs[0].token_ids == greedy
    assert gen(llm, temperature=1.0, min_p=1.0, seed=3).outputs[0].token_ids == greedy
    assert gen(llm, temperature=1.0, seed=4, max_tokens=16).outputs[0].token_ids != gen(
        llm, temperature=0, max_tokens=16).outputs[0].token_ids


def test_logit_bias_min_tokens_and_stop_token_ids(llm):
    out = gen(llm, temperature=0, logit_bias={77: 100.0}, stop_token_ids=[77], min_tokens=3, max_tokens=10).outputs[0]
    assert out.token_ids[:3] != [77] * 3 and 77 not in out.token_ids[:3]
    assert out.token_ids[-1] == 77 and len(out.token_ids) == 4
    assert out.finish_reason == "stop" and out.stop_reason == 77


def test_penalties_change_greedy_choices(llm):
    base = gen(llm, temperature=0, max_tokens=24, ignore_eos=True).outputs[0].token_ids
    rep = gen(llm, temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=50.0).outputs[0].token_ids
    pres = gen(llm, temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=2.0,
               frequency_penalty=2.0).outputs[0].token_ids
    assert len(set(rep)) >= len(set(base)) and rep != base
    assert pres != base
    assert not set(rep) & set(PROMPT["prompt_token_ids"]) or len(set(rep)) > len(set(base))


def _penalised_row(row, req, stop_ids):
    """vLLM's logits processors for one row, as its docs state them (the batched apply_penalties must equal this)."""
    p, vocab = req.params, row.shape[0]
    fp32 = lambda x: torch.tensor(x, dtype=row.dtype)  # noqa: E731  the arithmetic in the logits' dtype
    for t, v in (p.logit_bias or {}).items():
        if t < vocab:
            row[t] += fp32(v)
    if len(req.output_token_ids) < p.min_tokens:
        row[[t for t in stop_ids if t < vocab]] = float("-inf")
    if p.repetition_penalty != 1.0:
        for t in set(req.prompt_token_ids + req.output_token_ids):
            row[t] = row[t] / fp32(p.repetition_penalty) if row[t] > 0 else row[t] * fp32(p.repetition_penalty)
    for t in set(req.output_token_ids):
        row[t] -= fp32(p.frequency_penalty) * req.output_token_ids.count(t) + fp32(p.presence_penalty)
    return row


def test_batched_penalties_equal_each_rows_penalties():
    """Rows with every combination of logit_bias, min_tokens, repetition / frequency / presence penalties (and rows
    with none) get exactly what each would get alone; ids past the vocabulary are ignored."""
    g = torch.Generator().manual_seed(0)
    vocab = 50
    configs = [dict(), dict(logit_bias={3: 5.0, 7: -2.5, 60: 1.0}), dict(min_tokens=4), dict(repetition_penalty=1.7),
               dict(repetition_penalty=0.6, frequency_penalty=0.3), dict(presence_penalty=1.1),
               dict(frequency_penalty=-0.4, presence_penalty=0.2, logit_bias={4: 1.5}, min_tokens=2),
               dict(repetition_penalty=1.3, presence_penalty=0.5), dict(frequency_penalty=0.7)]
    requests, stops = [], []
    for n, kw in enumerate(configs * 2):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        outputs = torch.randint(0, vocab, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
        requests.append(Request(f"r{n}", prompt, SamplingParams(**kw), output_token_ids=outputs))
        stops.append([1, 2, 70])
    logits = torch.randn(len(requests), vocab, generator=g) * 3
    want = torch.stack([_penalised_row(row.clone(), r, s) for row, r, s in zip(logits, requests, stops)])
    got = apply_penalties(logits.clone(), requests, stops)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)


def test_n_and_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=3),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for tok, entry in zip(o.token_ids, o.logprobs):
            assert tok in entry and 3 <= len(entry) <= 4
            ranks = sorted(lp.rank for t, lp in entry.items() if t != tok or entry[t].rank <= 3)
            assert ranks[:3] == [1, 2, 3]
        assert o.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(o.logprobs, o.token_ids)))


def test_stop_strings(llm):
    base = gen(llm, temperature=0, max_tokens=20, ignore_eos=True).outputs[0]
    text = base.text
    stop = text[5:8]
    out = gen(llm, temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = gen(llm, temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
               include_stop_str_in_output=True).outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_incremental_detokenization_handles_multibyte_and_holds_back_stop_prefixes(llm):
    tok = llm.get_tokenizer()
    text = "Café 你好 😀 do"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["do!"])
    streamed = ""
    for t in ids:
        detok.add(t)
        delta = detok.delta(finished=False)
        assert "\ufffd" not in delta
        streamed += delta
    assert streamed == "Café 你好 😀 "  # "do" could still become the stop string "do!": held back
    streamed += detok.delta(finished=True)
    assert streamed == text


@pytest.mark.parametrize("bad, field", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                        (dict(n=0), "n"), (dict(top_k=-5), "top_k"), (dict(min_p=2), "min_p"),
                                        (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=5, max_tokens=2),
                                                                             "min_tokens"),
                                        (dict(repetition_penalty=0), "repetition_penalty"),
                                        (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"),
                                        (dict(allowed_token_ids=[]), "allowed_token_ids"),
                                        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
                                        (dict(bad_words=[" "]), "bad_words"),
                                        (dict(bad_words=["x"] * 129), "bad_words")])
def test_invalid_sampling_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    expected = tok.encode("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    assert torch.tensor(out.outputs[0].token_ids).numel() == 2


@pytest.mark.parametrize("seeded_rows", [(), (1, 3)])
def test_temperature_sampling_follows_the_softmax(seeded_rows):
    """Rows without a seed share one draw from the engine's generator, seeded rows draw from their own: either way
    every row's tokens follow softmax(logits / temperature)."""
    from qwen4exp.engine.request import Request
    from qwen4exp.engine.sampler import Sampler

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    temperature = 0.7
    logits = (probs.log() * temperature).repeat(4, 1)  # softmax(logits / temperature) = probs on every row
    requests = [Request(f"r{i}", [1], SamplingParams(temperature=temperature, seed=7 + i if i in seeded_rows else None))
                for i in range(4)]
    sampler = Sampler("cpu", seed=0)
    draws = 3000
    counts = torch.zeros(4, 4)
    for _ in range(draws):
        tokens = sampler.sample(logits, requests, [[] for _ in requests]).to_host().token_ids
        counts[torch.arange(4), torch.tensor(tokens)] += 1
    freq = counts / draws
    assert (freq - probs).abs().max() < 0.035, freq  # ~4 standard errors at p = 0.5
    assert not torch.equal(counts[0], counts[2])  # rows draw independent noise


def test_bf16_logits_sample_as_their_fp32_widening():
    """The sampler takes logits of any float dtype (the model's are fp32). Greedy rows take the argmax of bf16 rows
    as they are; sampling, penalties and logprobs widen them to fp32 first: every result equals that of the widened
    logits, and the caller's logits are left untouched."""
    from qwen4exp.engine.request import Request
    from qwen4exp.engine.sampler import Sampler

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 300, generator=g) * 3).to(torch.bfloat16)
    logits[0, 17] = logits[0, 250] = logits[0].max() + 1  # a tie: both pick the first index
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, seed=5, logprobs=2),
              SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=9)]
    requests = [Request(f"r{i}", [3, 17, 250], p) for i, p in enumerate(params)]
    before = logits.clone()
    got = Sampler("cpu", seed=1).sample(logits, requests, [[] for _ in requests]).to_host()
    want = Sampler("cpu", seed=1).sample(logits.float(), requests, [[] for _ in requests]).to_host()
    assert torch.equal(logits, before)
    assert got.token_ids[0] == 17
    assert got.token_ids == want.token_ids and got.ranks == want.ranks and got.topk_ids == want.topk_ids
    assert got.logprobs == want.logprobs and got.topk_logprobs == want.topk_logprobs


def contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i: i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_allowed_token_ids_bound_every_sampled_token(llm):
    allowed = list(range(100, 140))
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    greedy = llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    assert not set(greedy) <= set(allowed)  # left alone, the model leaves the set
    # four seeded streams and a request without the mask in the same batch
    bounded = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    outs = llm.generate([PROMPT, PROMPT], [bounded, free], use_tqdm=False)
    assert all(set(o.token_ids) <= set(allowed) for o in outs[0].outputs)
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) > 1
    assert outs[1].outputs[0].token_ids == greedy
    one = gen(llm, temperature=0, max_tokens=4, ignore_eos=True, allowed_token_ids=[77], logprobs=0).outputs[0]
    assert one.token_ids == [77] * 4
    with pytest.raises(ValueError, match="allowed_token_ids"):
        gen(llm, allowed_token_ids=[10**6])


def test_bad_words_are_never_generated(llm):
    """vLLM's rule: a one-token word is never sampled; a longer word's last token is not sampled right after the
    rest of it, which the request generated."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids

    def encodes_as(ids):
        return tok.encode(tok.decode(ids).lstrip(), add_special_tokens=False) == ids

    # a two-token word the greedy output contains (first there at i)
    i = next(i for i in range(1, len(base) - 1) if encodes_as(base[i: i + 2]) and not contains(base[: i + 1],
                                                                                                base[i: i + 2]))
    word = base[i: i + 2]
    out = gen(llm, temperature=0, max_tokens=16, ignore_eos=True, bad_words=[tok.decode(word)]).outputs[0].token_ids
    assert out[: i + 1] == base[: i + 1] and out[i + 1] != word[1]  # only the word's last token was refused
    assert not contains(out, word)
    single = next(t for t in base if encodes_as([t]))
    out = gen(llm, temperature=0, max_tokens=16, ignore_eos=True, bad_words=[tok.decode([single])]).outputs[0]
    assert single not in out.token_ids

    # sampled, with a bias that makes a token follow itself at every step: the word "tt" is never generated
    t = next(t for t in range(100, 400) if encodes_as([t, t]))
    biased = dict(temperature=1.0, max_tokens=10, ignore_eos=True, logit_bias={t: 100.0})
    assert gen(llm, seed=1, **biased).outputs[0].token_ids == [t] * 10
    outs = llm.generate([PROMPT], SamplingParams(n=3, seed=5, bad_words=[tok.decode([t, t])], **biased),
                        use_tqdm=False)[0].outputs
    for o in outs:
        assert not contains(o.token_ids, [t, t]) and o.token_ids[::2] == [t] * 5


def test_bad_words_token_ids_follow_vllm():
    """Each word as it starts a text; also after a space where the space merges into a first token of its own."""
    from qwen4exp.engine.request import bad_word_variants, bad_words_token_ids

    assert bad_word_variants([" ab", "c"]) == ["ab", " ab", "c", " c"]
    # "ab": [5, 6] and " ab": [7, 6] (merged space); "c": [9] and " c": [1, 9] (a separate space token)
    assert bad_words_token_ids([[5, 6], [7, 6], [9], [1, 9]]) == [[5, 6], [7, 6], [9]]
    with pytest.raises(ValueError, match="bad_words"):
        bad_words_token_ids([[1] * 600, [2] * 600])


def test_chat_takes_text_parts(llm):
    greedy = SamplingParams(max_tokens=3, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hi\nthere"}]
    a, b = (llm.chat(m, greedy, use_tqdm=False)[0] for m in (parts, joined))
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(ValueError, match="messages: content part type 'image_url' is not supported"):
        llm.chat(image, greedy, use_tqdm=False)
