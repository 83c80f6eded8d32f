"""Config reading through transformers, and errors that name the offending field."""

import dataclasses
import json

import pytest

from qwen4exp.config import ConfigError, EngineConfig, load_model_config
from qwen4exp.weights.random_checkpoint import preset_config


def write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def tiny(**over):
    cfg = preset_config("tiny", eos_token_id=5, dtype="float32")
    cfg.update(over)
    return cfg


def test_flat_and_multimodal_wrapper_give_the_same_config(tmp_path):
    (tmp_path / "a").mkdir()
    flat = load_model_config(write(tmp_path / "a", tiny()))
    text = tiny()
    text.pop("architectures")
    wrapper = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"], "text_config": text,
               "vision_config": {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                                 "out_hidden_size": 64}}
    (tmp_path / "b").mkdir()
    wrapped = load_model_config(write(tmp_path / "b", wrapper))
    assert flat == dataclasses.replace(wrapped, vision=None)
    vision = wrapped.vision  # the wrapper's vision tower, transformers' defaults for what it leaves out
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.out_hidden_size) == (1, 16, 2, 64)
    assert (vision.patch_size, vision.spatial_merge_size, vision.image_token_id) == (16, 2, 248056)
    assert flat.layer_types == ("linear_attention",) * 3 + ("indexed_attention",)
    assert flat.ple_layer_ids == (2, 3) and flat.qsa and flat.rotary_dim == 8


def test_full_attention_layer_type_is_read_as_indexed(tmp_path):
    for name in ("full_attention", "qwen_sparse_attention", "indexed_attention"):
        cfg = tiny(layer_types=["linear_attention"] * 3 + [name])
        assert load_model_config(write(tmp_path, cfg)).layer_types[3] == "indexed_attention"
    cfg = tiny(full_attention_interval=2, ple_layer_ids=[1, 3])
    cfg.pop("layer_types")
    assert load_model_config(write(tmp_path, cfg)).layer_types == ("linear_attention", "indexed_attention") * 2


def test_output_gate_falls_back_to_hidden_act_and_eos_list_uses_first(tmp_path):
    c = load_model_config(write(tmp_path, tiny(output_gate_type=None, eos_token_id=[7, 5])))
    assert c.output_gate_type == "silu"
    assert c.eos_token_id == 7
    assert c.stop_token_ids == (7, 5)


def test_generation_config_sets_stop_tokens(tmp_path):
    d = write(tmp_path, tiny())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 5]}))
    assert load_model_config(d).stop_token_ids == (9, 5)


