"""Checkpoint loading: layouts, shards, and errors that list the offending tensors by name."""

import os
import re

import pytest
import torch
from helpers import load_peak_rss
from safetensors.torch import save_file

from qwen4exp.config import load_model_config
from qwen4exp.engine.step_builder import RequestChunk, StepBuilder
from qwen4exp.model import Qwen4ExpForCausalLM, allocate_cache
from qwen4exp.model.merged_linear import MergedLinear, named_checkpoint_tensors
from qwen4exp.ops import hyper_connection as hc_ops
from qwen4exp.ops import linear as linear_ops
from qwen4exp.weights.loader import WeightLoadError, dummy_weights_, load_model
from qwen4exp.weights.random_checkpoint import make_random
from qwen4exp.weights.safetensors_io import checkpoint_files, iterate_files


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=3)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return load_model(load_model_config(tiny_dir), tiny_dir, torch.float32, "cpu").state_dict()


def tensors(model_dir) -> dict:
    return dict(iterate_files(checkpoint_files(model_dir)))


def copy_checkpoint(src, dst, mutate) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(src, f)) as a, open(os.path.join(dst, f), "w") as b:
            b.write(a.read())
    save_file(mutate(tensors(src)), os.path.join(dst, "model.safetensors"))
    return dst


def load(d):
    return load_model(load_model_config(d), d, torch.float32, "cpu").state_dict()


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_released_layout_per_expert_and_shards(tiny_dir, reference):
    names = tensors(tiny_dir).keys()
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight" in names
    assert "model.layers.1.ple.ple_embedding.layer_multipliers" in names
    assert reference["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)


def test_checkpoint_names_are_transformers_names(tiny_dir):
    """make-random writes transformers' parameter names (experts and n-gram tables split per expert and shard), not
    the merged projections' parameter names; and the MTP layer's (`mtp.*`, which transformers ignores) under the
    same rules."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_dir))
    names = set()
    for name in tensors(tiny_dir):
        name = re.sub(r"experts\.\d+\.(gate|up)_proj\.weight$", "experts.gate_up_proj", name)
        names.add(re.sub(r"(experts\.)\d+\.down_proj\.weight$|(ngram_embedding\.)shard_\d+\.(weight)$",
                         lambda m: m[1] + "down_proj" if m[1] else m[2] + m[3], name))
    mtp = {n for n in names if n.startswith("mtp.")}
    assert names - mtp == set(hf.state_dict())
    assert "model.layers.0.linear_attn.in_proj_b.weight" in names
    # the MTP layer is named as transformers names a decoder layer, under mtp.layers.0
    layer = {n.removeprefix("model.layers.3.") for n in hf.state_dict() if n.startswith("model.layers.3.")}
    assert {n.removeprefix("mtp.layers.0.") for n in mtp if n.startswith("mtp.layers.0.")} == layer


def test_multimodal_names_skip_visual_and_mtp(tiny_dir, reference, tmp_path):
    def mutate(t):
        out = {k.replace("model.", "model.language_model.", 1): v for k, v in t.items()}
        out["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
        out["mtp.layers.0.mlp.gate.weight"] = torch.zeros(2, 2)
        out["model.language_model.layers.1.ple.ple_embedding.hashstats_counts"] = torch.zeros(4)
        out["model.language_model.hyper_connection_mixer.block_inject_weight.weight"] = torch.zeros(4, 256)
        return out

    assert_same(load(copy_checkpoint(tiny_dir, str(tmp_path / "mm"), mutate)), reference)


def test_stacked_experts_and_any_shard_count(tiny_dir, reference, tmp_path):
    def mutate(t):
        out = {}
        for name, v in t.items():
            if ".experts." in name or "shard_" in name:
                continue
            out[name] = v
        for layer in range(4):
            p = f"model.layers.{layer}.mlp.experts"
            out[f"{p}.gate_up_proj"] = reference[f"{p}.gate_up_proj"]
            out[f"{p}.down_proj"] = reference[f"{p}.down_proj"]
        for layer in (1, 2):
            table = reference[f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"]
            for i, part in enumerate(torch.tensor_split(table, 7)):  # unequal shards, a different count
                out[f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{i}.weight"] = part.clone()
        return out

    assert_same(load(copy_checkpoint(tiny_dir, str(tmp_path / "stk"), mutate)), reference)


def test_sharded_index_and_in_memory_iterator(tiny_dir, reference, tmp_path):
    d = make_random(str(tmp_path / "sharded"), "tiny", dtype="float32", seed=3, max_shard_bytes=200_000)
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    assert len(checkpoint_files(d)) > 3
    assert_same(load(d), reference)
    # the same weights handed over in memory, shards in reverse order
    items = sorted(tensors(tiny_dir).items(), reverse=True)
    model = load_model(load_model_config(tiny_dir), None, torch.float32, "cpu", weights=iter(items))
    assert_same(model.state_dict(), reference)


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda t: {k: v for k, v in t.items() if k != "model.layers.0.linear_attn.A_log"},
         ["missing tensors", "model.layers.0.linear_attn.A_log"]),
        (lambda t: {**t, "model.layers.0.linear_attn.extra.weight": torch.zeros(2)},
         ["unexpected tensors", "model.layers.0.linear_attn.extra.weight"]),
        (lambda t: {**t, "model.layers.3.self_attn.k_proj.weight": torch.zeros(5, 64)},
         ["mis-shaped", "model.layers.3.self_attn.k_proj.weight", "(5, 64)", "(32, 64)"]),
        (lambda t: {**t, "model.layers.0.linear_attn.in_proj_b.weight": torch.zeros(3, 64)},
         ["mis-shaped", "model.layers.0.linear_attn.in_proj_b.weight", "(3, 64)", "(4, 64)"]),
        (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.shared_expert_gate.weight"},
         ["missing tensors (1): model.layers.1.mlp.shared_expert_gate.weight"]),
        (lambda t: {k: v for k, v in t.items() if k != "model.layers.2.mlp.experts.5.down_proj.weight"},
         ["model.layers.2.mlp.experts.down_proj", "experts [5]"]),
        (lambda t: {k: v for k, v in t.items()
                    if k != "model.layers.1.ple.ple_embedding.ngram_embedding.shard_2.weight"},
         ["ngram_embedding", "not contiguous"]),
        (lambda t: {**t, "model.layers.1.ple.ple_embedding.layer_multipliers":
                    t["model.layers.1.ple.ple_embedding.layer_multipliers"] + 2},
         ["layer_multipliers", "differ from the values computed"]),
    ],
    ids=["missing", "unexpected", "misshaped", "misshaped-part", "missing-part", "missing-expert", "missing-shard",
         "hash-buffer"],
)
def test_load_errors_name_tensors(tiny_dir, tmp_path, mutate, expected):
    d = copy_checkpoint(tiny_dir, str(tmp_path / "bad"), mutate)
    with pytest.raises(WeightLoadError) as e:
        load(d)
    for text in expected:
        assert text in str(e.value)


def test_multimodal_name_of_a_misshaped_part_is_reported(tiny_dir, tmp_path):
    def mutate(t):
        out = {k.replace("model.", "model.language_model.", 1): v for k, v in t.items()}
        out["model.language_model.layers.2.mlp.gate.weight"] = torch.zeros(8, 63)
        return out

    with pytest.raises(WeightLoadError) as e:
        load(copy_checkpoint(tiny_dir, str(tmp_path / "mm"), mutate))
    assert "model.language_model.layers.2.mlp.gate.weight: checkpoint (8, 63), model (8, 64)" in str(e.value)


def _logits(model, cfg) -> torch.Tensor:
    """One 20-token prefill from empty caches."""
    cache = allocate_cache(cfg, num_pages=4, page_size=16, num_slots=2, dtype=torch.float32, device="cpu")
    meta = StepBuilder(cfg, 16).build([RequestChunk(list(range(2, 22)), 0, [], [1, 2], 1, 0)]).to_metadata("cpu")
    with torch.inference_mode():
        return model.compute_logits(model(meta, cache)[meta.logits_indices])


def test_merged_projections_are_one_gemm_on_the_modules_weight(tiny_dir, monkeypatch):
    """A model built from its modules (no loader) and one loaded from its checkpoint tensors compute the same logits,
    and in both each merged projection's GEMM (the hyper-connection's inside hc_mix) reads the module's own padded
    weight, not a copy, at every step."""
    cfg = load_model_config(tiny_dir)
    built = Qwen4ExpForCausalLM(cfg).eval()
    dummy_weights_(built, seed=1)
    loaded = load_model(cfg, None, torch.float32, "cpu",
                        weights=[(t.name, t.tensor) for t in named_checkpoint_tensors(built)])
    gemm_weights = []
    real_linear, real_mix = linear_ops.linear, hc_ops.hc_mix
    monkeypatch.setattr(linear_ops, "linear",
                        lambda x, w, b=None, scale=None: gemm_weights.append(w) or real_linear(x, w, b, scale))
    monkeypatch.setattr(hc_ops, "hc_mix", lambda s, nw, w, *a: gemm_weights.append(w) or real_mix(s, nw, w, *a))
    logits = []
    for model in (built, loaded):
        merged = {(m.weight.data_ptr(), m.weight.shape) for m in model.modules() if isinstance(m, MergedLinear)}
        assert len(merged) == 4 * 4 + 2  # 4 layers: GDN or attention, MoE, 2 mixes; 2 PLE layers
        steps = []
        for _ in range(2):
            gemm_weights.clear()
            logits.append(_logits(model, cfg))
            steps.append([(w.data_ptr(), w.shape) for w in gemm_weights])
        assert steps[0] == steps[1]
        assert merged <= set(steps[0])
    for m in loaded.modules():
        if isinstance(m, MergedLinear):
            assert m.weight.shape[0] % 8 == 0 and not any(m.weight[rows].any() for rows in m.stacks[0].unused)
    torch.testing.assert_close(logits[2], logits[0], rtol=0, atol=0)


def test_dummy_load_format_needs_no_files(tiny_dir):
    cfg = load_model_config(tiny_dir)
    m = load_model(cfg, None, torch.float32, "cpu", load_format="dummy")
    # every checkpoint tensor, each part of a merged projection on its own
    assert all(torch.isfinite(t.tensor).all() and t.tensor.abs().sum() > 0 for t in named_checkpoint_tensors(m))
    assert all(not mod.weight[rows].any() for mod in m.modules() if isinstance(mod, MergedLinear)
               for rows in mod.stacks[0].unused)


@pytest.mark.slow
def test_loading_streams_one_tensor_at_a_time(tmp_path):
    """Peak memory while loading stays near one copy of the model (not two)."""
    d = make_random(str(tmp_path / "small"), "small", dtype="float32", seed=0)
    peak, sizes, _ = load_peak_rss(d)
    size, largest = sum(sizes.values()), max(sizes.values())
    assert peak <= size + 2 * largest + (64 << 20), (peak, size, largest)
