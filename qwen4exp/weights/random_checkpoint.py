"""`qwen4exp make-random`: write a random-weight checkpoint in the released HF layout.

Per-expert tensors (`mlp.experts.{e}.gate_proj.weight` ...), the n-gram table split into `split_ngram_parts`
row shards, the PLE hash buffers, config.json, generation_config.json and a tokenizer. Tensors are generated and
written one at a time, so presets larger than memory can be produced.
"""

from __future__ import annotations

import json
import os

import torch

from ..config import load_model_config
from ..model.merged_linear import named_checkpoint_tensors
from .init import fill_
from .loader import EXPERT_PARTS, build_model
from .safetensors_io import write_sharded
from .tokenizer import build_tokenizer

_COMMON = dict(
    model_type="qwen4_exp_text", architectures=["Qwen4ExpForCausalLM"], hidden_act="silu", rms_norm_eps=1e-6,
    attention_bias=False, linear_conv_kernel_dim=4, output_gate_type="sigmoid", norm_topk_prob=True,
    indexer_kv_heads=1, ple_conv_kernel_size=4, make_ngram_vocab_size_divisible_by=128, seed=1234,
    tie_word_embeddings=False, full_attention_interval=4,
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


def preset_config(preset: str, eos_token_id: int = 0, dtype: str = "bfloat16") -> dict:
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown {preset!r}, choose from {sorted(PRESETS)}")
    cfg = dict(_COMMON, **PRESETS[preset], eos_token_id=eos_token_id, dtype=dtype)
    cfg.pop("tokenizer_vocab")
    # explicit, in the released checkpoint's spelling, so every transformers revision reads the same layers
    interval = cfg.pop("full_attention_interval")
    cfg["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                          for i in range(cfg["num_hidden_layers"])]
    return cfg


def checkpoint_specs(model, config) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    """(checkpoint name, shape, dtype, the model tensor it is part of) in the released on-disk layout: the model
    tensor is a stacked expert tensor, an n-gram table, a buffer, or the checkpoint tensor itself (a parameter or
    a merged projection's part, `named_checkpoint_tensors`)."""
    specs = []
    for t in named_checkpoint_tensors(model):
        name, p = t.name, t.tensor
        prefix, leaf = name.rsplit(".", 1)
        per_expert = [(proj, chunks) for proj, (param, _, chunks) in EXPERT_PARTS.items() if param == leaf]
        if prefix.endswith(".mlp.experts") and per_expert:
            for i in range(p.shape[0]):
                for proj, chunks in per_expert:
                    specs.append((f"{prefix}.{i}.{proj}.weight", (p.shape[1] // chunks, p.shape[2]), p.dtype, name))
        elif name.endswith("ngram_embedding.weight"):
            rows = p.shape[0]
            parts = config.split_ngram_parts
            per = -(-rows // parts)
            for i in range(parts):
                n = min(per, rows - i * per)
                if n > 0:
                    specs.append((f"{name[: -len('.weight')]}.shard_{i}.weight", (n, p.shape[1]), p.dtype, name))
        else:
            specs.append((name, tuple(p.shape), p.dtype, name))
    for name, b in model.named_buffers():
        if name.rsplit(".", 1)[-1] in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            specs.append((name, tuple(b.shape), torch.int64, name))
    return specs


def make_random(out_dir: str, preset: str, dtype: str = "bfloat16", seed: int = 0,
                max_shard_bytes: int = 4 << 30, overrides: dict | None = None) -> str:
    """`overrides` replaces config fields of the preset (e.g. a larger ngram_vocab_size_base)."""
    os.makedirs(out_dir, exist_ok=True)
    tok_vocab = PRESETS.get(preset, {}).get("tokenizer_vocab", 1024)
    special = build_tokenizer(out_dir, vocab_size=tok_vocab)
    eos, im_end = special["<|endoftext|>"], special["<|im_end|>"]
    cfg = preset_config(preset, eos_token_id=eos, dtype=dtype) | (overrides or {})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [im_end, eos], "pad_token_id": eos}, f, indent=1)
    config = load_model_config(out_dir)
    torch_dtype = getattr(torch, dtype)
    model = build_model(config, torch_dtype, "meta")
    specs = checkpoint_specs(model, config)
    buffers = dict(model.named_buffers())
    g = torch.Generator().manual_seed(seed)

    def produce(ckpt_name: str) -> torch.Tensor:
        _, shape, dt, param = by_name[ckpt_name]
        if param in buffers:
            from ..model.ple import NGramEmbedding  # recomputed on CPU; meta buffers hold no values

            layer = int(param.split(".")[2])
            module = NGramEmbedding(config, config.ple_index(layer))
            return getattr(module, param.rsplit(".", 1)[-1]).clone()
        return fill_(param, torch.empty(shape, dtype=dt), g)

    by_name = {s[0]: s for s in specs}
    write_sharded(out_dir, [(n, s, d) for n, s, d, _ in specs], produce, max_shard_bytes)
    return out_dir
