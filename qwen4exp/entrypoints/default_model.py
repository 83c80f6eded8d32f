"""The model a command runs when none is given: a random-weight `tiny` checkpoint, built on first use into
$QWEN4EXP_CACHE_DIR (default ~/.cache/qwen4exp) and reused afterwards, so that `serve`, `generate` and `bench` run
on a fresh machine without a download. Its folder is named after the code that writes it, so a checkpoint written
by an older version (another tokenizer or chat template, new tensors) is not reused."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import tempfile

logger = logging.getLogger("qwen4exp")


def resolve_model(model: str | None) -> str:
    """`model`, or without one the default model's directory (built on first use; see the module docstring)."""
    if model is not None:
        return model
    root = os.environ.get("QWEN4EXP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qwen4exp")
    path = os.path.join(root, f"tiny-random-{_writer_digest()}")
    action = "using the"
    if not os.path.isdir(path):
        from ..weights.random_checkpoint import make_random

        os.makedirs(root, exist_ok=True)
        # built beside its final place and renamed into it, so an interrupted build leaves no partial checkpoint
        tmp = tempfile.mkdtemp(prefix=".tiny-random-", dir=root)
        try:
            make_random(tmp, "tiny", dtype="float32")  # float32 runs on the CPU too
            os.rename(tmp, path)
            action = "built a"
        except OSError:
            if not os.path.isdir(path):  # else another process built it first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("no model given: %s random-weight tiny model in %s (its output is gibberish); pass a checkpoint "
                "directory (`qwen4exp serve MODEL`, `qwen4exp generate --model MODEL`) to run a real one", action, path)
    return path


def _writer_digest() -> str:
    """A short digest of the modules that write the default checkpoint."""
    from ..weights import random_checkpoint, tokenizer

    digest = hashlib.sha256()
    for module in (random_checkpoint, tokenizer):
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def add_model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: a random-weight tiny model, built once into "
                        "$QWEN4EXP_CACHE_DIR, default ~/.cache/qwen4exp)")
