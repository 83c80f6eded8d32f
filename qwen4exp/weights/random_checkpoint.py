"""`qwen4exp make-random`: write a random-weight checkpoint in the released HF layout.

Per-expert tensors (`mlp.experts.{e}.gate_proj.weight` ...), the n-gram table split into `split_ngram_parts`
row shards, the PLE hash buffers, the MTP draft layer (`mtp.*`, model/mtp.py; config.json's `mtp_num_hidden_layers`
and `mtp` sub-object as released), config.json, generation_config.json and a tokenizer. Tensors are generated and
written one at a time, so presets larger than memory can be produced.

With `quantization="fp8"` it writes the released FP8 layout: config.json's `quantization_config` (its
`modules_to_not_convert` listing the projections kept in the model dtype), every quantizable weight
(`model.merged_linear.quantizable_weights`, per-expert ones included) as float8_e4m3fn with its fp32
`weight_scale_inv`, and the n-gram table in fp8 with one `weight_scale` per table. Its values are those of the
checkpoint written in `dtype` with the same seed, quantized as the loader quantizes that one on load.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..config import QuantizationConfig, load_model_config
from ..model import Qwen4ExpForCausalLM
from ..model.merged_linear import MergedLinear, named_checkpoint_tensors, use_fp8_
from ..model.moe import Experts
from ..ops.fp8 import FP8, quantize_weight
from .init import fill_
from .loader import EXPERT_PARTS, SCALE, build_model, fp8_weights
from .ngram_table import fp8_scale, write_rows_
from .safetensors_io import write_sharded
from .tokenizer import build_tokenizer

_COMMON = dict(
    model_type="qwen4_exp_text", architectures=["Qwen4ExpForCausalLM"], hidden_act="silu", rms_norm_eps=1e-6,
    attention_bias=False, linear_conv_kernel_dim=4, output_gate_type="sigmoid", mamba_ssm_dtype="float32",
    norm_topk_prob=True, indexer_kv_heads=1, ple_conv_kernel_size=4, make_ngram_vocab_size_divisible_by=128, seed=1234,
    tie_word_embeddings=False, full_attention_interval=4, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
)

PRESETS: dict[str, dict] = {
    # seconds on CPU, every feature active: 2 PLE layers, QSA selection from 12 tokens on
    "tiny": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, hc_count=4, hc_lowrank=16, ple_layer_ids=[2, 3], ple_embed_dim=32,
        ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000, split_ngram_parts=4, indexer_n_heads=2,
        indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        tokenizer_vocab=512,
    ),
    # about 100M parameters
    "small": dict(
        vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=384,
        shared_expert_intermediate_size=384, hc_count=4, hc_lowrank=64, ple_layer_ids=[2], ple_embed_dim=256,
        ngram_size=3, heads_per_ngram=4, ngram_vocab_size_base=20000, split_ngram_parts=8, indexer_n_heads=4,
        indexer_head_dim=64, indexer_budget=64, indexer_compress_ratio=4, max_position_embeddings=32768,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25),
        tokenizer_vocab=1024,
    ),
    # the released widths with 128 experts and a 2M n-gram base: sized for one H200
    "flash-next-128e": dict(
        vocab_size=248320, hidden_size=2560, num_hidden_layers=48, num_attention_heads=24, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=128, num_experts_per_tok=10, moe_intermediate_size=640,
        shared_expert_intermediate_size=640, hc_count=4, hc_lowrank=320, ple_layer_ids=[2], ple_embed_dim=2560,
        ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=2_000_000, split_ngram_parts=128, indexer_n_heads=4,
        indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, max_position_embeddings=262144,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
        tokenizer_vocab=1024,
    ),
}
PRESETS["flash-next"] = dict(PRESETS["flash-next-128e"], num_experts=512, ngram_vocab_size_base=20_000_000)

# `--vision`: the vision tower (transformers' Qwen4ExpVisionConfig, out_hidden_size = the text width) and the image
# processor's pixel bounds; presets not named here get the released widths
VISION_PRESETS: dict[str, dict] = {
    "tiny": dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=64),
    "small": dict(depth=4, hidden_size=128, num_heads=4, intermediate_size=256, num_position_embeddings=256),
}
RELEASED_VISION = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                       num_position_embeddings=2304)
# shortest_edge / longest_edge are pixel counts; an image token covers 32 x 32 pixels (patch 16, merge 2)
PROCESSOR_PIXELS = {"tiny": (1024, 64 * 1024), "small": (4096, 256 * 1024)}
RELEASED_PIXELS = (65536, 16777216)


def multimodal_config(preset: str, text: dict, special: dict[str, int]) -> dict:
    """config.json of `preset`'s multimodal layout: transformers' `qwen4_exp` wrapper with the text config `text`
    (without its quantization_config, which belongs at the top level) under text_config, the vision tower
    (transformers' Qwen4ExpVisionConfig) and the vision token ids `special` of the tokenizer."""
    vision = dict(RELEASED_VISION, **VISION_PRESETS.get(preset, {}))
    vision.update(model_type="qwen4_exp_vision", hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    body = {k: v for k, v in text.items() if k not in ("architectures", "quantization_config")}
    return {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"],
            "text_config": dict(body, model_type="qwen4_exp_text"), "vision_config": vision,
            "image_token_id": special["<|image_pad|>"], "video_token_id": special["<|video_pad|>"],
            "vision_start_token_id": special["<|vision_start|>"], "vision_end_token_id": special["<|vision_end|>"],
            "eos_token_id": text["eos_token_id"], "tie_word_embeddings": False, "dtype": text["dtype"]}


def preprocessor_config(preset: str) -> dict:
    """preprocessor_config.json of `preset`'s multimodal layout: transformers' Qwen2-VL image processor."""
    low, high = PROCESSOR_PIXELS.get(preset, RELEASED_PIXELS)
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
            "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
            "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "size": {"shortest_edge": low, "longest_edge": high}}


def preset_config(preset: str, eos_token_id: int = 0, dtype: str = "bfloat16") -> dict:
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown {preset!r}, choose from {sorted(PRESETS)}")
    cfg = dict(_COMMON, **PRESETS[preset], eos_token_id=eos_token_id, dtype=dtype)
    cfg.pop("tokenizer_vocab")
    # explicit, in the released checkpoint's spelling, so every transformers revision reads the same layers
    interval = cfg.pop("full_attention_interval")
    cfg["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                          for i in range(cfg["num_hidden_layers"])]
    cfg["mtp"] = dict(hybrid=True, layer_types=["full_attention"] * cfg["mtp_num_hidden_layers"],
                      mtp_use_hidden_state_from_layer=None, num_hidden_layers=cfg["mtp_num_hidden_layers"],
                      rope_theta=cfg["rope_parameters"]["rope_theta"])
    return cfg


def checkpoint_specs(model, config) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    """(checkpoint name, shape, dtype, the model tensor it is part of) in the released on-disk layout: the model
    tensor is a stacked expert tensor, an n-gram table, a buffer, or the checkpoint tensor itself (a parameter or
    a merged projection's part, `named_checkpoint_tensors`). An fp8 weight is followed by its scales."""
    specs = []
    for t in named_checkpoint_tensors(model):
        name, p = t.name, t.tensor
        if isinstance(t.module, Experts):
            if name.endswith(SCALE):
                continue  # each expert's scales follow its weight
            prefix = name.rsplit(".", 1)[0]
            for i in range(t.module.num_experts):
                for proj in (proj for proj, param in EXPERT_PARTS.items() if param == t.leaf):
                    weight, scale = t.module.expert_tensors(i, proj)
                    specs.append((f"{prefix}.{i}.{proj}.weight", tuple(weight.shape), weight.dtype, name))
                    if scale is not None:
                        specs.append((f"{prefix}.{i}.{proj}.weight{SCALE}", tuple(scale.shape), scale.dtype, name))
        elif name.endswith("ngram_embedding.weight"):
            rows = p.shape[0]
            parts = config.split_ngram_parts
            per = -(-rows // parts)
            for i in range(parts):
                n = min(per, rows - i * per)
                if n > 0:
                    specs.append((f"{name[: -len('.weight')]}.shard_{i}.weight", (n, p.shape[1]), p.dtype, name))
            if p.dtype == FP8:
                specs.append((name + "_scale", (), torch.float32, name))
        else:
            specs.append((name, tuple(p.shape), p.dtype, name))
    for name, b in model.named_buffers():
        if name.rsplit(".", 1)[-1] in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            specs.append((name, tuple(b.shape), torch.int64, name))
    return specs


def unquantized_projections(model) -> list[str]:
    """The modules of the linear projections kept in the model dtype (the router, the shared-expert gate, the
    hyper-connection projections, lm_head, and whatever else is not fp8): a quantization_config's
    modules_to_not_convert."""
    return [t.name.removesuffix(".weight") for t in named_checkpoint_tensors(model)
            if t.name.endswith(".weight") and t.tensor.dtype != FP8 and isinstance(t.module, (nn.Linear, MergedLinear))]


def make_random(out_dir: str, preset: str, dtype: str = "bfloat16", seed: int = 0,
                max_shard_bytes: int = 4 << 30, overrides: dict | None = None, quantization: str | None = None,
                vision: bool = False, weights: bool = True) -> str:
    """`overrides` replaces config fields of the preset (e.g. a larger ngram_vocab_size_base). quantization: None,
    or "fp8" for the released FP8 layout (see the module docstring). vision: the multimodal layout (config.json's
    `qwen4_exp` wrapper with the text config under text_config, a vision tower `model.visual.*` kept in `dtype`, the
    text model's tensors under `model.language_model.*`, the vision tokens, preprocessor_config.json). weights=False:
    everything but the weights, for engines that make their own (load_format="dummy")."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization: unknown value {quantization!r} (expected fp8)")
    os.makedirs(out_dir, exist_ok=True)
    tok_vocab = PRESETS.get(preset, {}).get("tokenizer_vocab", 1024)
    special = build_tokenizer(out_dir, vocab_size=tok_vocab, vision=vision)
    eos, im_end = special["<|endoftext|>"], special["<|im_end|>"]
    cfg = preset_config(preset, eos_token_id=eos, dtype=dtype) | (overrides or {})
    if quantization:
        cfg["quantization_config"] = QuantizationConfig().to_dict()
    wrapper = None
    if vision:
        with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
            json.dump(preprocessor_config(preset), f, indent=1)
        wrapper = multimodal_config(preset, cfg, special)

    def write_config() -> None:
        out = cfg
        if wrapper is not None:
            out = dict(wrapper, **({"quantization_config": cfg["quantization_config"]}
                                   if "quantization_config" in cfg else {}))
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(out, f, indent=1)

    write_config()
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [im_end, eos], "pad_token_id": eos}, f, indent=1)
    config = load_model_config(out_dir)
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        meta = Qwen4ExpForCausalLM(config, mtp=config.mtp_num_hidden_layers > 0)
    use_fp8_(meta, fp8_weights(meta, config, None, quantization))
    model = build_model(config, torch_dtype, "meta", table_dtype=FP8 if quantization else None, model=meta)
    if quantization:
        cfg["quantization_config"]["modules_to_not_convert"] = unquantized_projections(model)
        write_config()
    if not weights:
        return out_dir
    specs = checkpoint_specs(model, config)
    buffers = dict(model.named_buffers())
    g = torch.Generator().manual_seed(seed)
    scales: dict[str, torch.Tensor] = {}  # the scales of the fp8 weight written last
    table_scales: dict[str, float] = {}

    def values(param: str, shape) -> torch.Tensor:
        """The next random values, rounded to the checkpoint's dtype (what a checkpoint in `dtype` stores)."""
        return fill_(param, torch.empty(shape, dtype=torch_dtype), g)

    def table_scale(param: str) -> float:
        """One scale per table needs the max of all its shards first: drawn once, then drawn again for writing."""
        if param not in table_scales:
            state, amax = g.get_state(), 0.0
            for _, shape, dt, p in specs:
                if p == param and dt == FP8:
                    lo, hi = torch.aminmax(values(param, shape))
                    amax = max(amax, -float(lo), float(hi))
            g.set_state(state)
            table_scales[param] = fp8_scale(amax)
        return table_scales[param]

    def produce(ckpt_name: str) -> torch.Tensor:
        _, shape, dt, param = by_name[ckpt_name]
        if param in buffers:
            from ..model.ple import NGramEmbedding  # recomputed on CPU; meta buffers hold no values

            layer = int(param.split(".")[2])
            module = NGramEmbedding(config, config.ple_index(layer))
            return getattr(module, param.rsplit(".", 1)[-1]).clone()
        if ckpt_name.endswith(SCALE):
            return scales.pop(ckpt_name)
        if ckpt_name.endswith("ngram_embedding.weight_scale"):
            return torch.tensor(table_scale(param), dtype=torch.float32)
        if dt != FP8:
            return fill_(param, torch.empty(shape, dtype=dt), g)
        if "ngram_embedding" in param:
            scale = table_scale(param)
            out = torch.empty(shape, dtype=FP8)
            write_rows_(out, 0, values(param, shape), scale)
            return out
        wq, scales[ckpt_name + SCALE] = quantize_weight(values(param, shape))
        return wq

    by_name = {s[0]: s for s in specs}
    stored = {n: n for n, *_ in specs}
    if vision:  # the released names: the text model under model.language_model.
        stored = {n: "model.language_model." + n[len("model."):] if n.startswith("model.") and
                  not n.startswith("model.visual.") else n for n in stored}
    by_stored = {v: k for k, v in stored.items()}
    write_sharded(out_dir, [(stored[n], s, d) for n, s, d, _ in specs], lambda name: produce(by_stored[name]),
                  max_shard_bytes)
    return out_dir
