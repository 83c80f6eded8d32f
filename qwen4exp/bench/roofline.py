"""The HBM roofline of batch-1 decode: the bytes a step must read, the bandwidth the device reaches, their ratio."""

from __future__ import annotations

import statistics

import torch


def copy_bandwidth(device, nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy of `nbytes`, bytes read + written per second (median of `iters` after two warm-ups)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * nbytes / statistics.median_high(times[2:])


def decode_bytes(model, ctx_len: int) -> int:
    """Bytes a batch-1 decode step must read: every weight except the experts not routed to (top-k of E), one
    embedding row and the n-gram rows, plus the recurrent and conv states (read and written) and the attention
    context (the QSA selection's width when the model has one)."""
    c = model.config
    total = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            total += nbytes * c.num_experts_per_tok // c.num_experts
        elif "embed_tokens" in name and not c.tie_word_embeddings:
            total += p.shape[1] * p.element_size()
        elif "ngram_embedding" in name:
            total += c.ngram_heads * p.shape[1] * p.element_size()
        else:
            total += nbytes
    n_linear = c.layer_types.count("linear_attention")
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.gdn_conv_dim * (c.linear_conv_kernel_dim - 1) * 2
    total += 2 * n_linear * (state + conv)
    n_attention = c.num_hidden_layers - n_linear
    kv_per_token = 2 * c.num_key_value_heads * c.head_dim * 2
    attended = min(ctx_len, (c.indexer_budget + c.indexer_compress_ratio - 1) if c.qsa else ctx_len)
    total += n_attention * attended * kv_per_token
    return total


def roofline_fraction(step_bytes: int, bandwidth: float, step_seconds: float) -> float:
    """The share of the bandwidth-bound step time a measured step reaches: (bytes / bandwidth) / step time."""
    return step_bytes / bandwidth / step_seconds