@pytest.mark.parametrize(
    "over, field",
    [
        (dict(hc_count=1), "hc_count"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(output_gate_type="tanh"), "output_gate_type"),
        (dict(indexer_kv_heads=2), "indexer_kv_heads"),
        (dict(indexer_budget=10), "indexer_budget"),
        (dict(indexer_head_dim=4), "indexer_head_dim"),
        (dict(indexer_compress_ratio=None), "indexer_compress_ratio"),
        (dict(ple_layer_ids=[4]), "ple_layer_ids"),
        (dict(ple_layer_ids=[9]), "ple_layer_ids"),
        (dict(ple_embed_dim=30), "ple_embed_dim"),
        (dict(eos_token_id=None), "eos_token_id"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(linear_num_value_heads=5), "linear_num_value_heads"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size"),
        (dict(hidden_size="big"), "hidden_size"),
        (dict(model_type="llama"), "model_type"),
        (dict(mtp_num_hidden_layers=-1, mtp={}), "mtp_num_hidden_layers"),
        (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers"),
        (dict(mtp=dict(num_hidden_layers=2)), "mtp.num_hidden_layers"),
        (dict(mtp=dict(layer_types=["full_attention"] * 2)), "mtp.layer_types"),
        (dict(mtp="yes"), "mtp"),
        (dict(mamba_ssm_dtype="float64"), "mamba_ssm_dtype"),
    ],
)
def test_invalid_config_names_the_field(tmp_path, over, field):
    with pytest.raises(ConfigError) as e:
        load_model_config(write(tmp_path, tiny(**over)))
    assert field in str(e.value)


def test_mtp_fields_read_as_released_and_under_vllms_name(tmp_path):
    released = load_model_config(write(tmp_path, tiny()))
    assert (released.mtp_num_hidden_layers, released.mtp_layer_types) == (1, ("indexed_attention",))
    assert not released.mtp_use_dedicated_embeddings and released.mtp_use_hidden_state_from_layer is None
    released.check_mtp()
    cfg = tiny(num_nextn_predict_layers=1)
    for key in ("mtp_num_hidden_layers", "mtp"):
        cfg.pop(key)
    assert load_model_config(write(tmp_path, cfg)) == released
    cfg.pop("num_nextn_predict_layers")
    assert load_model_config(write(tmp_path, cfg)).mtp_num_hidden_layers == 0


@pytest.mark.parametrize("over, field", [
    (dict(mtp_num_hidden_layers=0, mtp={}), "mtp_num_hidden_layers"),
    (dict(mtp=dict(layer_types=["linear_attention"])), "mtp.layer_types"),
    (dict(mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings"),
    (dict(mtp=dict(mtp_use_hidden_state_from_layer=10)), "mtp.mtp_use_hidden_state_from_layer"),
])
def test_mtp_that_cannot_draft_loads_and_names_the_field_when_asked(tmp_path, over, field):
    """A config whose MTP layers this engine cannot draft with still loads; asking for MTP names the field."""
    config = load_model_config(write(tmp_path, tiny(**over)))
    with pytest.raises(ConfigError) as e:
        config.check_mtp()
    assert e.value.field == field


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(str(tmp_path))


@pytest.mark.parametrize("over, field", [(dict(max_model_len=0), "max_model_len"),
                                         (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                                         (dict(max_num_seqs=-1), "max_num_seqs"),
                                         (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                                         (dict(dtype="int8"), "dtype"), (dict(device="gpu"), "device"),
                                         (dict(load_format="gguf"), "load_format"),
                                         (dict(cuda_graph_sizes=[4, 0]), "cuda_graph_sizes"),
                                         (dict(num_pages=0), "num_pages"), (dict(page_size=1.5), "page_size"),
                                         (dict(mamba_ssm_cache_dtype="fp8"), "mamba_ssm_cache_dtype")])
def test_engine_config_errors_name_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**over)


def test_recurrent_state_dtype_follows_the_checkpoint_unless_set(tmp_path):
    """mamba_ssm_cache_dtype auto: the checkpoint's mamba_ssm_dtype (float32 as released, and where it is absent,
    as transformers computes); a value given wins, in both directions."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    released = load_model_config(write(tmp_path / "a", tiny()))
    cfg = tiny()
    cfg.pop("mamba_ssm_dtype")
    absent = load_model_config(write(tmp_path / "b", cfg))
    bf16 = load_model_config(write(tmp_path, tiny(mamba_ssm_dtype="bfloat16")))
    assert EngineConfig().ssm_dtype(released) == EngineConfig().ssm_dtype(absent) == "float32"
    assert EngineConfig().ssm_dtype(bf16) == "bfloat16"
    assert EngineConfig(mamba_ssm_cache_dtype="float32").ssm_dtype(bf16) == "float32"
    assert EngineConfig(mamba_ssm_cache_dtype="bfloat16").ssm_dtype(released) == "bfloat16"


def test_cli_reports_bad_options_in_one_line(tmp_path, capsys):
    """A bad option value exits with status 2 and a one-line message naming the field, not a traceback."""
    from qwen4exp.entrypoints.cli import main
    from qwen4exp.weights.random_checkpoint import make_random

    make_random(str(tmp_path), "tiny")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tmp_path), "--load-format", "dummy", "--ple-table-device", "gpu",
              "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "ple_table_device" in err and "Traceback" not in err


@pytest.mark.parametrize("name, gib, capability, llm, server", [
    ("NVIDIA H200", 139.8, (9, 0), 16384, 8192),
    ("NVIDIA H100 80GB HBM3", 79.1, (9, 0), 16384, 8192),
    ("NVIDIA A100-SXM4-80GB", 79.1, (8, 0), 8192, 2048),
    ("NVIDIA B200", 178.4, (10, 0), 16384, 16384),
    ("NVIDIA GB10", 119.7, (12, 1), 8192, 2048),
    ("NVIDIA L4", 22.0, (8, 9), 8192, 2048),
])
def test_default_step_budget_per_gpu_is_vllms(monkeypatch, name, gib, capability, llm, server):
    """Without --max-num-batched-tokens a user gets vLLM 0.33's budget for their GPU: the offline LLM class's,
    and the smaller one of the OpenAI server."""
    from types import SimpleNamespace

    import torch

    from qwen4exp.config import default_max_num_batched_tokens

    props = SimpleNamespace(name=name, total_memory=int(gib * 2**30), major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert default_max_num_batched_tokens("cuda", server=False) == llm
    assert default_max_num_batched_tokens("cuda", server=True) == server


def test_default_step_budget_on_the_cpu(tmp_path):
    """LLM() resolves the budget at start-up (4096 on the CPU, as vLLM's LLM class) and its scheduler uses it;
    `qwen4exp serve` gets the server's 2048, and an explicit --max-num-batched-tokens wins (0 names the field)."""
    from qwen4exp import LLM, SamplingParams
    from qwen4exp.entrypoints.cli import build_parser
    from qwen4exp.entrypoints.server import engine_config_from_args
    from qwen4exp.weights.random_checkpoint import make_random

    make_random(str(tmp_path), "tiny")
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", max_model_len=8192)
    assert llm.llm_engine.config.max_num_batched_tokens == 4096
    steps, schedule = [], llm.llm_engine.scheduler.schedule
    llm.llm_engine.scheduler.schedule = lambda *a: steps.append(schedule(*a)) or steps[-1]
    out = llm.generate([{"prompt_token_ids": [5] * 4100}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    assert [s.num_tokens for s in steps if s.num_tokens] == [4096, 4]

    parser = build_parser()
    args = parser.parse_args(["serve", str(tmp_path), "--device", "cpu"])
    assert engine_config_from_args(args).max_num_batched_tokens == 2048
    args = parser.parse_args(["serve", str(tmp_path), "--device", "cpu", "--max-num-batched-tokens", "512"])
    assert engine_config_from_args(args).max_num_batched_tokens == 512
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        engine_config_from_args(parser.parse_args(["serve", str(tmp_path), "--device", "cpu",
                                                   "--max-num-batched-tokens", "0"]))


def test_generation_config_supplies_sampling_defaults(tmp_path):
    """vLLM's get_diff_sampling_param: the sampling keys generation_config.json sets (max_new_tokens as
    max_tokens), from the model (auto), a folder, or nowhere (vllm), under --override-generation-config."""
    from qwen4exp.config import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "max_new_tokens": 64}))
    qwen = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert generation_defaults(str(tmp_path)) == qwen
    assert generation_defaults(str(tmp_path / "no-such-model")) == {}
    assert generation_defaults(str(tmp_path), "vllm") == {}
    assert generation_defaults(str(tmp_path), "vllm", {"temperature": 0.5}) == {"temperature": 0.5}
    assert generation_defaults(None, str(tmp_path), {"top_k": 5}) == {**qwen, "top_k": 5}
    with pytest.raises(ConfigError, match="generation_config: no generation_config.json"):
        EngineConfig(generation_config=str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="override_generation_config: unknown keys"):
        EngineConfig(override_generation_config={"temprature": 0.5})
    for bad, field in [({"temperature": "hot"}, "generation_config.temperature"),
                       ({"top_k": 2.5}, "generation_config.top_k"), ({"temperature": -1}, "temperature")]:
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=field):
            generation_defaults(str(tmp_path))


def test_max_model_len_defaults_to_the_model_within_the_cache(tmp_path, caplog):
    """Without max_model_len: the model's max_position_embeddings, or as many tokens as the cache holds where
    that is less (logged). Asked for more than the cache holds: an error naming what would fit."""
    from qwen4exp import LLM
    from qwen4exp.memory import InsufficientMemoryError
    from qwen4exp.weights.random_checkpoint import make_random

    make_random(str(tmp_path), "tiny", dtype="float32")
    kw = dict(device="cpu", load_format="dummy", page_size=16)
    assert load_model_config(str(tmp_path)).max_position_embeddings == 4096
    assert LLM(str(tmp_path), **kw).llm_engine.config.max_model_len == 4096
    with caplog.at_level("WARNING", logger="qwen4exp"):
        capped = LLM(str(tmp_path), num_pages=33, **kw).llm_engine
    assert capped.config.max_model_len == 512 == capped.output_processor.max_model_len
    assert "max_model_len=512" in caplog.text and "4096" in caplog.text
    with pytest.raises(InsufficientMemoryError, match="--max-model-len 512"):
        LLM(str(tmp_path), num_pages=33, max_model_len=1024, **kw)
