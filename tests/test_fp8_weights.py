"""Block-scaled fp8 weights (the released FP8 checkpoint's format): config, the model's fp8 parameters, loading
(fp8 checkpoints, quantization on load, dequantization of what the model keeps unquantized, named errors),
make-random's FP8 layout, dummy fp8 weights, and the fp8 model's outputs."""

import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_config, hf_model, our_llm, random_prompt
from safetensors.torch import save_file

from qwen4exp import LLM, SamplingParams
from qwen4exp.bench.offline import teacher_forced
from qwen4exp.config import ConfigError, EngineConfig, load_model_config
from qwen4exp.entrypoints.cli import main
from qwen4exp.model import Qwen4ExpForCausalLM
from qwen4exp.model.merged_linear import (
    Linear,
    MergedLinear,
    named_checkpoint_tensors,
    quantizable_weights,
    round_up,
    use_fp8_,
)
from qwen4exp.model.moe import Experts
from qwen4exp.ops import fp8
from qwen4exp.weights.loader import WeightLoadError, build_model, load_model, load_weights, table_names
from qwen4exp.weights.random_checkpoint import make_random, preset_config
from qwen4exp.weights.safetensors_io import checkpoint_files, iterate_files, read_infos

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("bf16")), "tiny", dtype="bfloat16", seed=3)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("fp8")), "tiny", dtype="bfloat16", seed=3, quantization="fp8")


def tensors(model_dir) -> dict:
    return dict(iterate_files(checkpoint_files(model_dir)))


def load(d, **kw):
    return load_model(load_model_config(d), d, torch.float32, "cpu", **kw)


def copy_checkpoint(src, dst, mutate, config=None) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(src, f)) as a, open(os.path.join(dst, f), "w") as b:
            b.write(a.read())
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config(cfg), f)
    save_file(mutate(tensors(src)), os.path.join(dst, "model.safetensors"))
    return dst


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def assert_identical(a: dict, b: dict) -> None:
    """Same names, dtypes and bytes (fp8 tensors compared as their bytes)."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(as_bytes(a[k]), as_bytes(b[k])), k


def fp8_parameters(model) -> set[str]:
    return {t.name for t in named_checkpoint_tensors(model) if t.tensor.dtype == FP8}


# ----- config -----

def test_quantization_config_is_read_from_the_checkpoint(fp8_dir, tmp_path):
    cfg = load_model_config(fp8_dir)
    q = cfg.quantization_config
    assert (q.quant_method, q.fmt, q.activation_scheme, q.weight_block_size) == ("fp8", "e4m3", "dynamic", (128, 128))
    assert "lm_head" in q.modules_to_not_convert and "model.layers.0.mlp.gate" in q.modules_to_not_convert
    assert not q.converts("model.layers.0.mlp.gate") and q.converts("model.layers.0.mlp.shared_expert.gate_proj")
    # the multimodal wrapper's top-level quantization_config
    with open(os.path.join(fp8_dir, "config.json")) as f:
        flat = json.load(f)
    text = {k: v for k, v in flat.items() if k not in ("architectures", "quantization_config")}
    wrapper = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"], "text_config": text,
               "quantization_config": flat["quantization_config"],
               "vision_config": {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                                 "out_hidden_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    assert load_model_config(str(tmp_path)).quantization_config == q


@pytest.mark.parametrize("key, value", [("quant_method", "awq"), ("fmt", "e5m2"), ("weight_block_size", [64, 64]),
                                        ("weight_block_size", None), ("activation_scheme", "static")])
def test_unsupported_quantization_config_names_the_field(tmp_path, key, value):
    cfg = preset_config("tiny", eos_token_id=5)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], key: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"quantization_config.{key}"):
        load_model_config(str(tmp_path))


def test_quantization_option():
    assert EngineConfig().quantization is None and EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="int8")


# ----- modules -----

def test_merged_parts_of_two_kinds_are_two_gemms_with_every_output_in_order():
    """Runs of consecutive parts of one kind are one GEMM each: fp8 parts padded to 128 rows each, with one scale
    row per 128-row block of their own; every part's output equals its own projection."""
    g = torch.Generator().manual_seed(0)
    parts = {"a": 5, "b": 200, "c": 7, "d": 3}
    merged = MergedLinear(160, parts, bias_parts=("b", "d"), quantizable=("b", "c", "d"))
    use_fp8_(merged, {"b.weight", "c.weight"})
    assert [s.fp8 for s in merged.stacks] == [False, True, False]
    assert merged.stacks[1].weight.shape == (256 + 128, 160) and merged.stacks[1].weight_scale_inv.shape == (3, 2)
    assert merged.stacks[0].weight.shape == (8, 160) and merged.stacks[2].weight.shape == (8, 160)
    for s in merged.stacks:
        s.weight.data.fill_(1.0)  # as if uninitialised: zero_unused_ must clear what no part fills
    merged.zero_unused_()
    weights = {n: torch.randn(rows, 160, generator=g) / 13 for n, rows in parts.items()}
    biases = {n: torch.randn(parts[n], generator=g) for n in ("b", "d")}
    for n in parts:
        assert merged.load_part_(f"{n}.weight", weights[n], f"x.{n}.weight") == (n in ("b", "c"))
        if n in biases:
            merged.load_part_(f"{n}.bias", biases[n], f"x.{n}.bias")
    fp8_rows = merged.stacks[1].weight.float()
    assert not fp8_rows[200:256].any() and not fp8_rows[256 + 7:].any()
    x = torch.randn(4, 160, generator=g)
    with torch.no_grad():
        outs = merged(x)
    assert [y.shape[1] for y in outs] == list(parts.values())
    for (n, y) in zip(parts, outs):
        if n in ("b", "c"):
            wq, scale = fp8.quantize_weight(weights[n])
            want = fp8.linear_ref(x, wq, scale, biases.get(n))
        else:
            want = F.linear(x, weights[n], biases.get(n))
        torch.testing.assert_close(y, want)


