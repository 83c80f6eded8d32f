"""Per-layer cache tensors the model reads and writes. The engine sizes and owns them (engine/cache.py).

Attention layers: paged K/V plus QSA's raw indexer keys and compressed block keys (see ops/attention.py).
GDN layers: one state slot per running request, conv window [conv_dim, K-1] in the model dtype and the recurrent
state [Hv, Dk, Dv] in fp32 (or `ssm_dtype`: EngineConfig.mamba_ssm_cache_dtype). PLE layers: a conv window
[hc*H, (K-1)*ngram_size] per slot. Slot 0 is the null slot.
With `mtp`, the MTP draft layers' attention caches follow the decoder layers' (`ModelCache.layers[num_hidden_layers
+ i]`), on the same pages: a request's page ids index every attention layer's cache, the draft layers' included.
Over several ranks each holds the caches of its heads (`rank_heads`): its key/value heads, its GDN heads.
"""

from dataclasses import dataclass

import torch

from .. import distributed
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
    layers: list  # AttentionCache | GDNState per decoder layer, then an AttentionCache per MTP layer (with mtp)
    ple: dict[int, torch.Tensor]  # layer index -> PLE conv windows [S, hc*H, L]


@dataclass(frozen=True)
class RankHeads:
    kv_heads: int
    gdn_conv_dim: int
    gdn_value_heads: int


def rank_heads(config: ModelConfig) -> RankHeads:
    """The heads whose caches this rank holds (all of them in a single process)."""
    c = config
    if distributed.world_size() == 1:
        return RankHeads(c.num_key_value_heads, c.gdn_conv_dim, c.linear_num_value_heads)
    from .attention import kv_heads

    kv0, kv1 = kv_heads(c)
    size = distributed.world_size()
    conv = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.gdn_value_dim) // size
    return RankHeads(kv1 - kv0, conv, c.linear_num_value_heads // size)


def num_attention_layers(config: ModelConfig, mtp: bool = False) -> int:
    """The attention layers whose caches live in pages: the indexed decoder layers, and with `mtp` the MTP layers."""
    return config.layer_types.count(INDEXED) + (config.mtp_num_hidden_layers if mtp else 0)


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype, mtp: bool = False) -> int:
    """Bytes of one page across all attention layers (the MTP layers' included with `mtp`)."""
    esize = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * rank_heads(config).kv_heads * config.head_dim
    if config.qsa:
        per_token += config.indexer_head_dim * (1 + 1 / config.indexer_compress_ratio)
    return int(per_token * page_size * esize) * num_attention_layers(config, mtp)


def slot_bytes(config: ModelConfig, dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one state slot across all GDN and PLE layers."""
    esize = torch.tensor([], dtype=dtype).element_size()
    c, heads = config, rank_heads(config)
    gdn = heads.gdn_conv_dim * (c.linear_conv_kernel_dim - 1) * esize
    gdn += heads.gdn_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * ssm_dtype.itemsize
    ple = c.hc_count * c.hidden_size * c.ple_conv_state_len * esize
    return gdn * (c.num_hidden_layers - c.layer_types.count(INDEXED)) + ple * len(c.ple_layer_ids)


def allocate_cache(
    config: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype, device, mtp: bool = False,
    ssm_dtype: torch.dtype = torch.float32,
) -> ModelCache:
    """Every layer's cache tensors, the GDN recurrent states in `ssm_dtype`; with `mtp`, an attention cache per MTP
    layer after the decoder layers'."""
    c, heads = config, rank_heads(config)

    def attention() -> AttentionCache:
        kv = (num_pages, page_size, heads.kv_heads, c.head_dim)
        index_key = block_key = None
        if c.qsa:
            index_key = torch.zeros(num_pages, page_size, c.indexer_head_dim, dtype=dtype, device=device)
            block_key = torch.zeros(
                num_pages, page_size // c.indexer_compress_ratio, c.indexer_head_dim, dtype=dtype, device=device
            )
        return AttentionCache(
            torch.zeros(kv, dtype=dtype, device=device), torch.zeros(kv, dtype=dtype, device=device), index_key,
            block_key,
        )

    layers = []
    for layer_type in c.layer_types:
        if layer_type == INDEXED:
            layers.append(attention())
        else:
            conv = torch.zeros(num_slots, heads.gdn_conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype,
                               device=device)
            ssm = torch.zeros(
                num_slots, heads.gdn_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                dtype=ssm_dtype, device=device,
            )
            layers.append(GDNState(conv, ssm))
    if mtp:
        layers += [attention() for _ in range(c.mtp_num_hidden_layers)]
    ple = {
        i - 1: torch.zeros(num_slots, c.hc_count * c.hidden_size, c.ple_conv_state_len, dtype=dtype, device=device)
        for i in c.ple_layer_ids
    }
    return ModelCache(layers, ple)


def copy_slots(cache: ModelCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies every GDN and PLE state of slots `src` to slots `dst` (int64 device tensors, distinct destinations) on
    the device, without a host synchronisation."""
    tensors = [t for layer in cache.layers if isinstance(layer, GDNState) for t in (layer.conv, layer.ssm)]
    for t in tensors + list(cache.ple.values()):
        t.index_copy_(0, dst, t.index_select(0, src))
