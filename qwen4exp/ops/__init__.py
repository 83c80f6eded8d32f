"""Kernels. Each op `X.py` holds its public API, the dispatch and its one torch reference; `X_triton.py` beside it
holds the Triton kernels of its fast path. The reference is the CPU path and the definition of correctness; a fast
path is chosen per device by `fast_path(tensor)` and must agree with the reference (tests/ops). Size thresholds
between implementations live in `tuning.py`.
"""

from . import (  # noqa: E402,F401  (after the dispatch helpers, which every op module imports)
    acceptance,
    attention,
    conv,
    gated_delta,
    hyper_connection,
    linear,
    moe,
    ngram,
    norm,
    qsa,
    rotary,
    table_gather,
    tuning,
    verified_layout,
)
from ._dispatch import HAS_TRITON, OpSettings, compiled_on_gpu, fast_path, settings, side_stream

__all__ = ["HAS_TRITON", "OpSettings", "compiled_on_gpu", "fast_path", "settings", "side_stream"]
