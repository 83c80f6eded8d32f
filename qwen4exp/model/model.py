"""Qwen4-Exp text model over a flat token batch.

Parameter names equal the checkpoint's, except that experts are stacked (`mlp.experts.gate_up_proj`, as transformers
stacks them, with `gate_up_proj_scale_inv` when fp8) and that projections of one input are parts of a `MergedLinear`
(`model.merged_linear.named_checkpoint_tensors` lists every parameter under its checkpoint names). The projections
and experts may hold block-scaled fp8 weights (`model.merged_linear.use_fp8_`)."""

import torch
from torch import nn

from .. import distributed, ops
from ..config import LINEAR, ModelConfig
from .attention import Attention
from .common import RotaryEmbedding
from .gdn import GatedDeltaNet
from .hyper_connection import GatedResidual, combine
from .metadata import StepMetadata
from .moe import SparseMoeBlock
from .ple import NGramPrefetch, PLELayer
from .state import ModelCache


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, layer_type: str | None = None):
        """layer_type: config.layer_types[layer_idx] unless given (an MTP layer, layer_idx >= num_hidden_layers,
        which never has PLE: ple_layer_ids name decoder layers only)."""
        super().__init__()
        self.layer_type = layer_type or config.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Attention(config)
        self.mlp = SparseMoeBlock(config)
        ple_index = config.ple_index(layer_idx)
        self.ple = PLELayer(config, ple_index) if ple_index is not None else None
        self.attn_hyper_connection = GatedResidual(config)
        self.mlp_hyper_connection = GatedResidual(config)

    def forward(self, streams, pending, meta: StepMetadata, cos, sin, cache, ple_state, ple_rows, block_rope):
        """pending: (the previous layer's MoE output, its injection weights), not yet added to the streams; this
        layer's first mix adds it. Returns the streams and this layer's pending MoE output."""
        if self.ple is not None:
            if pending is not None:
                streams, pending = combine(streams, *pending), None
            streams = streams + self.ple(streams, ple_rows, meta, ple_state)

        streams, x, inject = self.attn_hyper_connection(streams, *(pending or ()))
        if self.layer_type == LINEAR:
            y = self.linear_attn(x, meta, cache)
        else:
            y = self.self_attn(x, cos, sin, meta, cache, block_rope)

        # y is the block output or, at decode sizes on the GPU, fp32 partial products of it (ops.linear.output_linear)
        # that the mix's combine sums
        streams, x, inject = self.mlp_hyper_connection(streams, y, inject)
        return streams, (self.mlp(x), inject)


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding; over several ranks each holds an equal range of the vocabulary's rows, looks up the
    tokens in it (zeros for the others) and one all-reduce joins them."""

    def __init__(self, vocab_size: int, hidden_size: int):
        start, stop = distributed.split(vocab_size, "rows", "vocab_size")
        super().__init__(stop - start, hidden_size)
        self.vocab_range = (start, stop)
        self.split = distributed.world_size() > 1
        if self.split:
            self.checkpoint_shards = {"weight": distributed.rows(self.vocab_range)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return super().forward(ids)
        local = ids - self.vocab_range[0]
        here = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(torch.where(here, local, torch.zeros_like(local))) * here.unsqueeze(-1)
        return distributed.all_reduce(x)


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)
        self.hyper_connection_mixer = GatedResidual(config, use_combine=False)

    def forward(self, meta: StepMetadata, cache: ModelCache,
                return_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        x = self.embed_tokens(meta.input_ids)
        if meta.mm_rows is not None:  # image tokens take the vision tower's features in place of their embedding
            x = x.index_copy(0, meta.mm_rows, meta.mm_features.to(x.dtype))
        cos, sin = self.rotary_emb(meta.positions, x.dtype)
        prefetch = None
        if c.ple_layer_ids:  # every PLE layer's rows are requested now, ahead of the layers that use them
            shifted = ops.ngram.shifted_tokens(meta, c.eos_token_id, c.ngram_size)
            ple = {i: layer.ple.ple_embedding for i, layer in enumerate(self.layers) if layer.ple is not None}
            prefetch = NGramPrefetch(ple, shifted, x.dtype)
        # rotation of the QSA blocks completed in this step, shared by every indexed layer
        block_rope = self.rotary_emb(meta.new_block_positions, x.dtype) if c.qsa else None
        streams = x.repeat(1, c.hc_count)
        pending = None
        for i, layer in enumerate(self.layers):
            rows = prefetch.rows(i) if layer.ple is not None else None
            streams, pending = layer(streams, pending, meta, cos, sin, cache.layers[i], cache.ple.get(i), rows,
                                     block_rope)
        streams, hidden, _ = self.hyper_connection_mixer(streams, *(pending or ()))
        return (hidden, streams) if return_streams else hidden


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, mtp: bool = False):
        """mtp: also build the checkpoint's MTP draft layers (`model.mtp`, see model/mtp.py)."""
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        # over several ranks each holds the vocabulary rows of its embedding range; the logits are gathered
        vocab = self.model.embed_tokens.vocab_range
        self.lm_head = nn.Linear(config.hidden_size, vocab[1] - vocab[0], bias=False)
        self.gather_logits = distributed.world_size() > 1
        if self.gather_logits:
            self.lm_head.checkpoint_shards = {"weight": distributed.rows(vocab)}
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if config.vision is not None:  # the checkpoint's `model.visual.*`
            from .vision import VisionModel

            self.model.visual = VisionModel(config.vision)
        self.mtp = None
        if mtp:
            from .mtp import MultiTokenPredictor  # built from this module's DecoderLayer

            self.mtp = MultiTokenPredictor(config)

    def forward(self, meta: StepMetadata, cache: ModelCache,
                return_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns the final hidden states [T, H] of every new token; with `return_streams`, also the multi-stream
        state the final mixer read, [T, hc*H] (the MTP layer's input; a tensor the mixer computes anyway)."""
        return self.model(meta, cache, return_streams)

    def draft(self, meta: StepMetadata, cache: ModelCache, streams: torch.Tensor,
              step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP draft step (model/mtp.py): meta.input_ids are each row's next token, `streams` [T, hc*H] the
        multi-stream state of each row (the target's, or the previous draft step's). Runs MTP layer
        step % mtp_num_hidden_layers on its cache, `cache.layers[num_hidden_layers + that layer]`.
        Returns (hidden [T, H] for compute_logits, streams [T, hc*H] for the next draft step)."""
        if self.mtp is None:
            raise RuntimeError("draft: the model was built without its MTP layers (mtp=True)")
        layer = step % len(self.mtp.layers)
        return self.mtp(streams, meta, cache.layers[self.config.num_hidden_layers + layer], layer,
                        self.model.embed_tokens, self.model.rotary_emb)

    @property
    def visual(self):
        """The vision tower (model/vision.py), or None for a text-only checkpoint."""
        return getattr(self.model, "visual", None)

    def encode_images(self, items: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """The feature rows [t*h*w / merge^2, hidden] of each (pixel_values, grid_thw), in one tower pass."""
        visual = self.visual
        device = self.lm_head.weight.device
        pixels = torch.cat([p for p, _ in items]).to(device, visual.dtype)
        grids = [g for _, g in items]
        features = visual(pixels, grids)
        merge2 = visual.config.spatial_merge_size ** 2
        return list(torch.split(features, [t * h * w // merge2 for t, h, w in grids]))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, vocab] in fp32 (transformers rounds them to the model's dtype; see
        ops.linear.fp32_out_linear for why we do not)."""
        logits = ops.linear.fp32_out_linear(hidden, self.lm_head.weight)
        return distributed.all_gather(logits) if self.gather_logits else logits
