"""Engines on random weights for the benchmarks: a preset's config without a checkpoint (`load_format="dummy"`)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile
import time

import torch


def preset_model_config(name: str, dtype: str = "bfloat16", **overrides):
    """The ModelConfig of a random-checkpoint preset (qwen4exp.weights.random_checkpoint), with config fields
    replaced by `overrides` (e.g. ngram_vocab_size_base)."""
    from ..config import load_model_config
    from ..weights.random_checkpoint import preset_config

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(preset_config(name, eos_token_id=0, dtype=dtype) | overrides, f)
        return load_model_config(d)


def dummy_engine(model_config, engine_config, device, dtype: str = "bfloat16"):
    """(LLMEngine with seeded random weights of `model_config`, seconds it took to start)."""
    from ..engine.engine import LLMEngine

    t0 = time.perf_counter()
    config = dataclasses.replace(engine_config, dtype=dtype, device=str(device), load_format="dummy")
    engine = LLMEngine(None, config, model_config=model_config, tokenizer=None)
    return engine, time.perf_counter() - t0


def return_gpu_memory() -> None:
    """Returns the memory of engines no longer referenced (weights, caches, CUDA graph pools) to the device, so that
    another engine fits: call it after dropping the last reference."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
