"""Random values for every parameter, shared by `load_format="dummy"` and `make-random` checkpoints.

Every tensor gets non-trivial values (norm weights and conv kernels included, unlike a training init that zeroes
them) so that parity tests notice any component that is computed wrongly. Scales keep activations O(1).
"""

from __future__ import annotations

import math

import torch

from ..ops.fp8 import BLOCK, quantize_weight


def fill_(name: str, t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill `t`, checkpoint tensor `name` (e.g. model.layers.0.linear_attn.A_log), in place and return it."""
    g = generator
    work = (t if t.dtype in (torch.float32, torch.float64)
            else torch.empty(t.shape, dtype=torch.float32, device=t.device))
    leaf = name.rsplit(".", 1)[-1]
    if "visual." in name:  # the vision tower: LayerNorms near 1, projections by fan-in
        if "norm" in name and leaf == "weight":
            work.normal_(1.0, 0.1, generator=g)
        elif leaf == "bias" or "pos_embed" in name:
            work.normal_(0.0, 0.1 if leaf == "bias" else 0.5, generator=g)
        else:
            work.normal_(0.0, 1.0 / math.sqrt(t[0].numel()), generator=g)
    elif leaf == "A_log":
        work.uniform_(0.5, 8.0, generator=g).log_()
    elif leaf == "dt_bias":
        work.normal_(1.0, 0.1, generator=g)
    elif "linear_attn.norm." in name:  # gated norm, weight applied as-is
        work.normal_(1.0, 0.1, generator=g)
    elif "norm" in name.rsplit(".", 2)[-2] or "layernorm" in name:  # zero-centred norms, applied as 1 + w
        work.normal_(0.0, 0.1, generator=g)
    elif "conv1d" in name:
        work.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=g)
    elif name.endswith("embed_tokens.weight") or "ngram_embedding" in name:
        work.normal_(0.0, 1.0, generator=g)
    elif name.endswith("experts.down_proj") or name.endswith("experts.gate_up_proj"):
        work.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=g)
    elif name.endswith("lm_head.weight"):
        work.normal_(0.0, 4.0 / math.sqrt(t.shape[-1]), generator=g)
    else:  # linear layers [out, in]
        work.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=g)
    if work is not t:
        t.copy_(work)
    return t


def fill_fp8_(name: str, weight: torch.Tensor, scale: torch.Tensor, generator: torch.Generator | None = None,
              chunk_elements: int = 1 << 24) -> None:
    """Random values for a block-scaled fp8 weight (`ops.fp8`), checkpoint tensor `name`: weight [..., N, K] (a
    stacked experts' [E, N, K], or one matrix) is drawn by `fill_`'s rule for `name` and quantized a chunk of
    whole 128-row blocks at a time straight into it and its block scales `scale` [..., ceil(N/128), ceil(K/128)], so
    no wider copy of the whole tensor is ever held."""
    w3 = weight if weight.dim() == 3 else weight.unsqueeze(0)
    s3 = scale if scale.dim() == 3 else scale.unsqueeze(0)
    experts, n, k = w3.shape
    rows = min(n, max(BLOCK, chunk_elements // k // BLOCK * BLOCK))
    per = max(1, chunk_elements // (rows * k)) if rows == n else 1
    for e in range(0, experts, per):
        for r in range(0, n, rows):
            values = torch.empty(min(per, experts - e), min(rows, n - r), k, device=weight.device)
            wq, s = quantize_weight(fill_(name, values, generator))
            w3[e:e + per, r:r + rows].copy_(wq)
            s3[e:e + per, r // BLOCK:r // BLOCK + s.shape[-2]].copy_(s)
