"""The parity check is sensitive: perturbing any parameter kind or any component of the computation moves the
logprobs by far more than the 1e-4 parity tolerance. If one of these passed unnoticed, a bug in that component
could hide from tests/test_parity.py."""

import re

import pytest
import torch
from helpers import hf_config, hf_logprobs, hf_model, our_llm, random_prompt

from qwen4exp import ops
from qwen4exp.engine.step_builder import RequestChunk
from qwen4exp.model.merged_linear import named_checkpoint_tensors, quantizable_weights

SENSITIVITY = 1e-3


@pytest.fixture(scope="module")
def setup():
    hf = hf_model(hf_config(ple_layer_ids=[1, 2]), seed=11)
    llm = our_llm(hf)
    gen = torch.Generator().manual_seed(4)
    prompt = random_prompt(gen, 48, hf.config.vocab_size, eos_every=9)
    return hf, llm, prompt, hf_logprobs(hf, prompt)


def run(llm, prompt, split=(20, 1, 27)):
    """Prefill in chunks (so conv/recurrent states and cached block keys are exercised) -> logprobs."""
    engine = llm.llm_engine
    cache = engine.cache
    pages, slot = cache.pages.allocate(cache.pages_needed(len(prompt))), cache.slots.allocate(1)[0]
    try:
        rows, pos = [], 0
        for n in split:
            rows.append(engine.runner.execute([RequestChunk(prompt[pos:pos + n], pos, prompt[:pos], pages, slot, 0)]))
            pos += n
        return torch.log_softmax(torch.cat(rows), -1)
    finally:
        cache.pages.free(pages)
        cache.slots.free([slot])


def test_unperturbed_matches(setup):
    hf, llm, prompt, ref = setup
    torch.testing.assert_close(run(llm, prompt), ref, atol=1e-4, rtol=0)


def _tensor_kinds(model):
    """One checkpoint tensor of each kind (its name with layer numbers as N): every part of a merged projection is a
    kind of its own."""
    kinds = {}
    for t in named_checkpoint_tensors(model):
        kinds.setdefault(re.sub(r"\.\d+\.", ".N.", t.name), t)
    return sorted(kinds.items())


def test_perturbed_kinds_cover_every_checkpoint_tensor(setup):
    hf, llm, prompt, ref = setup
    kinds = dict(_tensor_kinds(llm.llm_engine.model))
    assert {re.sub(r"\.\d+\.", ".N.", n) for n in hf.state_dict() if "ngram_heads" not in n
            and "layer_multipliers" not in n} == set(kinds)
    assert kinds["model.layers.N.linear_attn.in_proj_b.weight"].tensor.shape == (4, 32)


def _insensitive_kinds(llm, prompt, ref) -> list[tuple[str, float]]:
    """The tensor kinds whose perturbation moves the logprobs by less than SENSITIVITY."""
    insensitive = []
    for kind, t in _tensor_kinds(llm.llm_engine.model):
        saved = t.tensor.clone()
        noise = torch.randn(t.tensor.shape, generator=torch.Generator().manual_seed(0))
        # the indexer only acts through a discrete top-k, so it needs a push large enough to reorder blocks
        indexer = ".indexer." in t.name
        if kind.endswith("_scale_inv"):  # each block's scale by its own factor
            t.tensor.mul_(1 + (0.5 if indexer else 0.1) * noise)
        elif t.tensor.dtype == torch.float8_e4m3fn:  # in the units of the fp8 values
            t.tensor.copy_((saved.float() + noise * (5.0 if indexer else 0.05) * saved.float().std()).to(saved.dtype))
        else:
            t.tensor.add_(noise * (1.0 if indexer else 0.05 * (saved.float().std().item() or 1.0)))
        try:
            diff = (run(llm, prompt) - ref).abs().max().item()
        finally:
            t.tensor.copy_(saved)
        if diff < SENSITIVITY:
            insensitive.append((kind, diff))
    return insensitive


def test_every_parameter_kind_matters(setup):
    hf, llm, prompt, ref = setup
    insensitive = _insensitive_kinds(llm, prompt, ref)
    assert not insensitive, f"perturbing these parameters went unnoticed: {insensitive}"


