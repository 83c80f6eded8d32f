"""Per-layer cache tensors the model reads and writes. The engine sizes and owns them (engine/cache.py).

Attention layers: paged K/V plus QSA's raw indexer keys and compressed block keys (see ops/attention.py).
GDN layers: one state slot per running request, conv window [conv_dim, K-1] in the model dtype and the recurrent
state [Hv, Dk, Dv] in fp32. PLE layers: a conv window [hc*H, (K-1)*ngram_size] per slot. Slot 0 is the null slot.
"""

from dataclasses import dataclass

import torch

from ..config import INDEXED, ModelConfig


@dataclass
class AttentionCache:
    key: torch.Tensor
    value: torch.Tensor
    index_key: torch.Tensor | None
    block_key: torch.Tensor | None


@dataclass
class GDNState:
    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass
class ModelCache:
    layers: list  # AttentionCache | GDNState per decoder layer
    ple: dict[int, torch.Tensor]  # layer index -> PLE conv windows [S, hc*H, L]


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page across all attention layers."""
    esize = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * config.num_key_value_heads * config.head_dim
    if config.qsa:
        per_token += config.indexer_head_dim * (1 + 1 / config.indexer_compress_ratio)
    return int(per_token * page_size * esize) * config.layer_types.count(INDEXED)


def slot_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one state slot across all GDN and PLE layers."""
    esize = torch.tensor([], dtype=dtype).element_size()
    c = config
    gdn = c.gdn_conv_dim * (c.linear_conv_kernel_dim - 1) * esize
    gdn += c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    ple = c.hc_count * c.hidden_size * c.ple_conv_state_len * esize
    return gdn * (c.num_hidden_layers - c.layer_types.count(INDEXED)) + ple * len(c.ple_layer_ids)


def allocate_cache(
    config: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype, device
) -> ModelCache:
    c = config
    layers = []
    for layer_type in c.layer_types:
        if layer_type == INDEXED:
            kv = (num_pages, page_size, c.num_key_value_heads, c.head_dim)
            index_key = block_key = None
            if c.qsa:
                index_key = torch.zeros(num_pages, page_size, c.indexer_head_dim, dtype=dtype, device=device)
                block_key = torch.zeros(
                    num_pages, page_size // c.indexer_compress_ratio, c.indexer_head_dim, dtype=dtype, device=device
                )
            layers.append(
                AttentionCache(
                    torch.zeros(kv, dtype=dtype, device=device), torch.zeros(kv, dtype=dtype, device=device),
                    index_key, block_key,
                )
            )
        else:
            conv = torch.zeros(num_slots, c.gdn_conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
            ssm = torch.zeros(
                num_slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                dtype=torch.float32, device=device,
            )
            layers.append(GDNState(conv, ssm))
    ple = {
        i - 1: torch.zeros(num_slots, c.hc_count * c.hidden_size, c.ple_conv_state_len, dtype=dtype, device=device)
        for i in c.ple_layer_ids
    }
    return ModelCache(layers, ple)
