"""Engines on random weights for the benchmarks: a preset's config without a checkpoint (`load_format="dummy"`)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile
import time

import torch


def preset_model_config(name: str, dtype: str = "bfloat16", vision: bool = False, **overrides):
    """The ModelConfig of a random-checkpoint preset (qwen4exp.weights.random_checkpoint), with config fields
    replaced by `overrides` (e.g. ngram_vocab_size_base). vision: the multimodal model `make-random --vision`
    writes (its vision tower, and the vision token ids of the preset's tokenizer)."""
    from ..config import load_model_config
    from ..weights.random_checkpoint import multimodal_config, preset_config

    with tempfile.TemporaryDirectory() as d:
        config = preset_config(name, eos_token_id=0, dtype=dtype) | overrides
        if vision:
            config = multimodal_config(name, config, _build_tokenizer(d, name, vision=True))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        return load_model_config(d)


def _build_tokenizer(out_dir: str, preset: str, vision: bool = False) -> dict[str, int]:
    from ..weights.random_checkpoint import PRESETS
    from ..weights.tokenizer import build_tokenizer

    return build_tokenizer(out_dir, vocab_size=PRESETS[preset]["tokenizer_vocab"], vision=vision)


def preset_tokenizer(name: str):
    """The tokenizer `make-random` writes for the preset, loaded as the engine loads a checkpoint's."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        _build_tokenizer(d, name)
        return AutoTokenizer.from_pretrained(d)


def preset_image_processor(name: str):
    """The image processor `make-random --vision` names for the preset (its preprocessor_config.json), loaded as
    the engine loads a checkpoint's: for LLMEngine's `image_processor`."""
    from transformers import AutoImageProcessor

    from ..weights.random_checkpoint import preprocessor_config

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "preprocessor_config.json"), "w") as f:
            json.dump(preprocessor_config(name), f)
        return AutoImageProcessor.from_pretrained(d)


def dummy_engine(model_config, engine_config, device, dtype: str = "bfloat16", tokenizer=None,
                 image_processor=None):
    """(LLMEngine with seeded random weights of `model_config`, seconds it took to start)."""
    from ..engine.engine import LLMEngine

    t0 = time.perf_counter()
    config = dataclasses.replace(engine_config, dtype=dtype, device=str(device), load_format="dummy")
    engine = LLMEngine(None, config, model_config=model_config, tokenizer=tokenizer, image_processor=image_processor)
    return engine, time.perf_counter() - t0


def return_gpu_memory() -> None:
    """Returns the memory of engines no longer referenced (weights, caches, CUDA graph pools) to the device, so that
    another engine fits: call it after dropping the last reference."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
