"""A briefly trained `small` model, for the GPU-vs-CPU agreement check on a model whose predictions carry information.

With random weights the next-token distributions are nearly uniform (median top-1 probability ~0.04 on `small`), so
bf16 rounding flips the argmax at the many near-ties and an agreement figure would measure the ties, not the engine.
Here transformers' Qwen4ExpForCausalLM (the numerics reference) is trained on the Python standard library's source
files of the machine it runs on, tokenized with the repository's byte-level BPE; the suite's `agree_trained` stage
(qwen4exp.bench.agreement) then measures agreement on files held out of training.

transformers has no MTP layer, so the model is given one (`MTPHead`, transformers' modules composed as model/mtp.py
describes) trained beside it on the token after next; its parameters are the checkpoint's `mtp.*` tensors, so the
trained model's state dict is a checkpoint with a trained draft layer (`load_model(..., mtp=True)` reads it).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import math
import os
import random
import sys
import sysconfig
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

# the MTP loss's weight beside the next-token loss (DeepSeek-V3 trains its MTP module with 0.3, then 0.1)
MTP_LOSS_WEIGHT = 0.3


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = sorted(s for s in subdirs if s not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    return files


def load_tokenizer():
    """The repository's byte-level BPE (the one make-random writes), and the id of its end-of-sequence token."""
    from tokenizers import Tokenizer

    from ..weights.tokenizer import build_tokenizer

    d = tempfile.mkdtemp()
    ids = build_tokenizer(d)
    return Tokenizer.from_file(os.path.join(d, "tokenizer.json")), ids["<|im_end|>"]


def token_streams(tok, eos: int, max_chars: int = 12_000_000, eval_every: int = 10) -> tuple[list[int], list[int]]:
    """(train, held-out) token streams: every eval_every-th file (in sorted order) is held out; files are separated
    by EOS, as documents in a training mix are."""
    texts = {True: [], False: []}
    chars = 0
    for i, path in enumerate(stdlib_files()):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        texts[i % eval_every == 0].append(text)
        chars += len(text)
        if chars >= max_chars:
            break
    train, held = ([t for e in tok.encode_batch(texts[h]) for t in e.ids + [eos]] for h in (False, True))
    return train, held


def hf_small_config(eos: int, dtype: str = "float32"):
    from transformers import Qwen4ExpTextConfig

    from ..weights.random_checkpoint import preset_config

    d = preset_config("small", eos_token_id=eos, dtype=dtype)
    return Qwen4ExpTextConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})


