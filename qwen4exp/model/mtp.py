"""Multi-token prediction (MTP): the checkpoint's draft layer, which predicts the token after next for speculative
decoding.

For row t of a step, given the multi-stream state S_t [hc*H] that the target's final mixer read at t and the token
x_{t+1} that follows it:

    e        = fc_embedding(pre_fc_norm_embedding(embed_tokens(x_{t+1})))                      [H]
    streams  = fc_hidden(pre_fc_norm_hidden(S_t)_s) + e, for every stream s                     [hc*H]
    streams  = decoder layer (indexed attention and MoE with hyper-connections, no PLE)
    S'_t, h  = hyper_connection_mixer(streams)       (the streams it read, and their mix)     [hc*H], [H]
    logits   = lm_head(h), the model's lm_head: the distribution of x_{t+2}

pre_fc_norm_hidden normalises all hc*H values of a row together (the hyper-connection norms normalise each stream on
its own); fc_hidden is one H -> H projection applied to each stream. There is no final norm: the mixer's norm is it.
`embed_tokens`, `lm_head` and the rotary embedding are the model's. Checkpoint tensors: `mtp.fc_embedding`,
`mtp.fc_hidden`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.{i}.*` (a decoder layer's
names) and `mtp.hyper_connection_mixer.*`.

Drafting with it (`Qwen4ExpForCausalLM` built with mtp=True, e.g. `weights.loader.load_model(..., mtp=True)`):
- the cache: `allocate_cache(..., mtp=True)` appends an attention cache per MTP layer, `cache.layers[
  num_hidden_layers + i]`, on the target's pages (`page_bytes(..., mtp=True)` and `num_attention_layers` count
  them): a request's page ids and block table index the draft layer's cache too.
- the target step: `hidden, streams = model(meta, cache, return_streams=True)`; streams is [T, hc*H], every row.
- draft step 0, after every target step that writes the caches (prefill chunks included, so that the draft layer's
  cache holds every position): `h, s = model.draft(meta0, cache, streams)`. meta0 is the target step's metadata
  with input_ids shifted by one within each request: row t gets the token at position t+1, which is the prompt's
  next token, or the token sampled (accepted) after row t. Positions, slot mapping, block tables and QSA block
  rows stay the target's: the draft layer's cache row of position t holds (S_t, x_{t+1}). Rows after a request's
  last accepted one may be left out (with their streams rows), or computed with whatever token the verification
  emitted there (the engine does, to queue this step before the host knows which rows are kept): their positions
  are computed again before any query reads them. Draft token 1 is sampled from
  `model.compute_logits(h[each request's last kept row])`.
- draft step j >= 1: one row per request at the next position, input_ids the previous draft token, streams the
  previous step's `s` at that request's row: `model.draft(meta_j, cache, s_rows, step=j)`, which runs MTP layer
  j % mtp_num_hidden_layers.
Rejected drafts need no rollback here: their cache rows are rewritten when their positions are drafted again, as
the target's attention rows are. Without mtp=True none of this is built or run: the model, its cache and its CUDA
graphs are unchanged (the graphs do not capture `return_streams`).
"""

import torch
from torch import nn

from ..config import INDEXED, ModelConfig
from .common import RMSNorm, RotaryEmbedding
from .hyper_connection import GatedResidual
from .merged_linear import Linear
from .metadata import StepMetadata
from .model import DecoderLayer
from .state import AttentionCache


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        config.check_mtp()
        self.hc_count, self.hidden_size = config.hc_count, config.hidden_size
        self.qsa = config.qsa
        h = config.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(config.hc_count * h, config.rms_norm_eps)  # all streams together
        self.fc_embedding = Linear(h, h)
        self.fc_hidden = Linear(h, h)
        self.layers = nn.ModuleList(DecoderLayer(config, config.num_hidden_layers + i, layer_type=INDEXED)
                                    for i in range(config.mtp_num_hidden_layers))
        self.hyper_connection_mixer = GatedResidual(config, use_combine=False)

    def forward(self, streams: torch.Tensor, meta: StepMetadata, cache: AttentionCache, layer: int,
                embed_tokens: nn.Embedding, rotary_emb: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """streams: [T, hc*H], each row's multi-stream state; meta.input_ids: each row's next token; cache: MTP layer
        `layer`'s. Returns (hidden [T, H] for lm_head, streams [T, hc*H] for the next draft step)."""
        T, hc, H = streams.shape[0], self.hc_count, self.hidden_size
        e = self.fc_embedding(self.pre_fc_norm_embedding(embed_tokens(meta.input_ids)))
        h = self.fc_hidden(self.pre_fc_norm_hidden(streams).view(T * hc, H)).view(T, hc, H)
        streams = (h + e[:, None]).view(T, hc * H)
        cos, sin = rotary_emb(meta.positions, e.dtype)
        block_rope = rotary_emb(meta.new_block_positions, e.dtype) if self.qsa else None
        streams, pending = self.layers[layer](streams, None, meta, cos, sin, cache, None, None, block_rope)
        streams, hidden, _ = self.hyper_connection_mixer(streams, *pending)
        return hidden, streams
