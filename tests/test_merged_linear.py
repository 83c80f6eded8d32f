"""MergedLinear: one GEMM over its parts' stacked weights equals the separate projections; parts load by name."""

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_config, hf_logprobs, hf_model, our_llm, random_prompt

from qwen4exp import SamplingParams
from qwen4exp.model.merged_linear import MergedLinear, TensorShapeError, named_checkpoint_tensors


def test_parts_equal_separate_projections_with_and_without_bias():
    g = torch.Generator().manual_seed(0)
    parts = {"a": 5, "b.inner": 1, "c": 7}
    weights = {n: torch.randn(rows, 12, generator=g) for n, rows in parts.items()}
    biases = {"a": torch.randn(5, generator=g), "c": torch.randn(7, generator=g)}
    merged = MergedLinear(12, parts, bias_parts=("a", "c"))
    assert merged.weight.shape == (16, 12) and merged.bias.shape == (16,)  # 13 rows, padded to 16
    for name in parts:
        merged.load_part_(f"{name}.weight", weights[name], f"x.{name}.weight")
        if name in biases:
            merged.load_part_(f"{name}.bias", biases[name], f"x.{name}.bias")
    x = torch.randn(3, 12, generator=g)
    with torch.no_grad():
        outs = merged(x)
    assert len(outs) == 3
    for name, y in zip(parts, outs):
        torch.testing.assert_close(y, F.linear(x, weights[name], biases.get(name)))
    assert not merged.weight[13:].any() and not merged.bias[5:6].any() and not merged.bias[13:].any()
    # re-allocated uninitialised (as build_model does), then loaded: the rows no tensor fills are zeroed
    merged.weight.data.fill_(float("nan"))
    merged.bias.data.fill_(float("nan"))
    merged.zero_unused_()
    for name in parts:
        merged.load_part_(f"{name}.weight", weights[name], f"x.{name}.weight")
        if name in biases:
            merged.load_part_(f"{name}.bias", biases[name], f"x.{name}.bias")
    with torch.no_grad():
        for name, y in zip(parts, merged(x)):
            torch.testing.assert_close(y, F.linear(x, weights[name], biases.get(name)))


def test_checkpoint_names_of_parts_are_relative_to_the_parent():
    root = torch.nn.Module()
    root.block = torch.nn.Module()
    root.block.proj = MergedLinear(4, {"q_proj": 2, "sub.k_proj": 3})
    root.block.out = torch.nn.Linear(4, 4, bias=False)
    entries = {t.name: t for t in named_checkpoint_tensors(root)}
    assert list(entries) == ["block.q_proj.weight", "block.sub.k_proj.weight", "block.out.weight"]
    assert entries["block.sub.k_proj.weight"].parameter == "block.proj.stacks.0.weight"
    assert entries["block.sub.k_proj.weight"].tensor.data_ptr() == root.block.proj.weight[2:].data_ptr()
    with pytest.raises(TensorShapeError) as e:
        entries["block.sub.k_proj.weight"].load_(torch.zeros(2, 4), "ckpt.block.sub.k_proj.weight")
    assert str(e.value) == "ckpt.block.sub.k_proj.weight: checkpoint (2, 4), model (3, 4)"


def test_attention_bias_parts_match_transformers():
    """q/k/v biases are parts of the merged projection's bias; the indexer's part has none."""
    hf = hf_model(hf_config(attention_bias=True), seed=3)
    llm = our_llm(hf)
    prompt = random_prompt(torch.Generator().manual_seed(1), 30, hf.config.vocab_size)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
    ref = hf_logprobs(hf, prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