def meta_model(preset, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset_config(preset)))
    with torch.device("meta"):
        return Qwen4ExpForCausalLM(load_model_config(str(tmp_path)))


def test_bf16_model_parameters_are_unchanged_by_fp8_support(tmp_path):
    """The model in the model dtype keeps its GPU layout: one GEMM per merged projection (rows padded to 8), the
    projections and experts as transformers shapes them, no fp8 parameter and no scale."""
    model = meta_model("flash-next", tmp_path)
    c = model.config
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and not name.endswith("_scale_inv"), name
    merged = [m for m in model.modules() if isinstance(m, MergedLinear)]
    assert merged and all(len(m.stacks) == 1 and m.weight.shape == (round_up(sum(m.parts.values()), 8), m.in_features)
                          for m in merged)
    layer = model.model.layers[0]
    assert layer.linear_attn.in_proj.weight.shape == (c.gdn_conv_dim + c.gdn_value_dim + 2 * 48, 2560)
    assert layer.linear_attn.out_proj.weight.shape == (2560, c.gdn_value_dim)
    assert layer.mlp.in_proj.weight.shape == (520 + 1280, 2560)  # 512 + 1 router rows and 1280 shared rows
    assert layer.mlp.experts.gate_up_proj.shape == (512, 1280, 2560)
    assert layer.mlp.experts.down_proj.shape == (512, 2560, 640)
    assert model.model.layers[3].self_attn.o_proj.weight.shape == (2560, 24 * 256)


