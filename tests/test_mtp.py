"""The MTP draft layer (model/mtp.py) equals its math computed independently: plain torch for the input fusion,
transformers' decoder layer and hyper-connection mixer (holding the checkpoint's mtp.* tensors) for the rest, on
the target's multi-stream state as transformers computes it. Also: the target's exported streams, the MTP
weights' round trip through make-random checkpoints (fp8 included), and the errors when MTP is asked of a
checkpoint or config without it."""

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from qwen4exp.config import ConfigError, load_model_config
from qwen4exp.engine.step_builder import RequestChunk, StepBuilder
from qwen4exp.model import allocate_cache
from qwen4exp.model.merged_linear import named_checkpoint_tensors
from qwen4exp.model.state import num_attention_layers, page_bytes
from qwen4exp.ops.fp8 import FP8
from qwen4exp.weights.loader import MissingMTPError, load_model
from qwen4exp.weights.random_checkpoint import make_random

PAGE = 8
LENGTHS = (5, 14, 29)  # the longest is past the tiny preset's QSA budget + tail (11): the draft layer selects blocks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=3)


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    return load_file(os.path.join(tiny_dir, "model.safetensors"))


@pytest.fixture(scope="module")
def ours(tiny_dir):
    return load_model(load_model_config(tiny_dir), tiny_dir, torch.float32, "cpu", mtp=True)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


# ----- the reference: the math of model/mtp.py's docstring, written out -----

def rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


def stacked_layer_state(ckpt, prefix: str, num_experts: int) -> dict:
    """The checkpoint's tensors under `prefix` as transformers' decoder layer names them (experts stacked)."""
    state = {k[len(prefix):]: v for k, v in ckpt.items() if k.startswith(prefix) and ".experts." not in k}
    e = range(num_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([ckpt[f"{prefix}mlp.experts.{i}.gate_proj.weight"], ckpt[f"{prefix}mlp.experts.{i}.up_proj.weight"]])
         for i in e])
    state["mlp.experts.down_proj"] = torch.stack([ckpt[f"{prefix}mlp.experts.{i}.down_proj.weight"] for i in e])
    return state


