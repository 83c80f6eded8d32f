"""Indexed sparse attention (QSA): gated GQA whose queries attend only to the blocks a lightweight indexer picks.

The indexer projects each token to Hi query heads and one raw key. Raw keys are pooled over complete C-token
blocks (fp32 mean, rounded), normalised and rotated at the block's first position: one compressed key per block,
computed once when the block completes and kept in the cache. A query scores every visible block with
sum_h relu(q_h . k_b) / sqrt(Di), keeps the top budget/C blocks plus the incomplete tail, and the main attention is
restricted to those tokens. Short contexts (at most budget/C complete blocks) are exactly dense.

Split over ranks by query heads: each rank holds its query heads (with their gates), the key/value heads they read
(split when there are at least as many as ranks, else the one its query heads share, held by several ranks) and the
matching columns of o_proj, whose partial products meet in one all-reduce. The indexer is replicated: every rank
selects the same blocks.
"""

import torch
from torch import nn

from .. import distributed, ops
from ..config import ModelConfig
from .common import RMSNorm
from .merged_linear import Linear, MergedLinear
from .metadata import StepMetadata
from .state import AttentionCache


class QSAIndexer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.indexer_n_heads
        self.head_dim = config.indexer_head_dim
        self.budget = config.indexer_budget
        self.compress_ratio = config.indexer_compress_ratio
        self.q_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, qk, cos, sin, meta: StepMetadata, cache: AttentionCache, block_rope) -> torch.Tensor | None:
        """qk: index_qk_proj(x) [T, (Hi+1)*Di], a part of Attention.qkv_proj. Returns the selected logical token
        indices [T, budget + C - 1] (-1 padded), or None when every context is short enough for all of it to be
        selected (dense)."""
        q = qk[:, : self.n_heads * self.head_dim]  # the raw key, the rest, is already in the cache (Attention)
        norm = self.q_layernorm
        q = ops.rotary.norm_rope(q.reshape(-1, self.n_heads, self.head_dim), norm.weight, norm.eps, cos, sin)
        if meta.new_block_slots.numel():
            bcos, bsin = block_rope
            block_key = ops.qsa.pool_block_keys(
                meta.new_block_token_slots, cache.index_key.view(-1, self.head_dim), self.k_layernorm.weight,
                self.k_layernorm.eps, bcos, bsin)
            ops.attention.write_slots(cache.block_key, block_key, meta.new_block_slots)
        if meta.max_seq_len <= self.budget + self.compress_ratio - 1:
            return None  # at most budget/C complete blocks are visible: everything is selected
        return ops.qsa.qsa_select(q, cache.block_key, meta, self.budget, self.compress_ratio)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.head_dim = c.head_dim
        q0, q1 = distributed.split(c.num_attention_heads, "heads", "num_attention_heads")
        kv0, kv1 = kv_heads(c)
        self.num_heads, self.num_kv_heads = q1 - q0, kv1 - kv0  # this rank's
        self.scaling = self.head_dim**-0.5
        kv = self.num_kv_heads * self.head_dim
        parts = {"q_proj": self.num_heads * self.head_dim * 2, "k_proj": kv, "v_proj": kv}
        if config.qsa:
            parts["indexer.index_qk_proj"] = (c.indexer_n_heads + 1) * c.indexer_head_dim
        biased = ("q_proj", "k_proj", "v_proj") if c.attention_bias else ()
        self.reduce = distributed.world_size() > 1
        shards = {}
        if self.reduce:
            d = self.head_dim
            shards = {"q_proj": distributed.rows((2 * q0 * d, 2 * q1 * d)),
                      "k_proj": distributed.rows((kv0 * d, kv1 * d)), "v_proj": distributed.rows((kv0 * d, kv1 * d))}
        self.qkv_proj = MergedLinear(c.hidden_size, parts, bias_parts=biased, quantizable=True, shards=shards)
        self.o_proj = Linear(self.num_heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        # the bias joins the ranks' partial products once, on rank 0
        self.o_bias = distributed.rank() == 0
        if self.reduce:
            self.o_proj.checkpoint_shards = {"weight": distributed.columns(q0 * self.head_dim, q1 * self.head_dim)}
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.indexer = QSAIndexer(config) if config.qsa else None

    def forward(self, x, cos, sin, meta: StepMetadata, cache: AttentionCache, block_rope) -> torch.Tensor:
        T = x.shape[0]
        q, k, v, *index_qk = self.qkv_proj(x)
        # q_proj packs [q_h | gate_h] per head
        q, gate = q.reshape(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = ops.rotary.norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
        k = ops.rotary.norm_rope(k.reshape(T, self.num_kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps,
                                 cos, sin)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        writes = [(cache.key, k), (cache.value, v)]
        if self.indexer is not None:  # the indexer's raw key: the last head_dim columns of its projection
            writes.append((cache.index_key, index_qk[0][:, -self.indexer.head_dim:]))
        ops.attention.write_slots_many(writes, meta.slot_mapping)
        selected = self.indexer(index_qk[0], cos, sin, meta, cache, block_rope) if self.indexer is not None else None
        out = ops.attention.paged_attention(q, cache.key, cache.value, meta, self.scaling, selected)
        # gate as the [T, heads, D] view it is: reshaping it to [T, heads*D] first would copy it (100 MB at 8k tokens)
        out = ops.attention.gate_output(out.reshape(T, self.num_heads, self.head_dim), gate).reshape(T, -1)
        if not self.reduce:
            return ops.linear.output_linear(out, self.o_proj.weight, self.o_proj.bias, self.o_proj.weight_scale_inv)
        if self.o_proj.bias is None:
            out = ops.linear.output_linear(out, self.o_proj.weight, None, self.o_proj.weight_scale_inv)
        else:  # every rank's product in one form: the one with a bias (rank 0's) has no partial-products form
            out = ops.linear.linear(out, self.o_proj.weight, self.o_proj.bias if self.o_bias else None,
                                    self.o_proj.weight_scale_inv)
        return distributed.all_reduce(out)


def kv_heads(config: ModelConfig) -> tuple[int, int]:
    """The key/value heads [start, stop) this rank holds: its equal part, or with fewer heads than ranks the one
    head its query heads read (ranks r * kv // world_size share it)."""
    n, size = config.num_key_value_heads, distributed.world_size()
    if n >= size:
        return distributed.split(n, "heads", "num_key_value_heads")
    if size % n:
        from ..config import ConfigError

        raise ConfigError("tensor_parallel_size", f"{size} is not a multiple of num_key_value_heads ({n})")
    head = distributed.rank() * n // size
    return head, head + 1