def test_quantizable_set_is_vllms(tmp_path):
    """With --quantization fp8: the GDN, attention and PLE projections and the routed and shared experts; the
    hyper-connection projections, router, shared-expert gate, norms, convs, embedding and lm_head stay."""
    model = meta_model("tiny", tmp_path)
    names = set(quantizable_weights(model))
    layer0, layer3 = "model.layers.0.", "model.layers.3."
    for leaf in ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                 "linear_attn.in_proj_a.weight", "linear_attn.out_proj.weight", "mlp.shared_expert.gate_proj.weight",
                 "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight", "mlp.experts.gate_up_proj",
                 "mlp.experts.down_proj"):
        assert layer0 + leaf in names
    for leaf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.indexer.index_qk_proj.weight", "self_attn.o_proj.weight"):
        assert layer3 + leaf in names
    assert "model.layers.1.ple.key_proj.weight" in names and "model.layers.1.ple.value_proj.weight" in names
    everything = {t.name for t in named_checkpoint_tensors(model)}
    kept = everything - names
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                 "model.layers.0.attn_hyper_connection.input_mix_weight_down.weight",
                 "model.layers.0.attn_hyper_connection.block_inject_weight.weight",
                 "model.layers.0.attn_hyper_connection.input_mix_weight_up.weight",
                 "model.hyper_connection_mixer.input_mix_weight_down.weight", "lm_head.weight",
                 "model.embed_tokens.weight", "model.layers.0.linear_attn.conv1d.weight",
                 "model.layers.0.linear_attn.norm.weight", "model.layers.1.ple.ple_embedding.ngram_embedding.weight"):
        assert name in kept
    assert len(names) == 4 * 5 + 3 * 5 + 1 * 5 + 2 * 2  # MoE 5 per layer; 3 GDN and 1 attention layer, 5 each; PLE 2


# ----- make-random and loading -----

def test_make_random_writes_the_released_fp8_layout(fp8_dir):
    infos = read_infos(checkpoint_files(fp8_dir))
    expect = {
        "model.layers.0.linear_attn.in_proj_z.weight": ((64, 64), FP8),
        "model.layers.0.linear_attn.in_proj_z.weight_scale_inv": ((1, 1), torch.float32),
        "model.layers.0.mlp.experts.5.up_proj.weight": ((32, 64), FP8),
        "model.layers.0.mlp.experts.5.up_proj.weight_scale_inv": ((1, 1), torch.float32),
        "model.layers.0.mlp.experts.5.down_proj.weight": ((64, 32), FP8),
        "model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv": ((1, 1), torch.float32),
        "model.layers.3.self_attn.o_proj.weight": ((64, 64), FP8),
        "model.layers.0.mlp.gate.weight": ((8, 64), torch.bfloat16),
        "model.layers.0.attn_hyper_connection.input_mix_weight_down.weight": ((16, 256), torch.bfloat16),
        "lm_head.weight": ((512, 64), torch.bfloat16),
        "model.layers.1.ple.ple_embedding.ngram_embedding.shard_0.weight": ((1024, 8), FP8),
        "model.layers.1.ple.ple_embedding.ngram_embedding.weight_scale": ((), torch.float32),
    }
    for name, info in expect.items():
        assert infos[name] == info, name
    assert not any(n.endswith("mlp.gate.weight_scale_inv") for n in infos)
    with open(os.path.join(fp8_dir, "config.json")) as f:
        skip = json.load(f)["quantization_config"]["modules_to_not_convert"]
    assert {"lm_head", "model.layers.2.mlp.shared_expert_gate", "model.hyper_connection_mixer.input_mix_weight_down",
            "model.layers.2.mlp_hyper_connection.input_mix_weight_up"} <= set(skip)
    assert not any("experts" in m or "linear_attn" in m or "self_attn" in m for m in skip)