class ReferenceMTP:
    """transformers' target model and an MTP head built from transformers' modules and the checkpoint's tensors."""

    def __init__(self, hf, ckpt):
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (
            Qwen4ExpTextDecoderLayer,
            Qwen4ExpTextGatedResidual,
        )

        self.hf, self.ckpt = hf, ckpt
        c = self.c = hf.config
        layer_config = copy.deepcopy(c)
        layer_config.num_hidden_layers, layer_config.ple_layer_ids = 1, []
        layer_config.layer_types = ["indexed_attention"]
        layer_config._attn_implementation = "eager"
        self.layer = Qwen4ExpTextDecoderLayer(layer_config, 0).eval()
        self.layer.load_state_dict(stacked_layer_state(ckpt, "mtp.layers.0.", c.num_experts))
        self.mixer = Qwen4ExpTextGatedResidual(c, use_combine=False).eval()
        self.mixer.load_state_dict({k.removeprefix("mtp.hyper_connection_mixer."): v for k, v in ckpt.items()
                                    if k.startswith("mtp.hyper_connection_mixer.")}, strict=False)
        assert self.mixer.block_inject_weight is None

    def target_streams(self, ids: list[int]) -> torch.Tensor:
        """The multi-stream state transformers' final mixer reads: [len, hc*H]."""
        seen = []
        hook = self.hf.model.hyper_connection_mixer.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        try:
            self.hf(torch.tensor([ids]))
        finally:
            hook.remove()
        return seen[0][0]

    def fuse(self, streams: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """The draft layer's input: fc_hidden of each stream of the jointly normalised state, plus e on every stream."""
        c, ck = self.c, self.ckpt
        e = F.linear(rms(self.hf.model.embed_tokens(torch.tensor(next_ids)), ck["mtp.pre_fc_norm_embedding.weight"],
                         c.rms_norm_eps), ck["mtp.fc_embedding.weight"])
        h = rms(streams, ck["mtp.pre_fc_norm_hidden.weight"], c.rms_norm_eps).unflatten(-1, (c.hc_count, -1))
        return (F.linear(h, ck["mtp.fc_hidden.weight"]) + e[:, None]).flatten(-2)

    def layer_over(self, inputs: torch.Tensor) -> torch.Tensor:
        """The draft layer over rows at positions 0..n-1 of one sequence, causal, without a cache."""
        n = inputs.shape[0]
        positions = torch.arange(n).view(1, 1, n).expand(3, 1, n)
        cos_sin = self.hf.model.rotary_emb(inputs, positions)
        mask = torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
        return self.layer(inputs[None], position_embeddings=cos_sin, attention_mask=mask[None, None])[0]

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        return F.linear(self.mixer(streams), self.hf.lm_head.weight)


# ----- our model, stepped by hand -----

class Requests:
    def __init__(self, model, prompts: list[list[int]]):
        self.model, self.prompts = model, prompts
        self.builder = StepBuilder(model.config, PAGE)
        self.cache = allocate_cache(model.config, num_pages=64, page_size=PAGE, num_slots=len(prompts) + 1,
                                    dtype=torch.float32, device="cpu", mtp=True)
        first = 1
        self.pages = []
        for p in prompts:
            n = -(-(len(p) + 1) // PAGE)
            self.pages.append(list(range(first, first + n)))
            first += n

    def meta(self, rows: list[list[int]], context: list[int]):
        chunks = [RequestChunk(r, ctx, p[:ctx], pages, i + 1, 0)
                  for i, (r, ctx, p, pages) in enumerate(zip(rows, context, self.prompts, self.pages))]
        return self.builder.build(chunks).to_metadata("cpu")


def test_draft_equals_reference_on_prefill_and_a_decode_step(ours, hf, ckpt):
    ref = ReferenceMTP(hf, ckpt)
    gen = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    sampled = [torch.randint(2, vocab, (2,), generator=gen).tolist() for _ in prompts]  # x_L, then draft token 1
    reqs = Requests(ours, prompts)
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    with torch.inference_mode():
        _, streams = ours(reqs.meta(prompts, [0] * len(prompts)), reqs.cache, return_streams=True)
        # draft step 0 over every row: row t brings the token at t + 1; the last row the token sampled after it
        meta0 = reqs.meta([p[1:] + s[:1] for p, s in zip(prompts, sampled)], [0] * len(prompts))
        h0, s0 = ours.draft(meta0, reqs.cache, streams)
        logits0 = ours.compute_logits(h0)
        # draft step 1: one row per request at the next position, fed step 0's streams of its last row
        meta1 = reqs.meta([s[1:] for s in sampled], list(LENGTHS))
        h1, s1 = ours.draft(meta1, reqs.cache, s0[ends], step=1)
        logits1 = ours.compute_logits(h1)
        start = 0
        for r, (p, s) in enumerate(zip(prompts, sampled)):
            rows = slice(start, start + len(p))
            start += len(p)
            target = ref.target_streams(p)
            torch.testing.assert_close(streams[rows], target, atol=1e-5, rtol=0)
            out = ref.layer_over(ref.fuse(target, p[1:] + s[:1]))
            torch.testing.assert_close(s0[rows], out, atol=1e-5, rtol=0)
            torch.testing.assert_close(logits0[rows], ref.logits(out), atol=1e-5, rtol=0)
            # the decode row attends to the draft layer's cached rows of the prompt
            row = ref.fuse(out[-1:], s[1:])
            out1 = ref.layer_over(torch.cat([ref.fuse(target, p[1:] + s[:1]), row]))[-1:]
            torch.testing.assert_close(s1[r:r + 1], out1, atol=1e-5, rtol=0)
            torch.testing.assert_close(logits1[r:r + 1], ref.logits(out1), atol=1e-5, rtol=0)
    assert logits0.abs().max() > 1  # non-trivial logits: the comparison could fail


def test_exported_streams_are_what_the_final_mixer_reads(ours):
    """The streams `return_streams` exports give the step's hidden states through the final mixer, and asking for
    them changes nothing else."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, ours.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 19)]
    with torch.inference_mode():
        plain = Requests(ours, prompts)
        hidden_only = ours(plain.meta(prompts, [0, 0]), plain.cache)
        reqs = Requests(ours, prompts)
        hidden, streams = ours(reqs.meta(prompts, [0, 0]), reqs.cache, return_streams=True)
        assert streams.shape == (26, ours.config.hc_count * ours.config.hidden_size)
        torch.testing.assert_close(hidden, hidden_only, atol=0, rtol=0)
        _, mixed, _ = ours.model.hyper_connection_mixer(streams)
        torch.testing.assert_close(ours.compute_logits(mixed), ours.compute_logits(hidden), atol=0, rtol=0)


def test_cache_counts_the_draft_layer_only_with_mtp(ours):
    c = ours.config
    assert num_attention_layers(c, mtp=True) == num_attention_layers(c) + 1 == 2
    assert page_bytes(c, PAGE, torch.float32, mtp=True) == 2 * page_bytes(c, PAGE, torch.float32)
    plain = allocate_cache(c, num_pages=4, page_size=PAGE, num_slots=2, dtype=torch.float32, device="cpu")
    with_mtp = allocate_cache(c, num_pages=4, page_size=PAGE, num_slots=2, dtype=torch.float32, device="cpu", mtp=True)
    assert len(plain.layers) == c.num_hidden_layers and len(with_mtp.layers) == c.num_hidden_layers + 1
    draft = with_mtp.layers[c.num_hidden_layers]
    assert draft.key.shape == plain.layers[3].key.shape and draft.block_key.shape == plain.layers[3].block_key.shape


# ----- weights -----

def test_mtp_weights_round_trip_in_the_released_layout(ours, ckpt, tiny_dir):
    config = load_model_config(tiny_dir)
    assert (config.mtp_num_hidden_layers, config.mtp_layer_types) == (1, ("indexed_attention",))
    released = {"mtp.fc_embedding.weight", "mtp.fc_hidden.weight", "mtp.pre_fc_norm_embedding.weight",
                "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_proj.weight",
                "mtp.layers.0.self_attn.indexer.index_qk_proj.weight", "mtp.layers.0.mlp.experts.7.down_proj.weight",
                "mtp.layers.0.mlp.shared_expert_gate.weight",
                "mtp.layers.0.attn_hyper_connection.block_inject_weight.weight",
                "mtp.hyper_connection_mixer.input_mix_weight_down.weight", "mtp.hyper_connection_mixer.hc_norm.weight"}
    assert released <= ckpt.keys()
    assert not any(k.startswith("mtp.layers.0.ple") for k in ckpt)
    compared = 0
    for t in named_checkpoint_tensors(ours):
        if not t.name.startswith("mtp."):
            continue
        if t.name.endswith("experts.gate_up_proj") or t.name.endswith("experts.down_proj"):
            prefix = t.name.rsplit(".", 1)[0]
            projs = ("gate_proj", "up_proj") if t.name.endswith("gate_up_proj") else ("down_proj",)
            expected = torch.stack([torch.cat([ckpt[f"{prefix}.{e}.{p}.weight"] for p in projs])
                                    for e in range(ours.config.num_experts)])
        else:
            expected = ckpt[t.name]
        torch.testing.assert_close(t.tensor, expected, atol=0, rtol=0)
        compared += 1
    assert compared == len({k.split(".experts.")[0] + ".experts" if ".experts." in k else k
                            for k in ckpt if k.startswith("mtp.")}) + 1  # gate_up and down per layer's experts


def test_fp8_checkpoint_quantizes_the_draft_layer_like_the_others(tmp_path):
    d = make_random(str(tmp_path / "fp8"), "tiny", dtype="float32", seed=5, quantization="fp8")
    with open(os.path.join(d, "config.json")) as f:
        skip = json.load(f)["quantization_config"]["modules_to_not_convert"]
    assert "mtp.layers.0.mlp.gate" in skip and "mtp.hyper_connection_mixer.input_mix_weight_down" in skip
    assert "mtp.layers.0.mlp.shared_expert.down_proj" not in skip
    config = load_model_config(d)
    model = load_model(config, d, torch.float32, "cpu", mtp=True)
    params = dict(model.named_parameters())
    for layer in ("model.layers.3", "mtp.layers.0"):
        assert params[f"{layer}.mlp.experts.gate_up_proj"].dtype == FP8
        assert params[f"{layer}.self_attn.o_proj.weight"].dtype == FP8
        assert params[f"{layer}.attn_hyper_connection.input_mix_weight_up.weight"].dtype == torch.float32
    assert params["mtp.fc_hidden.weight"].dtype == FP8
    assert load_model(config, d, torch.float32, "cpu").mtp is None  # the fp8 MTP tensors skipped with their scales


def without_mtp(src, dst) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(src, f)) as a, open(os.path.join(dst, f), "w") as b:
            b.write(a.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, os.path.join(dst, "model.safetensors"))
    return dst


def test_missing_mtp_weights_are_an_error_only_when_asked(tiny_dir, ours, tmp_path):
    d = without_mtp(tiny_dir, str(tmp_path / "no_mtp"))
    config = load_model_config(d)
    plain = load_model(config, d, torch.float32, "cpu").state_dict()
    assert plain.keys() == {k for k in ours.state_dict() if not k.startswith("mtp.")}
    for k, v in plain.items():
        torch.testing.assert_close(v, ours.state_dict()[k], atol=0, rtol=0)
    with pytest.raises(MissingMTPError, match=r"no MTP weights \(mtp\.\*\).*mtp_num_hidden_layers=1"):
        load_model(config, d, torch.float32, "cpu", mtp=True)
    weights = load_file(os.path.join(d, "model.safetensors")).items()
    with pytest.raises(MissingMTPError, match="no MTP weights"):  # tensors handed over in memory
        load_model(config, None, torch.float32, "cpu", weights=iter(weights), mtp=True)


def test_mtp_asked_of_a_config_without_it_names_the_field(tiny_dir, tmp_path):
    d = without_mtp(tiny_dir, str(tmp_path / "no_mtp_config"))
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key in ("mtp_num_hidden_layers", "mtp"):
        cfg.pop(key)
    with open(path, "w") as f:
        json.dump(cfg, f)
    config = load_model_config(d)
    assert config.mtp_num_hidden_layers == 0
    assert load_model(config, d, torch.float32, "cpu").mtp is None
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers: is 0"):
        load_model(config, d, torch.float32, "cpu", mtp=True)
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers"):
        load_model(config, None, torch.float32, "cpu", load_format="dummy", mtp=True)


def test_dummy_weights_fill_the_draft_layer(tiny_dir):
    model = load_model(load_model_config(tiny_dir), None, torch.float32, "cpu", load_format="dummy", mtp=True)
    for name, p in model.mtp.named_parameters():
        if not name.endswith("_scale_inv"):
            assert p.float().abs().max() > 0, name


def test_training_head_computes_the_draft_layer(tiny_dir):
    """bench.train_small's MTP head (transformers' modules) and its loss compute what model/mtp.py computes: a model
    trained with it is a checkpoint whose `mtp.*` tensors the engine drafts with."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling

    from qwen4exp.bench.train_small import attach_mtp, final_mixer_input, mtp_loss
    from qwen4exp.config import ModelConfig
    from qwen4exp.weights.init import fill_

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    attach_mtp(hf, modeling).eval()
    g = torch.Generator().manual_seed(1)
    for name, p in hf.mtp.named_parameters():  # norms included: fill_ gives every tensor non-trivial values
        fill_("mtp." + name, p.data, g)
    ours = load_model(ModelConfig.from_hf(hf.config), None, torch.float32, "cpu", weights=hf.state_dict().items(),
                      mtp=True)
    ids = torch.randint(2, ours.config.vocab_size, (1, 24), generator=g)
    with torch.no_grad(), final_mixer_input(hf) as seen:
        hf(input_ids=ids)
        ref = mtp_loss(hf, seen["streams"], ids)
    tokens = ids[0].tolist()
    reqs = Requests(ours, [tokens])
    with torch.inference_mode():
        _, streams = ours(reqs.meta([tokens], [0]), reqs.cache, return_streams=True)
        hidden, _ = ours.draft(reqs.meta([tokens[1:] + [0]], [0]), reqs.cache, streams)
        loss = F.cross_entropy(ours.compute_logits(hidden[:-2]), ids[0, 2:])
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
    assert ref > 1  # an untrained head: far from a loss a wrong row shift could also reach
