"""The model equals transformers' Qwen4ExpForCausalLM (full forward, no cache) on the same weights."""

import pytest
import torch
from helpers import EOS, hf_config, hf_logprobs, hf_model, our_llm, random_prompt

from qwen4exp import SamplingParams

CONFIGS = {
    "hc4-ng3-ple1": dict(),
    "hc2-ng2-ple2": dict(hc_count=2, ngram_size=2, ple_layer_ids=[1, 2], heads_per_ngram=4),
    "hc4-ng4-ple2-silu": dict(ngram_size=4, heads_per_ngram=2, ple_embed_dim=24, ple_layer_ids=[1, 3],
                              output_gate_type=None),
    "hc3-ple0": dict(hc_count=3, ple_layer_ids=None),
    "hc2-ng3-8layers-c2": dict(hc_count=2, num_hidden_layers=8, indexer_budget=6, indexer_compress_ratio=2,
                               ple_layer_ids=[3, 6]),
}
LENGTHS = [3, 23, 61]  # short (dense), and longer than budget + tail so top-k really selects


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    hf = hf_model(hf_config(**CONFIGS[request.param]), seed=len(request.param))
    return hf, our_llm(hf, max_num_batched_tokens=40)


def test_prompt_logprobs_and_greedy_tokens_match(pair):
    hf, llm = pair
    gen = torch.Generator().manual_seed(1)
    prompts = [random_prompt(gen, n, hf.config.vocab_size) for n in LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    # all prompts in one batch: mixed lengths, chunked prefill (budget 40 tokens per step)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        gen_ids = out.outputs[0].token_ids
        assert len(gen_ids) == 32
        ref = hf_logprobs(hf, prompt + gen_ids[:-1])
        ours_prompt = torch.tensor([lp[tok].logprob for lp, tok in zip(out.prompt_logprobs[1:], prompt[1:])])
        ref_prompt = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(ours_prompt, ref_prompt, atol=1e-4, rtol=0)
        # greedy: each generated token is the reference's argmax given everything before it
        ref_next = ref[len(prompt) - 1:].argmax(-1).tolist()
        assert gen_ids == ref_next
        ours_gen = torch.tensor([lp[tok].logprob for lp, tok in zip(out.outputs[0].logprobs, gen_ids)])
        ref_gen = ref[torch.arange(len(prompt) - 1, len(prompt) + 31), torch.tensor(gen_ids)]
        torch.testing.assert_close(ours_gen, ref_gen, atol=1e-4, rtol=0)
    assert llm.llm_engine.cache.all_free()


def test_random_chunking_equals_one_pass(pair):
    """Any split of a request into chunks, in any batch composition, gives the full pass's logits."""
    from qwen4exp.engine.step_builder import RequestChunk

    hf, llm = pair
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(2)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=7) for n in (45, 30, 52)]
    refs = [hf_logprobs(hf, p) for p in prompts]
    cache = engine.cache
    state = [dict(pos=0, pages=cache.pages.allocate(cache.pages_needed(len(p))), slot=cache.slots.allocate(1)[0],
                  rows=[]) for p in prompts]
    try:
        while any(s["pos"] < len(p) for s, p in zip(state, prompts)):
            chunks, owners = [], []
            for i in torch.randperm(len(prompts), generator=gen).tolist():  # random batch order
                s, p = state[i], prompts[i]
                if s["pos"] >= len(p) or torch.rand(1, generator=gen).item() < 0.3:
                    continue
                n = int(torch.randint(1, 12, (1,), generator=gen))
                ids = p[s["pos"]: s["pos"] + n]
                chunks.append(RequestChunk(ids, s["pos"], p[: s["pos"]], s["pages"], s["slot"], 0))
                owners.append((i, len(ids)))
                s["pos"] += len(ids)
            if not chunks:
                continue
            logits = engine.runner.execute(chunks)
            row = 0
            for i, n in owners:
                state[i]["rows"].append(logits[row: row + n])
                row += n
        for s, ref in zip(state, refs):
            torch.testing.assert_close(torch.log_softmax(torch.cat(s["rows"]), -1), ref, atol=1e-4, rtol=0)
    finally:
        for s in state:
            cache.pages.free(s["pages"])
            cache.slots.free([s["slot"]])


def test_eos_in_prompt_resets_ngrams():
    """A prompt with EOS gives different PLE input than the same prompt with the EOS replaced (sanity of the
    parity configuration: EOS handling is exercised, not just present)."""
    hf = hf_model(hf_config(), seed=5)
    gen = torch.Generator().manual_seed(3)
    p = random_prompt(gen, 20, hf.config.vocab_size, eos_every=None)
    q = list(p)
    q[8] = EOS
    a, b = hf_logprobs(hf, p), hf_logprobs(hf, q)
    assert (a[9:12] - b[9:12]).abs().max() > 1e-3