def test_fp8_checkpoint_equals_the_bf16_one_quantized_on_load(bf16_dir, fp8_dir):
    """make-random's fp8 checkpoint loads into the same bytes and scales as its bf16 twin (same seed) quantized on
    load; both scale layouts arrive: block scales of linears and of each expert, and the table's one scale."""
    fp8_model = load(fp8_dir)
    quantized = load(bf16_dir, quantization="fp8", ple_table_dtype="fp8")
    assert fp8_parameters(fp8_model) == set(quantizable_weights(fp8_model)) | set(table_names(fp8_model))
    assert_identical(fp8_model.state_dict(), quantized.state_dict())
    assert_identical(fp8_model.state_dict(), load(fp8_dir, quantization="fp8").state_dict())
    buffers = dict(fp8_model.named_buffers())
    for table in table_names(fp8_model):
        assert dict(fp8_model.named_parameters())[table].dtype == FP8 and buffers[table + "_scale"].item() != 1.0
    experts = fp8_model.model.layers[1].mlp.experts
    ckpt = tensors(fp8_dir)
    weight, scale = experts.expert_tensors(6, "up_proj")
    assert torch.equal(weight.view(torch.uint8), ckpt["model.layers.1.mlp.experts.6.up_proj.weight"].view(torch.uint8))
    assert torch.equal(scale, ckpt["model.layers.1.mlp.experts.6.up_proj.weight_scale_inv"])
    # the model's own tensors handed over in memory (stacked fp8 experts with their scales) load identically too
    again = load_model(fp8_model.config, None, torch.float32, "cpu", ple_table_dtype="fp8",
                       weights=[(t.name, t.tensor) for t in named_checkpoint_tensors(fp8_model)]
                       + [(n, b) for n, b in fp8_model.named_buffers() if n.endswith("weight_scale")])
    assert_identical(again.state_dict(), fp8_model.state_dict())


def test_stacked_bf16_experts_are_quantized_expert_by_expert(bf16_dir):
    """transformers' stacked experts [E, 2I, H] in memory, quantized on load, equal the per-expert tensors quantized
    on load (gate and up rows each padded to 128)."""
    ref = load(bf16_dir, quantization="fp8")
    bf16 = load(bf16_dir)
    stacked = load_model(bf16.config, None, torch.float32, "cpu", quantization="fp8",
                         weights=[(t.name, t.tensor) for t in named_checkpoint_tensors(bf16)])
    assert stacked.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 256, 64)
    assert_identical(stacked.state_dict(), ref.state_dict())


def test_mixed_checkpoint_loads_its_own_split(bf16_dir, fp8_dir, tmp_path, caplog):
    """Which weights are fp8 is read from the checkpoint: one that keeps in_proj_b/a in bf16 gets a GDN in_proj of
    two GEMMs; a hyper-connection projection and a router quantized by the checkpoint, which the model keeps in its
    dtype, are dequantized on load, with one log line."""
    bf16 = tensors(bf16_dir)
    kept = ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")
    extra = ("model.layers.1.mlp.gate.weight", "model.layers.2.attn_hyper_connection.input_mix_weight_up.weight")

    def mutate(t):
        out = dict(t)
        for name in list(out):
            if name.endswith(kept):
                out[name] = bf16[name]
                del out[name + "_scale_inv"]
        for name in extra:
            out[name], out[name + "_scale_inv"] = fp8.quantize_weight(bf16[name])
        return out

    d = copy_checkpoint(fp8_dir, str(tmp_path / "mixed"), mutate)
    with caplog.at_level(logging.INFO, logger="qwen4exp"):
        model = load(d)
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and all(name in lines[0] for name in extra)
    in_proj = model.model.layers[0].linear_attn.in_proj
    assert [s.fp8 for s in in_proj.stacks] == [True, False]
    assert in_proj.stacks[1].weight.shape == (8, 64)
    for name in extra:
        wq, scale = fp8.quantize_weight(bf16[name])
        entry = next(t for t in named_checkpoint_tensors(model) if t.name == name)
        assert entry.tensor.dtype == torch.float32
        assert torch.equal(entry.tensor, fp8.dequantize_weight(wq, scale, torch.float32))
    ref = load(fp8_dir)
    assert fp8_parameters(model) == fp8_parameters(ref) - {f"model.layers.{i}.{k}" for i in range(3) for k in kept}


