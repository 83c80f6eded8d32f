"""PLE: hashed n-gram per-layer embeddings injected into every hyper-connection stream.

Each token's n-grams (orders 2..N, ending at the token, restarting after EOS) are hashed by `heads_per_ngram`
multiply-xor heads into prime-sized slices of one table; the concatenated rows give a key per stream and one shared
value. The normalised streams gate the value (signed-sqrt dot product), and a dilated causal depthwise conv over
the normalised gated values adds local context. The layer returns the residual update [T, hc*H].

Over several ranks the layer is replicated. Its n-gram table is too, unless `--ple-table-parallel rows` splits each
table's rows into equal ranges, one per rank: a rank gathers the rows it holds (zeros for the others) and one
all-reduce joins them.
"""

import math

import torch
from torch import nn

from .. import distributed, ops
from ..config import ModelConfig
from .common import RMSNorm
from .merged_linear import MergedLinear
from .metadata import StepMetadata

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd hash multipliers below (2^63-1)/vocab, so token * multiplier never overflows for in-vocab tokens."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _PRIME * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_table_sizes(base: int, first_head: int, num_heads: int) -> list[int]:
    """Sizes of heads first_head .. first_head+num_heads-1, where global head i gets the (i+1)-th prime >= base."""
    sizes, p, i = [], base - 1, 0
    while len(sizes) < num_heads:
        p += 1
        while not _is_prime(p):
            p += 1
        if i >= first_head:
            sizes.append(p)
        i += 1
    return sizes


class NGramEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, ple_index: int):
        super().__init__()
        self.heads_per_ngram = config.heads_per_ngram
        self.embed_dim = config.ple_embed_dim
        heads = config.ngram_heads
        sizes = head_table_sizes(config.ngram_vocab_size_base, ple_index * heads, heads)
        offsets = [sum(sizes[:i]) for i in range(heads)]
        divisor = config.make_ngram_vocab_size_divisible_by
        self.num_rows = sum(sizes)
        padded = -(-self.num_rows // divisor) * divisor
        mult = layer_multipliers(config.vocab_size, config.ngram_size, ple_index, config.seed)
        self.register_buffer("layer_multipliers", torch.tensor(mult, dtype=torch.long, device="cpu"), persistent=False)
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long, device="cpu"),
                             persistent=False)
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets, dtype=torch.long, device="cpu"),
                             persistent=False)
        # this rank's rows [start, stop) of the table (all of them unless split over ranks)
        self.row_range = (0, padded)
        if distributed.world_size() > 1 and distributed.state().ple_table_rows:
            self.row_range = distributed.split(padded, "rows", "the n-gram table's rows")
        self.split_rows = self.row_range != (0, padded)
        # The table may live in host memory and be float8 (weights/ngram_table.py); its rows are multiplied by
        # `weight_scale` (1 unless quantised) when gathered.
        self.ngram_embedding = nn.Embedding(self.row_range[1] - self.row_range[0], config.ple_embed_dim // heads)
        self.ngram_embedding.register_buffer("weight_scale", torch.ones((), device="cpu"), persistent=False)

    def ids(self, shifted: torch.Tensor) -> torch.Tensor:
        """shifted: [T, N] tokens t, t-1, .. (EOS-reset) -> [T, heads] row ids."""
        return ops.ngram.ngram_ids(
            shifted, self.layer_multipliers, self.ngram_heads_vocab_sizes, self.ngram_heads_offsets,
            self.heads_per_ngram,
        )

    def rows(self, ids: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenated head rows [T, ple_embed_dim] for ids [T, heads], dequantised to `dtype`. A table split over
        ranks gives the rows this rank holds and zeros for the others (`join` sums the ranks' parts)."""
        table = self.ngram_embedding
        if not self.split_rows:
            return ops.table_gather.gather_rows(table.weight, ids, table.weight_scale, dtype, out)
        local = ids - self.row_range[0]
        here = (local >= 0) & (local < table.weight.shape[0])
        rows = ops.table_gather.gather_rows(table.weight, torch.where(here, local, torch.zeros_like(local)),
                                            table.weight_scale, dtype, out)
        rows.view(ids.shape[0], ids.shape[1], -1).mul_(here.unsqueeze(-1))
        return rows

    def join(self, rows: torch.Tensor) -> torch.Tensor:
        """The whole rows from every rank's part (`rows`), on the stream that reads them."""
        return distributed.all_reduce(rows) if self.split_rows else rows


class NGramPrefetch:
    """Every PLE layer's table rows, requested at the start of a step.

    The n-gram ids depend on token ids only, so hashing and gathering for all PLE layers is issued before the first
    decoder layer runs. On a GPU this happens on a side stream, so reading rows from a host-resident table over
    PCIe overlaps the layers before the PLE layer; `rows(layer)` makes the compute stream wait for them. The fork
    and join are stream waits, which CUDA graphs capture.
    """

    def __init__(self, embeddings: dict[int, NGramEmbedding], shifted: torch.Tensor, dtype: torch.dtype):
        self._joined = True
        self._embeddings = embeddings
        if not shifted.is_cuda:
            self._rows = {i: e.rows(e.ids(shifted), dtype) for i, e in embeddings.items()}
            return
        main = torch.cuda.current_stream(shifted.device)
        side = ops.side_stream(shifted.device, "ngram_prefetch")
        # outputs belong to the compute stream, which reads them only after joining the side stream
        self._rows = {i: torch.empty(shifted.shape[0], e.embed_dim,
                                     dtype=dtype, device=shifted.device) for i, e in embeddings.items()}
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for i, e in embeddings.items():
                e.rows(e.ids(shifted), dtype, out=self._rows[i])
        self._side, self._joined = side, False

    def rows(self, layer: int) -> torch.Tensor:
        if not self._joined:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._joined = True
        return self._embeddings[layer].join(self._rows[layer])


class PLELayer(nn.Module):
    def __init__(self, config: ModelConfig, ple_index: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.hc_count = config.hc_count
        width = self.hidden_size * self.hc_count
        eps = config.rms_norm_eps
        self.ple_embedding = NGramEmbedding(config, ple_index)
        self.key_value_proj = MergedLinear(config.ple_embed_dim, {"key_proj": width, "value_proj": self.hidden_size},
                                           quantizable=True)
        self.norm_key = RMSNorm(width, eps, group_size=self.hidden_size)
        self.norm_query = RMSNorm(width, eps, group_size=self.hidden_size)
        self.norm_conv = RMSNorm(width, eps, group_size=self.hidden_size)
        self.dilation = config.ngram_size
        self.conv1d = nn.Conv1d(
            width, width, config.ple_conv_kernel_size, groups=width, dilation=self.dilation, bias=False
        )

    def forward(
        self, streams: torch.Tensor, emb: torch.Tensor, meta: StepMetadata, conv_state: torch.Tensor
    ) -> torch.Tensor:
        """emb: this layer's n-gram rows [T, ple_embed_dim] in the streams' dtype (NGramPrefetch)."""
        key, value = self.key_value_proj(emb)
        gated = ops.ngram.ple_gate(self.norm_query(streams), self.norm_key(key), value, self.hidden_size)
        conv = ops.conv.causal_conv1d(self.norm_conv(gated), self.conv1d.weight[:, 0, :], conv_state, meta,
                                      dilation=self.dilation)
        return gated + conv
