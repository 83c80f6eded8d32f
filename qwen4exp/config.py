"""Model and engine configuration.

`ModelConfig` is the text model's shape, read once from a checkpoint's `config.json` through transformers and then
frozen. Layers only ever see this object, never the raw HF config. Every invariant the reference validates is
checked again here so that errors name the offending field whatever transformers version parsed the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass, field, fields

from .weights.ngram_table import TABLE_DEVICES, TABLE_DTYPES

LINEAR = "linear_attention"
INDEXED = "indexed_attention"
# Names transformers revisions and released checkpoints use for the indexed (QSA) layers.
_INDEXED_ALIASES = {"full_attention", "qwen_sparse_attention", "hybrid_indexed", "deepseek_sparse_attention"}


def normalise_layer_types(layer_types) -> tuple[str, ...]:
    return tuple(INDEXED if t in _INDEXED_ALIASES else t for t in layer_types)


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


QUANT_METHODS = ("fp8",)
SSM_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class QuantizationConfig:
    """config.json's `quantization_config` (top level, or the text config's) of a quantized checkpoint: block-scaled
    fp8 is the one method (`ops.fp8`: e4m3 weights with one fp32 scale per 128 x 128 block, activations quantized
    per token and 128-column group when they are used). `modules_to_not_convert` names the modules kept in the
    model dtype; which tensors are fp8 is read from the checkpoint itself (a weight with a `weight_scale_inv`)."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, ...] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict) -> QuantizationConfig:
        """Validated; errors name the field (`quantization_config.<key>`). Keys other than the fields are ignored."""
        if not isinstance(raw, dict):
            raise ConfigError("quantization_config", f"must be an object, got {raw!r}")

        def expect(key: str, allowed: tuple, got) -> None:
            if got not in allowed:
                raise ConfigError(f"quantization_config.{key}",
                                  f"must be {' or '.join(map(repr, allowed))}, got {got!r}")

        expect("quant_method", QUANT_METHODS, raw.get("quant_method"))
        expect("fmt", ("e4m3",), raw.get("fmt", "e4m3"))
        expect("activation_scheme", ("dynamic",), raw.get("activation_scheme", "dynamic"))
        block = raw.get("weight_block_size")
        expect("weight_block_size", ([128, 128],), list(block) if isinstance(block, (list, tuple)) else block)
        skip = raw.get("modules_to_not_convert") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
            raise ConfigError("quantization_config.modules_to_not_convert", f"must be a list of names, got {skip!r}")
        return cls(raw["quant_method"], raw.get("fmt", "e4m3"), raw.get("activation_scheme", "dynamic"),
                   tuple(block), tuple(skip))

    def to_dict(self) -> dict:
        return {"quant_method": self.quant_method, "fmt": self.fmt, "activation_scheme": self.activation_scheme,
                "weight_block_size": list(self.weight_block_size),
                "modules_to_not_convert": list(self.modules_to_not_convert)}

    def converts(self, module: str) -> bool:
        """Whether module `module` (e.g. model.layers.0.mlp.gate) is not named by modules_to_not_convert: an entry
        names a module, or every module under it, by whole dotted components ("mlp.gate", "lm_head")."""
        padded = f".{module}."
        return not any(f".{entry.strip('.')}." in padded for entry in self.modules_to_not_convert)


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a multimodal checkpoint (`vision_config`, transformers' Qwen4ExpVisionConfig) and the
    token ids that place its features in the text."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch as the image processor writes them: channels x time x rows x columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, vision: dict, top: dict) -> VisionConfig:
        """From config.json's `vision_config` and, for the token ids, its top level (transformers' defaults for
        what either leaves out). Errors name the field."""
        from transformers import Qwen4ExpConfig, Qwen4ExpVisionConfig

        defaults = Qwen4ExpVisionConfig()
        kw = {}
        for f in fields(cls):
            if f.name.endswith("_token_id"):
                value = top.get(f.name, getattr(Qwen4ExpConfig, f.name, f.default))
            elif f.name == "rope_theta":
                rope = vision.get("rope_parameters") or {}
                if rope.get("rope_type", "axial") != "axial":
                    raise ConfigError("vision_config.rope_parameters.rope_type",
                                      f"only 'axial' is supported, got {rope['rope_type']!r}")
                value = float(rope.get("rope_theta", f.default))
            else:
                value = vision.get(f.name, getattr(defaults, f.name, f.default))
            kw[f.name] = value
        for name in ("patch_size", "temporal_patch_size"):
            if isinstance(kw[name], (list, tuple)):
                if len(set(kw[name])) != 1:
                    raise ConfigError(f"vision_config.{name}", f"only square sizes are supported, got {kw[name]!r}")
                kw[name] = kw[name][0]
        config = cls(**kw)
        for f in fields(cls):
            value = getattr(config, f.name)
            if f.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool) or value < 0 or (
                    value == 0 and not f.name.endswith("_token_id"))):
                where = f.name if f.name.endswith("_token_id") else f"vision_config.{f.name}"
                raise ConfigError(where, f"must be a positive integer, got {value!r}")
        if config.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            raise ConfigError("vision_config.hidden_act", f"must be gelu_pytorch_tanh or gelu, got "
                                                          f"{config.hidden_act!r}")
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ConfigError("vision_config.num_heads", f"hidden_size {config.hidden_size} / num_heads "
                                                         f"{config.num_heads} must be a multiple of 4")
        side = int(config.num_position_embeddings ** 0.5)
        if side * side != config.num_position_embeddings:
            raise ConfigError("vision_config.num_position_embeddings",
                              f"must be a square number, got {config.num_position_embeddings}")
        return config


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    mrope_section: tuple[int, ...] = (11, 11, 10)
    # Gated DeltaNet
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    output_gate_type: str = "silu"
    # the recurrent state's storage dtype the checkpoint asks for (the released config's `mamba_ssm_dtype`); what the
    # engine uses is EngineConfig.mamba_ssm_cache_dtype, whose auto follows this
    mamba_ssm_dtype: str = "float32"
    # MoE
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    # Hyper-connections
    hc_count: int = 4
    hc_lowrank: int = 320
    # PLE (hashed n-gram per-layer embeddings)
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    eos_token_id: int | None = None
    # QSA (indexed sparse attention); None everywhere means dense gated attention on the indexed layers
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    tie_word_embeddings: bool = False
    # MTP (multi-token prediction) layers shipped for drafting, and the `mtp` sub-object's fields; see check_mtp
    mtp_num_hidden_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    mtp_use_dedicated_embeddings: bool = False
    mtp_use_hidden_state_from_layer: int | None = None
    torch_dtype: str = "bfloat16"
    # a quantized checkpoint's quantization_config (a dict is read into QuantizationConfig)
    quantization_config: QuantizationConfig | None = None
    # Token ids the generation loop stops on by default (from generation_config.json or config.json).
    stop_token_ids: tuple[int, ...] = field(default=(), compare=False)
    # the vision tower of a multimodal checkpoint (None: text only)
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        quant = self.quantization_config
        if quant is not None and not isinstance(quant, QuantizationConfig):
            raw = quant.to_dict() if hasattr(quant, "to_dict") else quant  # transformers may hold it as an object
            object.__setattr__(self, "quantization_config", QuantizationConfig.from_dict(raw))
        n = self.mtp_num_hidden_layers
        if not self.mtp_layer_types and isinstance(n, int) and not isinstance(n, bool) and n > 0:
            object.__setattr__(self, "mtp_layer_types", (INDEXED,) * n)  # the sub-object's default
        _validate(self)

    # ----- derived quantities -----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qsa(self) -> bool:
        return self.indexer_n_heads is not None

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_conv_state_len(self) -> int:
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.gdn_value_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def check_mtp(self) -> None:
        """Raise ConfigError, naming the field, unless the checkpoint's MTP layers can draft: at least one, all
        attention layers, drafting from the last layer's hidden state with the model's own embeddings."""
        if self.mtp_num_hidden_layers == 0:
            raise ConfigError("mtp_num_hidden_layers", "is 0: the checkpoint has no MTP layer to draft with")
        if any(t != INDEXED for t in self.mtp_layer_types):
            raise ConfigError("mtp.layer_types",
                              f"MTP layers must be attention layers, got {list(self.mtp_layer_types)}")
        if self.mtp_use_dedicated_embeddings:
            raise ConfigError("mtp_use_dedicated_embeddings",
                              "only false is supported (the MTP layer reads the model's embed_tokens)")
        if self.mtp_use_hidden_state_from_layer is not None:
            raise ConfigError("mtp.mtp_use_hidden_state_from_layer",
                              f"only null (the last layer's streams) is supported, got "
                              f"{self.mtp_use_hidden_state_from_layer!r}")

    def ple_index(self, layer_idx: int) -> int | None:
        """Position of 0-based decoder layer `layer_idx` among the PLE layers, or None."""
        ids = self.ple_layer_ids
        return ids.index(layer_idx + 1) if layer_idx + 1 in ids else None

    @classmethod
    def from_hf(cls, hf, stop_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """Build from a transformers `Qwen4ExpTextConfig` (already normalised by its `__post_init__`)."""
        rope = dict(hf.rope_parameters or {})
        if rope.get("rope_type", "default") != "default":
            raise ConfigError("rope_parameters.rope_type",
                              f"only 'default' RoPE is supported, got {rope['rope_type']!r}")
        eos = hf.eos_token_id
        eos_first = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        if isinstance(eos_first, list):
            eos_first = None
        names = {f.name for f in fields(cls)}
        names.discard("torch_dtype")  # a deprecated alias on transformers configs; read as `dtype` below
        kw = {n: getattr(hf, n) for n in names if hasattr(hf, n) and getattr(hf, n) is not None}
        kw.update(
            layer_types=normalise_layer_types(hf.layer_types),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
            ple_layer_ids=tuple(hf.ple_layer_ids or ()),
            ple_embed_dim=hf.ple_embed_dim or hf.hidden_size,
            output_gate_type=hf.output_gate_type or hf.hidden_act,
            eos_token_id=eos_first,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            torch_dtype=_dtype_name(getattr(hf, "dtype", None)),
            **_mtp_fields(hf),
        )
        if not stop_token_ids and eos is not None:
            stop_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        kw["stop_token_ids"] = tuple(stop_token_ids)
        return cls(**kw)


def _mtp_fields(hf) -> dict:
    """The MTP fields of a config: `mtp_num_hidden_layers` (or vLLM's `num_nextn_predict_layers`, or the `mtp`
    sub-object's `num_hidden_layers`), `mtp_use_dedicated_embeddings`, and the `mtp` sub-object's `layer_types` and
    `mtp_use_hidden_state_from_layer`."""
    sub = getattr(hf, "mtp", None)
    if sub is None:
        sub = {}
    if not isinstance(sub, dict):
        raise ConfigError("mtp", f"must be an object, got {sub!r}")
    counts = {name: value for name, value in (
        ("mtp_num_hidden_layers", getattr(hf, "mtp_num_hidden_layers", None)),
        ("num_nextn_predict_layers", getattr(hf, "num_nextn_predict_layers", None)),
        ("mtp.num_hidden_layers", sub.get("num_hidden_layers"))) if value is not None}
    layers = next(iter(counts.values()), 0)
    for name, value in counts.items():
        if value != layers:
            raise ConfigError(name, f"{value!r} differs from {next(iter(counts))}={layers!r}")
    layer_types = sub.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, (list, tuple)):
        raise ConfigError("mtp.layer_types", f"must be a list, got {layer_types!r}")
    return dict(mtp_num_hidden_layers=layers, mtp_layer_types=normalise_layer_types(layer_types or ()),
                mtp_use_dedicated_embeddings=getattr(hf, "mtp_use_dedicated_embeddings", None) or False,
                mtp_use_hidden_state_from_layer=sub.get("mtp_use_hidden_state_from_layer"))