@pytest.fixture(scope="module")
def fp8_setup():
    """A model of 2 x 128 hidden columns, so that each fp8 weight's scales have several blocks (a uniform scale of a
    projection followed by a norm would change nothing), quantized to fp8 on load; the reference is its own run."""
    hf = hf_model(hf_config(ple_layer_ids=[1, 2], hidden_size=256), seed=11)
    llm = our_llm(hf, quantization="fp8")
    prompt = random_prompt(torch.Generator().manual_seed(4), 48, hf.config.vocab_size, eos_every=9)
    return hf, llm, prompt, run(llm, prompt)


def test_every_fp8_tensor_kind_matters(fp8_setup):
    """In an fp8 model each weight's block scales are a checkpoint tensor kind of their own: an fp8 GEMM reads a
    part's scale rows apart from its weight rows, so a kernel could read the weight right and its scales wrong.
    Perturbing any kind, the scales included, moves the fp8 model's logprobs by far more than the tolerance."""
    hf, llm, prompt, ref = fp8_setup
    model = llm.llm_engine.model
    kinds = dict(_tensor_kinds(model))
    scales = {kind for kind in kinds if kind.endswith("_scale_inv")}
    assert scales == {re.sub(r"\.\d+\.", ".N.", w) + "_scale_inv" for w in quantizable_weights(model)}
    assert set(kinds) - scales == {re.sub(r"\.\d+\.", ".N.", n) for n in hf.state_dict() if "ngram_heads" not in n
                                   and "layer_multipliers" not in n}
    assert kinds["model.layers.N.mlp.experts.gate_up_proj_scale_inv"].tensor.shape == (8, 2, 2)
    insensitive = _insensitive_kinds(llm, prompt, ref)
    assert not insensitive, f"perturbing these parameters of the fp8 model went unnoticed: {insensitive}"



COMPONENT_FAULTS = {
    "ngram EOS reset ignored": ("ngram", "shifted_tokens_ref",
                                lambda orig: lambda ids, q, c, eos, n: orig(ids, q, c, -7, n)),
    "ngram hash order swapped": ("ngram", "ngram_ids",
                                 lambda orig: lambda t, m, s, o, h: orig(t.flip(1).contiguous(), m, s, o, h)),
    "QSA keeps the first blocks": ("qsa", "qsa_select_ref", lambda orig: lambda q, *a: orig(q.abs() * 0 + 1, *a)),
    "QSA dense": ("attention", "paged_attention_ref", lambda orig: lambda *a: orig(*a[:7], None)),
    "conv without state": ("conv", "causal_conv1d_ref",
                           lambda orig: lambda x, w, st, q, sl, hi, *a: orig(x, w, st, q, sl, [False] * len(hi), *a)),
    "GDN state dropped between chunks": (
        "gated_delta", "gated_delta_rule_ref",
        lambda orig: lambda q, k, v, g, b, st, qsl, sl, hi, *a: orig(q, k, v, g, b, st, qsl, sl, [False] * len(hi),
                                                                        *a)),
    "GDN decay halved": ("gated_delta", "gated_delta_rule_ref",
                         lambda orig: lambda q, k, v, g, *a: orig(q, k, v, g * 0.5, *a)),
    "rope dims shifted": ("rotary", "apply_rope", lambda orig: lambda x, c, s: orig(x, c.roll(1, -1), s)),
    "norm eps x1e4": ("norm", "rms_norm", lambda orig: lambda x, w, eps, g=None: orig(x, w, eps * 1e4, g)),
    "routed experts top-k renormalisation off": (
        "moe", "moe_experts_ref", lambda orig: lambda x, gu, d, ids, w, *scales: orig(x, gu, d, ids, w * 0.9, *scales)),
}


@pytest.mark.parametrize("fault", list(COMPONENT_FAULTS))
def test_component_fault_is_detected(setup, fault, monkeypatch):
    hf, llm, prompt, ref = setup
    module_name, fn_name, make = COMPONENT_FAULTS[fault]
    module = getattr(ops, module_name)
    monkeypatch.setattr(module, fn_name, make(getattr(module, fn_name)))
    diff = (run(llm, prompt) - ref).abs().max().item()
    assert diff > SENSITIVITY, f"{fault}: max logprob change {diff:.2e}"