def corrupt(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (corrupt("model.layers.0.linear_attn.in_proj_z.weight_scale_inv"),
         ["model.layers.0.linear_attn.in_proj_z.weight: a float8 weight without its "
          "model.layers.0.linear_attn.in_proj_z.weight_scale_inv"]),
        (corrupt("model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"),
         ["model.layers.2.mlp.experts.5.down_proj.weight: a float8 weight without its "
          "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"]),
        (lambda t: {**t, "model.layers.3.self_attn.o_proj.weight_scale_inv": torch.ones(2, 1)},
         ["model.layers.3.self_attn.o_proj.weight_scale_inv: checkpoint (2, 1), expected (1, 1) = "
          "[ceil(N/128), ceil(K/128)] for the 64 x 64 weight"]),
        (lambda t: {**t, "model.layers.0.mlp.experts.2.gate_proj.weight_scale_inv": torch.ones(1, 3)},
         ["model.layers.0.mlp.experts.2.gate_proj.weight_scale_inv: checkpoint (1, 3), expected (1, 1)"]),
        (corrupt("model.layers.3.self_attn.o_proj.weight"),
         ["a scale without its weight model.layers.3.self_attn.o_proj.weight",
          "missing tensors (1): model.layers.3.self_attn.o_proj.weight"]),
        (lambda t: {**t, "model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 1)},
         ["model.layers.0.mlp.gate.weight_scale_inv: a scale beside model.layers.0.mlp.gate.weight, which is "
          "bfloat16, not float8"]),
    ],
    ids=["weight-without-scale", "expert-weight-without-scale", "scale-shape", "expert-scale-shape",
         "scale-without-weight", "scale-of-a-bf16-weight"],
)
def test_fp8_load_errors_name_tensors(fp8_dir, tmp_path, mutate, expected):
    d = copy_checkpoint(fp8_dir, str(tmp_path / "bad"), mutate)
    with pytest.raises(WeightLoadError) as e:
        load(d)
    for text in expected:
        assert text in str(e.value)


def test_missing_scale_of_an_fp8_parameter_is_named(fp8_dir):
    """A model built with an fp8 weight, given neither it nor its scale, names both (load_weights directly)."""
    config = load_model_config(fp8_dir)
    with torch.device("meta"):
        meta = Qwen4ExpForCausalLM(config)
    model = build_model(config, torch.float32, "cpu", fp8=quantizable_weights(meta))
    gone = "model.layers.0.linear_attn.out_proj.weight"
    with pytest.raises(WeightLoadError) as e:
        load_weights(model, ((n, t) for n, t in iterate_files(checkpoint_files(fp8_dir))
                             if not n.startswith(gone)))
    assert f"missing tensors (1): {gone}" in str(e.value)
    assert f"missing scales (1): {gone}_scale_inv" in str(e.value)


def test_make_random_cli_quantization_flag(tmp_path, capsys):
    assert main(["make-random", str(tmp_path), "--preset", "tiny", "--quantization", "fp8"]) == 0
    assert "fp8" in capsys.readouterr().out
    assert load_model_config(str(tmp_path)).quantization_config is not None
    with pytest.raises(SystemExit):
        main(["make-random", str(tmp_path), "--quantization", "int4"])


def test_make_random_config_only_runs_as_its_checkpoint_with_dummy_weights(fp8_dir, tmp_path, capsys):
    """make-random --config-only: the config (the fp8 modules_to_not_convert included), generation config and
    tokenizer without weight files; with load_format="dummy" it generates what the full checkpoint does."""
    d = str(tmp_path / "config-only")
    assert main(["make-random", d, "--preset", "tiny", "--dtype", "bfloat16", "--seed", "3", "--quantization", "fp8",
                 "--config-only"]) == 0
    assert "without weights" in capsys.readouterr().out
    assert not [f for f in os.listdir(d) if "safetensors" in f]
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        with open(os.path.join(d, name)) as a, open(os.path.join(fp8_dir, name)) as b:
            assert json.load(a) == json.load(b), name
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = [LLM(m, dtype="float32", load_format="dummy", max_model_len=64).generate(
        [{"prompt_token_ids": [5, 9, 33, 7]}], params)[0].outputs[0].token_ids for m in (d, fp8_dir)]
    assert outs[0] == outs[1] and len(outs[0]) == 6


# ----- dummy weights -----