@contextlib.contextmanager
def _transformers_without_fla():
    """transformers picks fla's chunk kernel at import when fla imports; fla-core 0.6.0's backward refuses Triton
    3.4-3.7.0 on Hopper (wrong results, its issue #640), so for training the torch path must be taken. fla is hidden
    while transformers' module is (re)imported and the model built, and visible again afterwards (the engine's GPU
    prefill uses fla's forward, which is correct)."""
    name = "transformers.models.qwen4_exp.modeling_qwen4_exp"
    saved = {k: sys.modules[k] for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None  # `import fla` raises ImportError; find_spec returns None
    try:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        yield importlib.import_module(name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


def _batched_qsa_selection(indexer, hidden_states, position_embeddings, *_, **__):
    """transformers' QSA indexer selection (`Qwen4ExpTextQSAIndexer.forward`: per query, the top blocks of
    compress_ratio tokens by relu(q . block key) summed over index heads, plus the tail of the incomplete block) for
    a causal batch without padding or cache, computed for all queries at once: the reference loops over batch x
    query positions in Python (~20 launches each, ~30 s a training step of 32 x 512 tokens on an H200). Ties between
    block scores (relu zeros) may select other blocks than the loop's topk; training does not care."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling

    B, T, _ = hidden_states.shape
    C, D = indexer.compress_ratio, indexer.index_head_dim
    full_cos, full_sin = position_embeddings
    qk = indexer.index_qk_proj(hidden_states)
    q, raw_keys = torch.split(qk, [indexer.index_n_heads * D, indexer.index_kv_heads * D], dim=-1)
    q = indexer.q_layernorm(q.reshape(B, T, -1, D))
    q = modeling.apply_rotary_pos_emb(q, cos=full_cos[:, -T:], sin=full_sin[:, -T:], unsqueeze_dim=2)
    nb = T // C
    blocks = raw_keys[:, :nb * C].reshape(B, nb, C, D).float().mean(2).to(raw_keys.dtype)
    starts = torch.arange(nb, device=q.device) * C
    block_keys = modeling.apply_rotary_pos_emb(
        indexer.k_layernorm(blocks).unsqueeze(2), cos=full_cos[:, starts], sin=full_sin[:, starts],
        unsqueeze_dim=2).squeeze(2)
    scores = torch.relu(torch.einsum("bthd,bnd->btnh", q.float(), block_keys.float())).sum(-1) / math.sqrt(D)
    pos = torch.arange(T, device=q.device)
    complete = (pos + 1) // C  # complete blocks visible to each query
    valid = torch.arange(nb, device=q.device)[None, :] < complete[:, None]  # [T, nb]
    scores = scores.masked_fill(~valid, float("-inf"))
    top = scores.topk(min(indexer.block_topk, nb), dim=-1).indices  # [B, T, k]
    chosen = torch.zeros(B, T, nb, dtype=torch.bool, device=q.device).scatter_(-1, top, True) & valid
    token_block = (pos // C).clamp_max(max(nb - 1, 0))
    in_blocks = chosen[:, :, token_block] & (pos[None, :] < complete[:, None] * C)[None]  # [B, T(query), T(key)]
    tail = (pos[None, :] >= complete[:, None] * C) & (pos[None, :] <= pos[:, None])
    return (in_blocks | tail[None]).unsqueeze(1)


def check_batched_selection(model, ids: torch.Tensor, log=print) -> float:
    """The fraction of query rows where `_batched_qsa_selection` selects other keys than the model's own indexer (its
    per-query loop) on `ids` [1, T]; raises above 5% (score ties explain a few rows, a different rule most)."""
    indexer = next(m for m in model.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer")
    seen = {}
    original = indexer.forward

    def spy(*args, **kwargs):
        seen["args"], seen["mask"] = (args, kwargs), original(*args, **kwargs)
        return seen["mask"]

    indexer.forward = spy
    try:
        with torch.no_grad():
            model(input_ids=ids)
            args, kwargs = seen["args"]
            ours = _batched_qsa_selection(indexer, *args, **kwargs)
    finally:
        del indexer.forward
    differ = float((ours != seen["mask"]).any(-1).float().mean())
    log(f"train: the batched QSA selection differs from transformers' at {differ:.1%} of query rows")
    if differ > 0.05:
        raise RuntimeError(f"the batched QSA selection differs from transformers' indexer at {differ:.1%} of rows")
    return differ


class MTPHead(nn.Module):
    """The MTP layer of model/mtp.py in transformers' modules and under the checkpoint's names (`model.mtp` of a
    transformers model is `mtp.*` in its state dict): the target's streams before its final mixer, each stream through
    fc_hidden after one norm over all of them, plus the embedding of the next token through fc_embedding; one
    indexed-attention decoder layer without PLE; the final mixer. Returns the hidden state for lm_head."""

    def __init__(self, modeling, config):
        super().__init__()
        h, self.hc_count = config.hidden_size, config.hc_count
        self.pre_fc_norm_embedding = modeling.Qwen4ExpTextRMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = modeling.Qwen4ExpTextRMSNorm(self.hc_count * h, eps=config.rms_norm_eps)
        self.fc_embedding = nn.Linear(h, h, bias=False)
        self.fc_hidden = nn.Linear(h, h, bias=False)
        layer_config = copy.deepcopy(config)
        layer_config.num_hidden_layers, layer_config.ple_layer_ids = 1, []
        layer_config.layer_types = ["indexed_attention"]
        self.layers = nn.ModuleList([modeling.Qwen4ExpTextDecoderLayer(layer_config, 0)])
        self.hyper_connection_mixer = modeling.Qwen4ExpTextGatedResidual(config, use_combine=False)

    def forward(self, streams, next_embeds, position_embeddings, attention_mask):
        e = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))
        h = self.fc_hidden(self.pre_fc_norm_hidden(streams).unflatten(-1, (self.hc_count, -1)))
        x = (h + e.unsqueeze(-2)).flatten(-2)
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        return self.hyper_connection_mixer(x)


def attach_mtp(model, modeling) -> MTPHead:
    """Give a transformers model an MTP head (`model.mtp`), initialised as transformers initialises its layers."""
    model.mtp = MTPHead(modeling, model.config).to(next(model.parameters()).device)
    for m in model.mtp.modules():
        model._init_weights(m)
    return model.mtp


def mtp_loss(model, streams: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the MTP head's predictions: row t reads the streams at t ([B, T, hc*H], what the final mixer
    read) and the token at t+1, and predicts the token at t+2. Causal, no padding, positions from 0."""
    B, T = ids.shape[0], ids.shape[1] - 1
    embeds = model.model.embed_tokens(ids[:, 1:])
    positions = torch.arange(T, device=ids.device).view(1, 1, T).expand(3, B, T)
    keep = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    mask = keep if model.config._attn_implementation != "eager" else \
        torch.zeros(T, T, device=ids.device).masked_fill(~keep, torch.finfo(torch.float32).min)
    hidden = model.mtp(streams[:, :-1], embeds, model.model.rotary_emb(embeds, positions), mask[None, None])
    logits = model.lm_head(hidden[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 2:].flatten())


@contextlib.contextmanager
def final_mixer_input(model):
    """Yields a dict whose "streams" is, after each forward, the multi-stream state the final mixer read."""
    seen = {}
    hook = model.model.hyper_connection_mixer.register_forward_pre_hook(
        lambda module, args: seen.__setitem__("streams", args[0]))
    try:
        yield seen
    finally:
        hook.remove()


@contextlib.contextmanager
def batched_qsa_selection(model):
    """Every QSA indexer of the model selects through `_batched_qsa_selection` while the context is open."""
    indexers = [m for m in model.modules() if type(m).__name__ == "Qwen4ExpTextQSAIndexer"]
    for m in indexers:
        m.forward = functools.partial(_batched_qsa_selection, m)
    try:
        yield len(indexers)
    finally:
        for m in indexers:
            del m.forward


def train(device: torch.device, steps: int, batch: int = 32, seq_len: int = 512, lr: float = 2e-3, seed: int = 0,
          seconds: float | None = None, corpus_chars: int = 12_000_000, mtp_loss_weight: float = MTP_LOSS_WEIGHT,
          log=print):
    """Returns (the trained transformers model in eval mode, fp32; the held-out token stream; the EOS id; a record
    of the run). bf16 autocast on CUDA, fp32 on the CPU; AdamW with a linear warm-up and cosine decay over `steps`,
    or, with `seconds`, over as many steps (at most `steps`) as the first steps' pace fits into that time.
    With a positive `mtp_loss_weight` the model has an MTP head (`model.mtp`, its state dict's `mtp.*`) trained with
    the next-token loss + mtp_loss_weight x the MTP loss (`mtp_loss`)."""
    tok, eos = load_tokenizer()
    t0 = time.perf_counter()
    stream, held = token_streams(tok, eos, max_chars=corpus_chars)
    log(f"corpus: {len(stream)} train / {len(held)} held-out tokens in {time.perf_counter() - t0:.1f}s")
    torch.manual_seed(seed)
    with _transformers_without_fla() as modeling:
        model = modeling.Qwen4ExpForCausalLM(hf_small_config(eos)).to(device).train()
        if mtp_loss_weight > 0:
            attach_mtp(model, modeling).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    plan = {"steps": steps}  # the schedule's length; with `seconds`, set after the first steps

    def lr_factor(s):
        n = plan["steps"]
        return min(1.0, (s + 1) / max(1, n // 20)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / n))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    data = torch.tensor(stream)
    rng = random.Random(seed)
    losses, mtp_losses = [], []
    experts = getattr(model.config, "_experts_implementation", None)
    autocast = device.type == "cuda"
    # if the first step fails: the per-expert loop instead of the grouped GEMM (which may lack a backward or an
    # autocast rule in this torch), then fp32 without autocast
    fallbacks = [("experts", "eager"), ("autocast", False)]
    t0 = t_pace = time.perf_counter()
    step = 0
    selection_differs = check_batched_selection(model, data[None, :seq_len].to(device), log)
    with batched_qsa_selection(model) as n, final_mixer_input(model) as seen:
        log(f"train: {n} QSA indexers select for all queries at once")
        while step < plan["steps"]:
            starts = [rng.randrange(0, len(stream) - seq_len) for _ in range(batch)]
            ids = torch.stack([data[s: s + seq_len] for s in starts]).to(device)
            try:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = total = model(input_ids=ids, labels=ids).loss
                    if mtp_loss_weight > 0:
                        mtp = mtp_loss(model, seen.pop("streams"), ids)
                        total = loss + mtp_loss_weight * mtp
                total.backward()
            except (RuntimeError, NotImplementedError, TypeError) as e:
                if step or not fallbacks:
                    raise
                what, value = fallbacks.pop(0)
                log(f"train: the first step failed ({type(e).__name__}: {str(e)[:300]}); {what} -> {value!r}")
                if what == "experts":
                    model.set_experts_implementation(value)
                    experts = value
                else:
                    autocast = value
                opt.zero_grad(set_to_none=True)
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if mtp_loss_weight > 0:
                mtp_losses.append(float(mtp.detach()))
            if seconds is not None and step == 3:  # steps 0-1 compile and autotune: pace from steps 2-3
                if device.type == "cuda":
                    torch.cuda.synchronize()
                pace = (time.perf_counter() - t_pace) / 2
                plan["steps"] = max(4, min(steps, int(seconds / pace)))
                log(f"train: {pace * 1e3:.0f} ms a step, {plan['steps']} steps")
            if step == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t_pace = time.perf_counter()
            if step % max(1, plan["steps"] // 10) == 0 or step == plan["steps"] - 1:
                mtp_note = f", MTP loss {mtp_losses[-1]:.3f}" if mtp_losses else ""
                log(f"train step {step}: loss {losses[-1]:.3f}{mtp_note} ({time.perf_counter() - t0:.0f}s)")
            step += 1
    record = {"steps": plan["steps"], "batch": batch, "seq_len": seq_len, "lr": lr, "experts": experts,
              "bf16_autocast": autocast, "batched_selection_rows_differing": selection_differs,
              "corpus_chars": corpus_chars, "train_tokens": len(stream), "held_out_tokens": len(held),
              "first_loss": losses[0],
              "last_loss_mean10": sum(losses[-10:]) / len(losses[-10:]), "train_s": time.perf_counter() - t0}
    if mtp_losses:
        record.update(mtp_loss_weight=mtp_loss_weight, mtp_first_loss=mtp_losses[0],
                      mtp_last_loss_mean10=sum(mtp_losses[-10:]) / len(mtp_losses[-10:]))
    return model.eval(), held, eos, record



def train_for_engines(device: torch.device, steps: int, log=print, **train_kwargs):
    """`train`, then what an engine takes: (its ModelConfig, the weights on the CPU, fp32 where floating, by
    checkpoint name; the held-out token stream; the run's record). The transformers model is dropped and its GPU
    memory returned before the engines start."""
    from ..config import ModelConfig

    hf, held, _, record = train(device, steps, log=log, **train_kwargs)
    cfg = ModelConfig.from_hf(hf.config)
    weights = {n: t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu()
               for n, t in hf.state_dict().items()}
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cfg, weights, held, record
