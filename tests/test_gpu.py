"""On a GPU: the fast paths (Triton kernels, fla, inductor-fused ops) and CUDA-graph decode, in fp32, against
transformers' full forward. Skipped without CUDA; run on the H200 with `python -m pytest tests/test_gpu.py`."""

import pytest
import torch
from helpers import hf_config, hf_logprobs, hf_model, our_llm, random_prompt

from qwen4exp import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_gpu_fast_paths_and_graphs_match_transformers():
    hf = hf_model(hf_config(ple_layer_ids=[1, 2], indexer_budget=16, linear_key_head_dim=16,
                            linear_value_head_dim=16, head_dim=32), seed=7)
    llm = our_llm(hf, device="cuda", max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.llm_engine.runner.graphs is not None
    gen = torch.Generator().manual_seed(9)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=13) for n in (5, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        ref = hf_logprobs(hf, prompt + ids[:-1])
        assert ids == ref[len(prompt) - 1:].argmax(-1).tolist()
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, ids)])
        want = ref[torch.arange(len(prompt) - 1, len(prompt) + len(ids) - 1), torch.tensor(ids)]
        torch.testing.assert_close(ours, want, atol=2e-4, rtol=0)
        ours_p = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        want_p = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(ours_p, want_p, atol=2e-4, rtol=0)
    assert llm.llm_engine.cache.all_free()