@pytest.mark.parametrize("source", ["quantization", "quantization_config"])
def test_dummy_fp8_weights_fill_every_tensor_with_scaled_values(bf16_dir, fp8_dir, source):
    d = fp8_dir if source == "quantization_config" else bf16_dir
    kw = {"quantization": "fp8"} if source == "quantization" else {}
    model = load(d, load_format="dummy", **kw)
    assert fp8_parameters(model) == set(quantizable_weights(model))
    for t in named_checkpoint_tensors(model):
        values = t.tensor.float()
        assert torch.isfinite(values).all() and values.abs().sum() > 0, t.name
    for m in model.modules():  # the padding rows stay zero
        if isinstance(m, Experts):
            assert not m.gate_up_proj.float()[:, 32:128].any() and not m.gate_up_proj.float()[:, 160:].any()
    # drawn as the bf16 dummy draws them: std 1/sqrt(in) for a linear layer
    entries = {t.name: t.tensor for t in named_checkpoint_tensors(model)}
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    real = fp8.dequantize_weight(entries[name], entries[name + "_scale_inv"])
    assert abs(real.std().item() * 64**0.5 - 1) < 0.1


def test_dummy_fp8_fills_in_chunks_of_whole_blocks():
    """Each chunk is whole 128-row blocks, so the chunked fill equals quantizing the same draws at once."""
    from qwen4exp.weights.init import fill_, fill_fp8_

    weight, scale = torch.empty(300, 200, dtype=FP8), torch.empty(3, 2)
    fill_fp8_("x.in_proj_z.weight", weight, scale, torch.Generator().manual_seed(0), chunk_elements=128 * 200)
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([fill_("x.in_proj_z.weight", torch.empty(rows, 200), g) for rows in (128, 128, 44)])
    wq, want = fp8.quantize_weight(draws)
    assert torch.equal(weight.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(scale, want)
    experts, experts_scale = torch.empty(5, 40, 200, dtype=FP8), torch.empty(5, 1, 2)
    fill_fp8_("x.experts.down_proj", experts, experts_scale, torch.Generator().manual_seed(0),
              chunk_elements=2 * 40 * 200)
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([fill_("x.experts.down_proj", torch.empty(n, 40, 200), g) for n in (2, 2, 1)])
    wq, want = fp8.quantize_weight(draws)
    assert torch.equal(experts.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(experts_scale, want)


# ----- the fp8 model's outputs -----

@pytest.fixture(scope="module")
def hf():
    return hf_model(hf_config(ple_layer_ids=[1, 2], ngram_vocab_size_base=400), seed=8)


def test_fp8_greedy_tokens_equal_its_own_one_pass_reference(hf):
    """Chunked prefill and cached decode of the fp8 model give the tokens that one pass over the whole sequence
    picks at every position (its own reference run), and the same logprobs."""
    gen = torch.Generator().manual_seed(5)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=7) for n in (9, 30)]
    llm = our_llm(hf, quantization="fp8", max_num_batched_tokens=16)
    assert fp8_parameters(llm.llm_engine.model) == set(quantizable_weights(llm.llm_engine.model))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    one_pass = our_llm(hf, quantization="fp8")
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        full = prompt + tokens
        ref = one_pass.generate([{"prompt_token_ids": full}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                                use_tqdm=False)[0]
        for i, tok in enumerate(tokens):
            entry = ref.prompt_logprobs[len(prompt) + i]
            assert min(entry, key=lambda k: entry[k].rank) == tok
            assert abs(entry[tok].logprob - next(iter(out.outputs[0].logprobs[i].values())).logprob) < 1e-4


def test_fp8_logprobs_stay_within_the_documented_bound_of_the_unquantized_model(hf):
    """W8A8 block fp8 against the same fp32 weights, teacher-forced over 377 positions of the random-weight test
    model (hidden 32: one 128 x 128 block, so one scale, per matrix). Measured: mean |dlogprob| 0.17, max 1.9, top-1
    agreement 0.81 (bf16 activations and weights instead: mean 0.027, top-1 0.98). Bound: mean <= 0.25, top-1
    agreement >= 0.75."""
    gen = torch.Generator().manual_seed(2)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=6) for n in (60, 120, 200)]
    ref = teacher_forced(our_llm(hf), prompts)
    got = teacher_forced(our_llm(hf, quantization="fp8"), prompts)
    drift = (got[0] - ref[0]).abs()
    agree = (got[1] == ref[1]).float().mean().item()
    print(f"\nfp8 weights vs fp32 over {drift.numel()} positions: mean |dlogprob| {drift.mean():.4f}, max "
          f"{drift.max():.4f}, top-1 agreement {agree:.3f}")
    assert 0 < drift.mean() <= 0.25
    assert agree >= 0.75