def _dtype_name(dtype) -> str:
    if dtype is None:
        return "bfloat16"
    return str(dtype).removeprefix("torch.")


def _validate(c: ModelConfig) -> None:
    def positive(*names: str) -> None:
        for name in names:
            value = getattr(c, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")

    positive(
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
        "hc_lowrank",
    )
    if len(c.layer_types) != c.num_hidden_layers:
        raise ConfigError(
            "layer_types", f"has {len(c.layer_types)} entries but num_hidden_layers is {c.num_hidden_layers}"
        )
    bad = sorted(set(c.layer_types) - {LINEAR, INDEXED})
    if bad:
        raise ConfigError("layer_types", f"unsupported Qwen4-Exp layer types {bad}")
    if c.mamba_ssm_dtype not in SSM_DTYPES:
        raise ConfigError("mamba_ssm_dtype", f"must be one of {', '.join(SSM_DTYPES)}, got {c.mamba_ssm_dtype!r}")
    if c.output_gate_type not in ("sigmoid", "silu"):
        raise ConfigError("output_gate_type", f"must be 'sigmoid' or 'silu', got {c.output_gate_type!r}")
    if c.hidden_act != "silu":
        raise ConfigError("hidden_act", f"only 'silu' is supported, got {c.hidden_act!r}")
    if not isinstance(c.hc_count, int) or c.hc_count <= 1:
        raise ConfigError("hc_count", f"Qwen4-Exp requires hc_count > 1, got {c.hc_count!r}")
    if not 0 < c.num_experts_per_tok <= c.num_experts:
        raise ConfigError(
            "num_experts_per_tok",
            f"must be in [1, num_experts={c.num_experts}], got {c.num_experts_per_tok}",
        )
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(
            "num_key_value_heads",
            f"num_attention_heads={c.num_attention_heads} is not divisible by "
            f"num_key_value_heads={c.num_key_value_heads}",
        )
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise ConfigError(
            "linear_num_value_heads",
            f"{c.linear_num_value_heads} is not divisible by linear_num_key_heads={c.linear_num_key_heads}",
        )
    if not 0.0 < c.partial_rotary_factor <= 1.0:
        raise ConfigError("rope_parameters.partial_rotary_factor", f"must be in (0, 1], got {c.partial_rotary_factor}")
    if c.rotary_dim % 2:
        raise ConfigError("rope_parameters.partial_rotary_factor", f"rotary dim {c.rotary_dim} must be even")

    qsa = {
        "indexer_n_heads": c.indexer_n_heads, "indexer_kv_heads": c.indexer_kv_heads,
        "indexer_head_dim": c.indexer_head_dim, "indexer_budget": c.indexer_budget,
        "indexer_compress_ratio": c.indexer_compress_ratio,
    }
    if any(v is not None for v in qsa.values()):
        missing = [k for k, v in qsa.items() if v is None]
        if missing:
            raise ConfigError(missing[0], f"QSA config is missing required fields {missing}")
        for name, value in qsa.items():
            if value <= 0:
                raise ConfigError(name, f"QSA values must be positive, got {value}")
        if c.indexer_kv_heads != 1:
            raise ConfigError("indexer_kv_heads",
                              f"Qwen4-Exp QSA requires indexer_kv_heads=1, got {c.indexer_kv_heads}")
        if c.indexer_budget % c.indexer_compress_ratio:
            raise ConfigError(
                "indexer_budget",
                f"{c.indexer_budget} is not divisible by indexer_compress_ratio={c.indexer_compress_ratio}",
            )
        if c.rotary_dim > c.indexer_head_dim:
            raise ConfigError(
                "indexer_head_dim",
                f"attention RoPE dims must fit the QSA index head: rotary_dim={c.rotary_dim}, "
                f"indexer_head_dim={c.indexer_head_dim}",
            )

    if c.ple_layer_ids:
        if list(c.ple_layer_ids) != sorted(set(c.ple_layer_ids)):
            raise ConfigError("ple_layer_ids", f"must be sorted and unique, got {list(c.ple_layer_ids)}")
        if c.ngram_size < 2 or c.heads_per_ngram <= 0:
            raise ConfigError("ngram_size", f"PLE needs ngram_size >= 2 and heads_per_ngram > 0, got "
                              f"ngram_size={c.ngram_size}, heads_per_ngram={c.heads_per_ngram}")
        if c.ple_embed_dim <= 0 or c.ple_embed_dim % c.ngram_heads:
            raise ConfigError(
                "ple_embed_dim",
                f"must be positive and divisible by the number of n-gram heads: "
                f"{c.ple_embed_dim} % {c.ngram_heads} != 0",
            )
        bad = [i for i in c.ple_layer_ids if i < 1 or i > c.num_hidden_layers]
        if bad:
            raise ConfigError("ple_layer_ids", f"must be one-indexed ids in [1, {c.num_hidden_layers}], got {bad}")
        bad = [i for i in c.ple_layer_ids if c.layer_types[i - 1] != LINEAR]
        if bad:
            raise ConfigError("ple_layer_ids", f"PLE is only supported on linear_attention layers, got layers {bad}")
        if c.eos_token_id is None:
            raise ConfigError("eos_token_id", "must be set when PLE layers are enabled")
        positive("ple_conv_kernel_size", "ngram_vocab_size_base", "make_ngram_vocab_size_divisible_by")
    if not isinstance(c.mtp_num_hidden_layers, int) or isinstance(c.mtp_num_hidden_layers, bool) \
            or c.mtp_num_hidden_layers < 0:
        raise ConfigError("mtp_num_hidden_layers", f"must be a non-negative integer, got {c.mtp_num_hidden_layers!r}")
    if len(c.mtp_layer_types) != c.mtp_num_hidden_layers:
        raise ConfigError("mtp.layer_types", f"has {len(c.mtp_layer_types)} entries but mtp_num_hidden_layers is "
                                             f"{c.mtp_num_hidden_layers}")
    if not isinstance(c.mtp_use_dedicated_embeddings, bool):
        raise ConfigError("mtp_use_dedicated_embeddings", f"must be true or false, got "
                                                          f"{c.mtp_use_dedicated_embeddings!r}")
    if c.torch_dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError("torch_dtype", f"unsupported dtype {c.torch_dtype!r}")


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def load_model_config(model_dir: str) -> ModelConfig:
    """Read `config.json` (multimodal `qwen4_exp` wrapper or flat `qwen4_exp_text`) through transformers."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}")
    raw = read_json(path)
    model_type = raw.get("model_type")
    if model_type == "qwen4_exp":
        text = dict(raw.get("text_config") or {})
        text.setdefault("eos_token_id", raw.get("eos_token_id"))
        if raw.get("quantization_config") is not None:
            text.setdefault("quantization_config", raw["quantization_config"])
    elif model_type == "qwen4_exp_text":
        text = {k: v for k, v in raw.items() if k != "model_type"}
    else:
        raise ConfigError("model_type", f"expected 'qwen4_exp' or 'qwen4_exp_text', got {model_type!r}")
    # Our checks first (their errors name the field), then transformers normalises the config.
    ModelConfig.from_hf(_with_defaults(text, Qwen4ExpTextConfig))
    try:
        if model_type == "qwen4_exp":
            hf = Qwen4ExpConfig(**{k: v for k, v in raw.items() if k != "model_type"}).text_config
            if hf.eos_token_id is None and raw.get("eos_token_id") is not None:
                hf.eos_token_id = raw["eos_token_id"]
        else:
            hf = Qwen4ExpTextConfig(**text)
    except StrictDataclassError as e:
        raise ConfigError(_field_from_hf_error(e), str(e).replace("\n", " ")) from None
    if text.get("quantization_config") is not None:  # a wrapper's top-level one is not its text config's
        hf.quantization_config = text["quantization_config"]
    stop = ()
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        eos = read_json(gen_path).get("eos_token_id")
        if eos is not None:
            stop = tuple(eos) if isinstance(eos, list) else (eos,)
    config = ModelConfig.from_hf(hf, stop)
    if model_type == "qwen4_exp" and raw.get("vision_config") is not None:
        vision = VisionConfig.from_dict(raw["vision_config"], raw)
        if vision.out_hidden_size != config.hidden_size:
            raise ConfigError("vision_config.out_hidden_size", f"{vision.out_hidden_size} differs from the text "
                                                               f"model's hidden_size {config.hidden_size}")
        config = dataclasses.replace(config, vision=vision)
    return config


def _with_defaults(text: dict, hf_class):
    """A config-like namespace: the file's values over transformers' class defaults, with layer_types derived the
    way the reference derives them (so validation sees what the model would be built from)."""
    from types import SimpleNamespace

    ns = SimpleNamespace(**{
        name: getattr(hf_class, name) for name in dir(hf_class)
        if not name.startswith("_") and not callable(getattr(hf_class, name)) and not isinstance(
            getattr(hf_class, name), (property, dict))
    })
    for key, value in text.items():
        setattr(ns, key, value)
    if not isinstance(ns.num_hidden_layers, int) or isinstance(ns.num_hidden_layers, bool):
        raise ConfigError("num_hidden_layers", f"must be an integer, got {ns.num_hidden_layers!r}")
    if ns.layer_types is None:
        interval = text.get("full_attention_interval", 4)
        ns.layer_types = [LINEAR if (i + 1) % interval else INDEXED for i in range(ns.num_hidden_layers)]
    ns.layer_types = list(normalise_layer_types(ns.layer_types))
    ns.ple_layer_ids = sorted(set(ns.ple_layer_ids or []))
    for name in ("hidden_size", "num_attention_heads"):
        value = getattr(ns, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(name, f"must be a positive integer, got {value!r}")
    rope = dict(text.get("rope_parameters") or {"rope_type": "default"})
    for legacy in ("rope_theta", "partial_rotary_factor"):  # older configs keep these at the top level
        if legacy in text:
            rope.setdefault(legacy, text[legacy])
    rope.setdefault("rope_theta", 10000.0)
    ns.rope_parameters = rope
    ns.dtype = text.get("dtype") or text.get("torch_dtype")
    return ns


def _field_from_hf_error(e: Exception) -> str:
    msg = str(e)
    if "for field '" in msg:
        return msg.split("for field '", 1)[1].split("'", 1)[0]
    return "config.json"


def resolve_device(device=None):
    """The device an engine runs on: the one given, else the GPU when there is one, else the CPU."""
    import torch

    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def default_max_num_batched_tokens(device, server: bool) -> int:
    """The step token budget when none is given: vLLM 0.33's defaults (`EngineArgs.get_batch_defaults`). Larger
    steps where the GPU has the memory and compute for them; the OpenAI server gets smaller ones than the offline
    `LLM` class, because every running request waits for each step."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return 2048 if server else 4096
    props = torch.cuda.get_device_properties(device)
    gib = props.total_memory / 2**30
    if gib >= 160:
        return 16384
    # A100s lose throughput with large steps (vLLM PR #17885); GB10 (cc 12.1) has the memory but not the compute
    if gib >= 70 and "a100" not in props.name.lower() and (props.major, props.minor) != (12, 1):
        return 8192 if server else 16384
    return 2048 if server else 8192


DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


def _option(default, help: str, choices: tuple | None = None, parse=None):
    """An engine option: its default, its `--help` text, where the values are a fixed set their choices, and the
    parser of its command-line value when that is not the field's type."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse})


def human_readable_int(text: str) -> int:
    """vLLM's integers with a unit: k, m, g, t are powers of 1000 (`25.6k` = 25600), K, M, G, T powers of 1024
    (`32K` = 32768, whole numbers only); a plain integer as is."""
    text = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if m is None:
        return int(text)
    number, unit = m.groups()
    if unit.islower():
        return int(float(number) * 1000 ** ("kmgt".index(unit) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text}: a binary unit takes a whole number (did you mean "
                                         f"{number}{unit.lower()}?)")
    return int(number) * 1024 ** ("KMGT".index(unit) + 1)


def max_model_len_arg(text: str) -> int | None:
    """--max-model-len: a human_readable_int, or `auto` / -1 for the default (None)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(text)


def json_object_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# generation_config.json's keys that supply request defaults, as vLLM reads them (max_new_tokens is max_tokens)
GENERATION_PARAMS = {"repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float,
                     "temperature": float, "top_k": int, "top_p": float, "min_p": float, "max_new_tokens": int,
                     "skip_special_tokens": bool}


def _check_generation_source(source: str, override: dict | None) -> None:
    if not isinstance(source, str) or not source:
        raise ConfigError("generation_config", f"must be auto, vllm or a folder, got {source!r}")
    if source not in ("auto", "vllm") and not os.path.isfile(os.path.join(source, "generation_config.json")):
        raise ConfigError("generation_config", f"no generation_config.json in {source!r} (a folder, auto or vllm)")
    if override is not None and not isinstance(override, dict):
        raise ConfigError("override_generation_config", f"must be a dict of sampling defaults, got {override!r}")
    unknown = sorted(set(override or {}) - set(GENERATION_PARAMS))
    if unknown:
        raise ConfigError("override_generation_config",
                          f"unknown keys {unknown} (known: {', '.join(GENERATION_PARAMS)})")


def generation_defaults(model_dir: str | None, source: str = "auto", override: dict | None = None) -> dict:
    """The sampling defaults of requests that leave them unset, as vLLM's `get_diff_sampling_param`: the
    GENERATION_PARAMS set in generation_config.json (of the model for `auto`, of the folder `source`, none for
    `vllm`), with `override` on top; SamplingParams' keys (max_tokens for max_new_tokens). Errors name the key."""
    _check_generation_source(source, override)
    config: dict = {}
    if source != "vllm":
        folder = model_dir if source == "auto" else source
        path = os.path.join(folder, "generation_config.json") if folder else None
        if path is not None and os.path.isfile(path):
            config = read_json(path)
    config = {**config, **(override or {})}
    out = {}
    for key, kind in GENERATION_PARAMS.items():
        value = config.get(key)
        if value is None:
            continue
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool))
        if not ok:
            raise ConfigError(f"generation_config.{key}", f"must be {kind.__name__}, got {value!r}")
        out["max_tokens" if key == "max_new_tokens" else key] = value
    if out:
        from .engine.request import SamplingParams

        try:
            SamplingParams(**out)
        except ValueError as e:
            raise ConfigError("generation_config", str(e)) from None
    return out


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Every option of one engine instance, with vLLM's names. The command line's engine flags are generated from
    these fields (`add_cli_args`), so `serve`, `generate` and `bench` share one set of flags and defaults."""

    dtype: str = _option("auto", "weights and activations dtype; float and half are aliases of float32 and float16 "
                                 "(auto: the checkpoint's dtype on a GPU, float32 on the CPU)", DTYPES)
    device: str | None = _option(None, "cuda, cuda:N or cpu (default: cuda when available)")
    load_format: str = _option("auto", "auto and safetensors read the checkpoint's weights; dummy fills random "
                                       "weights and reads only config.json", LOAD_FORMATS)
    max_model_len: int | None = _option(
        None, "the longest sequence (prompt + output) in tokens; 32k is 32000 and 32K is 32768, as in vLLM (default, "
              "or auto or -1: the model's max_position_embeddings, less where the cache cannot hold one sequence of "
              "it)", parse=max_model_len_arg)
    max_num_seqs: int = _option(64, "the most sequences in one batch")
    max_num_batched_tokens: int | None = _option(
        None, "tokens per step (default: vLLM 0.33's for the device, smaller for the OpenAI server than offline: "
              "8192 and 16384 on an H100 or H200, 2048 and 4096 on the CPU)")
    page_size: int | None = _option(
        None, "tokens per KV cache page, a multiple of the model's indexer_compress_ratio (default: 16 rounded up "
              "to such a multiple)")
    gpu_memory_utilization: float = _option(0.9, "fraction of the GPU's memory the engine may use (weights and cache)")
    cpu_cache_bytes: int = _option(1 << 30, "KV cache and state budget in bytes when running on the CPU")
    num_pages: int | None = _option(None, "KV cache pages to allocate (default: as many as the memory budget holds)")
    enforce_eager: bool = _option(False, "run every step eagerly, without CUDA graphs")
    enable_prefix_caching: bool = _option(
        True, "reuse the cached pages and saved recurrent state of a prompt's longest prefix computed before "
              "(conversation turns, shared system prompts), with max_num_seqs state slots more for the saved "
              "states; off with speculative decoding")
    async_scheduling: bool | None = _option(
        None, "launch each step before the previous step's sampled ids are read, overlapping the host's bookkeeping "
              "with the GPU (default: on for CUDA; on the CPU there is nothing to overlap)")
    cuda_graph_sizes: list[int] | None = _option(
        None, "decode batch sizes captured as CUDA graphs (default: 1, 2, 4, 8, 16, 24, ... up to --max-num-seqs)")
    seed: int = _option(0, "random seed of dummy weights and of sampling without a per-request seed")
    ple_table_device: str = _option(
        "auto", "where the PLE n-gram tables live: with the model on the GPU, or in page-locked host memory read row "
                "by row (auto: the GPU when all weights leave 10% of the memory budget free)", TABLE_DEVICES)
    ple_table_dtype: str = _option(
        "auto", "n-gram table storage; fp8 is e4m3 with one scale per table (auto: the checkpoint's fp8, else the "
                "model dtype)", TABLE_DTYPES)
    generation_config: str = _option(
        "auto", "where requests' sampling defaults come from: auto reads the model's generation_config.json "
                "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens...), vllm uses none, a folder "
                "reads its generation_config.json; a request's own values come first")
    override_generation_config: dict | None = _option(
        None, "sampling defaults over the generation config's, as a JSON object (e.g. '{\"temperature\": 0.5}')",
        parse=json_object_arg)
    quantization: str | None = _option(
        None, "quantize the projections and experts of a checkpoint stored in bf16 on load; fp8 is block-scaled e4m3 "
              "(one scale per 128 x 128 weight block, activations quantized per token and 128 columns). An fp8 "
              "checkpoint loads as fp8 without it", QUANT_METHODS)
    tensor_parallel_size: int = _option(
        1, "devices the model is split over, one process each (torch.distributed: NCCL on GPUs, gloo on the CPU); "
           "over several nodes with torchrun's MASTER_ADDR, MASTER_PORT, NNODES and NODE_RANK")
    enable_expert_parallel: bool = _option(
        False, "place the routed experts whole on the ranks, an equal share each, instead of splitting every expert "
               "by its intermediate size")
    ple_table_parallel: str = _option(
        "replicated", "the PLE n-gram tables over several ranks: a copy on every rank, or each rank an equal range "
                      "of every table's rows (the rows each rank holds are joined by one all-reduce)",
        ("replicated", "rows"))
    speculative_config: dict | None = _option(
        None, "speculative decoding as vLLM's JSON object, '{\"method\": \"mtp\", \"num_speculative_tokens\": k}': "
              "the checkpoint's multi-token-prediction layer drafts k tokens (1 to 4) after each sampled one and one "
              "step of the model verifies them; outputs are distributed as without it", parse=json_object_arg)
    mamba_ssm_cache_dtype: str = _option(
        "auto", "storage of the GDN layers' recurrent state (vLLM's flag). bfloat16 halves it (a flash-next state "
                "slot shrinks from 110 to 56 MiB) and the bytes each decode step moves for it; the state is rounded "
                "to it after every decoded token and where a prefill chunk ends (speculative verification rounds "
                "it after every row, as decoding does). auto: the checkpoint's mamba_ssm_dtype, else float32 (what "
                "transformers computes; vLLM's auto is the model dtype unless the checkpoint names one)",
        ("auto", *SSM_DTYPES))
    limit_mm_per_prompt: dict | None = _option(
        None, "the most images of one prompt, as vLLM's JSON object ('{\"image\": 4}'); a prompt with more is "
              "refused (default: no limit)", parse=json_object_arg)

    def __post_init__(self) -> None:
        # the Python API also takes torch.dtype / torch.device objects; the config keeps their names
        if self.dtype is not None and not isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.device is not None and not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))
        for f in fields(self):
            choices = f.metadata["choices"]
            value = getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                raise ConfigError(f.name, f"must be one of {', '.join(choices)}, got {value!r}")
        if self.max_model_len == -1:  # vLLM's "auto"
            object.__setattr__(self, "max_model_len", None)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "cpu_cache_bytes",
                     "num_pages", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "max_num_batched_tokens", "page_size", "num_pages"):
                continue
            if not _positive_int(value):
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError("enable_prefix_caching", f"must be true or false, got {self.enable_prefix_caching!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError("seed", f"must be an integer, got {self.seed!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        sizes = self.cuda_graph_sizes
        if sizes is not None and (not sizes or not all(_positive_int(n) for n in sizes)):
            raise ConfigError("cuda_graph_sizes", f"must be a non-empty list of positive integers, got {sizes!r}")
        _check_generation_source(self.generation_config, self.override_generation_config)
        object.__setattr__(self, "speculative_config", _check_speculative_config(self.speculative_config))
        limits = self.limit_mm_per_prompt
        if limits is not None:
            if not isinstance(limits, dict) or set(limits) - {"image"}:
                raise ConfigError("limit_mm_per_prompt", f"must be a JSON object with the key image, got {limits!r}")
            image = limits.get("image")
            if image is not None and (not isinstance(image, int) or isinstance(image, bool) or image < 0):
                raise ConfigError("limit_mm_per_prompt.image", f"must be a non-negative integer, got {image!r}")
        if self.device is not None:
            import torch

            try:
                torch.device(self.device)
            except RuntimeError:
                raise ConfigError("device", f"expected cuda, cuda:N or cpu, got {self.device!r}") from None

    def ssm_dtype(self, model_config: ModelConfig) -> str:
        """The recurrent state's storage dtype for `model_config`: mamba_ssm_cache_dtype, auto resolved."""
        if self.mamba_ssm_cache_dtype == "auto":
            return model_config.mamba_ssm_dtype
        return self.mamba_ssm_cache_dtype

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per step (0: no speculative decoding)."""
        return self.speculative_config["num_speculative_tokens"] if self.speculative_config else 0

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
        """One flag per field: `--max-model-len` for `max_model_len`, `--x/--no-x` for booleans, the field's choices
        and help. Values are checked when `from_cli_args` builds the config, so errors name the field."""
        group = parser.add_argument_group("engine options")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
            text = f.metadata["help"].replace("%", "%%")
            if f.default is not None:
                text += " (default: %(default)s)"
            kw = dict(dest=f.name, default=f.default, help=text)
            if f.metadata["parse"] is not None:
                kw["type"] = f.metadata["parse"]
            elif kind is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif typing.get_origin(kind) is list:
                kw.update(type=typing.get_args(kind)[0], nargs="+")
            else:
                kw.update(type=kind, choices=f.metadata["choices"])
            group.add_argument("--" + f.name.replace("_", "-"), **kw)
        return group

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


SPECULATIVE_METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 4


def _check_speculative_config(value: dict | None) -> dict | None:
    """EngineConfig.speculative_config checked (errors name the key) and complete: method and
    num_speculative_tokens."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError("speculative_config", f"must be a JSON object such as {{\"method\": \"mtp\", "
                                                f"\"num_speculative_tokens\": 1}}, got {value!r}")
    unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ConfigError("speculative_config", f"unsupported keys {unknown} (supported: method, "
                                                f"num_speculative_tokens)")
    method = value.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ConfigError("speculative_config.method",
                          f"must be 'mtp' (drafts from the checkpoint's multi-token-prediction layer), got {method!r}")
    k = value.get("num_speculative_tokens")
    if not _positive_int(k) or k > MAX_SPECULATIVE_TOKENS:
        raise ConfigError("speculative_config.num_speculative_tokens",
                          f"must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
    return {"method": method, "num_speculative_tokens": k}


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