def test_llm_quantization_option_reaches_the_model(bf16_dir):
    llm = LLM(bf16_dir, device="cpu", dtype="float32", max_model_len=64, num_pages=16, quantization="fp8")
    assert fp8_parameters(llm.llm_engine.model) == set(quantizable_weights(llm.llm_engine.model))
    assert isinstance(llm.llm_engine.model.model.layers[0].linear_attn.out_proj, Linear)


# ----- on a GPU (skipped without CUDA) -----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_gpu_fp8_model_matches_the_cpu_fp8_reference():
    """The fp8 model's GPU fast paths and CUDA graphs (fp32 activations) against the CPU reference of the same fp8
    weights: each generated token is the reference's argmax, logprobs close. Every product quantizes its input per
    token and 128 columns, so a summation-order difference upstream (and Hopper's fp8 wgmma at 33+ tokens, ops/fp8.py)
    moves some values to the next e4m3 step: on an H100 this model's logprobs are 0.02 apart at the median, 0.18 at
    most (the unquantized model: 0 and 0.09, at a near tie). A wrong scale, a missed weight or a stale graph buffer
    moves them by far more."""
    hf = hf_model(hf_config(ple_layer_ids=[1, 2], hidden_size=256, moe_intermediate_size=160), seed=7)
    llm = our_llm(hf, device="cuda", quantization="fp8", max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.llm_engine.runner.graphs is not None
    assert fp8_parameters(llm.llm_engine.model) == set(quantizable_weights(llm.llm_engine.model))
    gen = torch.Generator().manual_seed(9)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=13) for n in (5, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    cpu = our_llm(hf, device="cpu", quantization="fp8", max_num_seqs=4)
    diffs = []
    for prompt, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        full = cpu.generate([{"prompt_token_ids": prompt + ids[:-1]}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)[0]
        ref = full.prompt_logprobs[len(prompt):]
        assert [d[t].rank for d, t in zip(ref, ids[:-1])] == [1] * (len(ids) - 1)
        ours = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs[:-1], ids[:-1])])
        diffs.append((ours - torch.tensor([d[t].logprob for d, t in zip(ref, ids[:-1])])).abs())
    diffs = torch.cat(diffs)
    assert diffs.median() < 0.05 and diffs.max() < 0.4, diffs


@needs_cuda
def test_gpu_dummy_fp8_weights_are_built_on_the_device(fp8_dir):
    llm = LLM(fp8_dir, device="cuda", load_format="dummy", max_model_len=128, num_pages=16, enforce_eager=True)
    model = llm.llm_engine.model
    assert fp8_parameters(model) == set(quantizable_weights(model))
    assert all(p.is_cuda for n, p in model.named_parameters() if n not in table_names(model))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.slow
def test_quantizing_on_load_streams_one_tensor_at_a_time(tmp_path):
    """Quantizing an fp32 checkpoint on load: peak memory stays near the fp8 model (plus one checkpoint tensor and
    its quantization temporaries), never a wide copy of the model."""
    from helpers import load_peak_rss

    d = make_random(str(tmp_path / "small"), "small", dtype="float32", seed=0)
    checkpoint = [torch.Size(shape).numel() * 4 for shape, _ in read_infos(checkpoint_files(d)).values()]
    largest, wide = max(checkpoint), sum(checkpoint)
    peak, sizes, _ = load_peak_rss(d, quantization="fp8")
    size = sum(sizes.values())
    print(f"\npeak RSS {peak / 2**20:.1f} MiB: fp8 model {size / 2**20:.1f} MiB, fp32 checkpoint "
          f"{wide / 2**20:.1f} MiB")
    assert peak <= size + 3 * largest + (64 << 20), (peak, size, largest)
