"""PLE n-gram tables in host memory and in fp8: same outputs wherever the table lives, bounded fp8 error,
prefetch issued before the first layer, and streaming loads whose peak memory is one shard above the table."""

import logging

import pytest
import torch
from helpers import hf_config, hf_model, load_peak_rss, our_llm, random_prompt

import qwen4exp.ops.table_gather as table_gather
from qwen4exp import SamplingParams
from qwen4exp.bench.offline import teacher_forced
from qwen4exp.config import ConfigError, EngineConfig, load_model_config
from qwen4exp.weights import ngram_table
from qwen4exp.weights.loader import WeightLoadError, load_model, table_names
from qwen4exp.weights.ngram_table import FP8, FP8_MAX, fp8_scale, on_host, resolve_table_on_host, write_rows_
from qwen4exp.weights.random_checkpoint import make_random
from qwen4exp.weights.safetensors_io import checkpoint_files, iterate_files, write_safetensors


@pytest.fixture(scope="module")
def hf():
    return hf_model(hf_config(ple_layer_ids=[1, 2], ngram_vocab_size_base=400), seed=8)


def _prompts(hf):
    gen = torch.Generator().manual_seed(2)
    return [random_prompt(gen, n, hf.config.vocab_size, eos_every=6) for n in (1, 17, 40)]


def _run(llm, prompts, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [next(iter(d.values())).logprob for o in outs for d in o.outputs[0].logprobs]
    lps += [next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]
    return tokens, torch.tensor(lps)


def _tables(llm):
    model = llm.llm_engine.model
    params = dict(model.named_parameters())
    return [params[n] for n in table_names(model)]


def test_host_and_device_tables_give_identical_outputs(hf, monkeypatch):
    """float32: a table in host memory (its own mapping) and one allocated with the model give the same tokens and
    bit-identical logprobs, through the reference gather and through the Triton gather (interpreter on CPU)."""
    prompts = _prompts(hf)
    device_llm = our_llm(hf, max_num_batched_tokens=24)
    host_llm = our_llm(hf, max_num_batched_tokens=24, ple_table_device="cpu")
    assert not any(on_host(t) for t in _tables(device_llm))
    assert all(on_host(t) for t in _tables(host_llm)) and len(_tables(host_llm)) == 2
    ref = _run(device_llm, prompts)
    host = _run(host_llm, prompts)
    assert host[0] == ref[0]
    assert torch.equal(host[1], ref[1])

    pytest.importorskip("triton")
    from qwen4exp.ops import table_gather_triton

    if torch.cuda.is_available():
        pytest.skip("the Triton gather of CPU tensors runs in the interpreter only; tests/test_gpu.py covers CUDA")
    gathered = []

    def triton_gather(table, ids, scale, dtype, out=None):
        gathered.append(on_host(table))
        return table_gather_triton.gather_rows_triton(table, ids, scale, dtype, out)

    monkeypatch.setattr(table_gather, "gather_rows", triton_gather)
    fast = _run(host_llm, prompts)
    assert gathered and all(gathered)
    assert fast[0] == ref[0]
    assert torch.equal(fast[1], ref[1])


def test_every_ple_gather_is_issued_before_the_first_layer(hf, monkeypatch):
    """The n-gram ids depend on tokens only: each step hashes and gathers for all PLE layers up front, so reads from
    a host table can overlap the layers before the PLE layers."""
    llm = our_llm(hf, ple_table_device="cpu")
    events = []
    orig = table_gather.gather_rows
    monkeypatch.setattr(table_gather, "gather_rows", lambda *a, **k: events.append("gather") or orig(*a, **k))
    layers = llm.llm_engine.model.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(f"layer{i}"))
    _run(llm, _prompts(hf)[:2], max_tokens=3)
    steps = [events[i: i + 2 + len(layers)] for i in range(0, len(events), 2 + len(layers))]
    assert len(steps) >= 3
    for step in steps:
        assert step == ["gather", "gather"] + [f"layer{i}" for i in range(len(layers))], step


def test_fp8_quantisation_round_trip_is_bounded():
    """e4m3 has 3 mantissa bits: each value comes back within 2^-4 of itself (relative), or within half the
    smallest subnormal step (2^-10 x scale) near zero; the largest magnitude maps to 448 without overflow."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(5000, 24, generator=g) * torch.logspace(-4, 1, 24)
    table[17, 3] = -37.5  # the largest magnitude
    scale = fp8_scale(table.abs().max().item())
    q = torch.empty(table.shape, dtype=FP8)
    write_rows_(q, 0, table, scale)
    assert q.float().abs().max().item() == FP8_MAX and torch.isfinite(q.float()).all()
    back = table_gather.gather_rows_ref(q, torch.arange(5000)[:, None], torch.tensor(scale), torch.float32)
    err = (back - table).abs()
    bound = torch.maximum(table.abs() * 2**-4, torch.full_like(table, scale * 2**-10))
    assert (err <= bound * (1 + 1e-6)).all(), (err / bound).max()
    assert err.max() > 0  # it is a lossy format: the bound is what is tested


def test_fp8_table_logprob_drift_against_bf16_table(hf):
    """fp8 table (one scale per table) against a bf16 table, same fp32 model, teacher-forced: the drift is a small
    fraction of what dropping the n-gram rows altogether does. The measured figures are printed."""
    gen = torch.Generator().manual_seed(2)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=6) for n in (60, 120, 200)]
    bf16 = teacher_forced(our_llm(hf, ple_table_dtype="bfloat16"), prompts)
    llm = our_llm(hf, ple_table_dtype="fp8")
    assert all(t.dtype == FP8 for t in _tables(llm))
    fp8 = teacher_forced(llm, prompts)
    for table in _tables(llm):
        table.data.zero_()
    zero = teacher_forced(llm, prompts)
    drift, zero_drift = (fp8[0] - bf16[0]).abs(), (zero[0] - bf16[0]).abs()
    agree = (fp8[1] == bf16[1]).float().mean().item()
    print(f"\nfp8 vs bf16 table over {drift.numel()} positions: mean |dlogprob| {drift.mean():.4f}, max "
          f"{drift.max():.4f}, top-1 agreement {agree:.3f}; zeroed table: mean {zero_drift.mean():.4f}")
    assert 0 < drift.mean() <= 0.15 * zero_drift.mean()
    assert agree >= 0.8


def test_fp8_checkpoint_table_keeps_its_scale(tmp_path):
    """A checkpoint whose table is already fp8 (with `ngram_embedding.weight_scale`, the FP8 release's layout) loads
    as fp8 with that scale, or dequantised into bf16; without the scale it is an error naming the tensor."""
    d = make_random(str(tmp_path / "tiny"), "tiny", dtype="float32", seed=1)
    cfg = load_model_config(d)
    reference = load_model(cfg, d, torch.float32, "cpu", ple_table_dtype="fp8")
    ref_params = dict(reference.named_parameters())
    ref_buffers = dict(reference.named_buffers())
    files = checkpoint_files(d)
    for f in files:
        tensors = dict(iterate_files([f]))
        out = {}
        for name, t in tensors.items():
            table = name.split(".shard_")[0] + ".weight" if ".shard_" in name else None
            if table in ref_params:
                i = int(name.split(".shard_")[1].split(".")[0])
                rows = t.shape[0]
                out[name] = ref_params[table][i * rows: (i + 1) * rows].clone()
                out[table.removesuffix(".weight") + ".weight_scale"] = ref_buffers[table + "_scale"].clone()
            else:
                out[name] = t
        write_safetensors(f, [(n, tuple(t.shape), t.dtype) for n, t in out.items()], out.__getitem__)

    loaded = load_model(cfg, d, torch.float32, "cpu")  # auto keeps the checkpoint's fp8
    for name in table_names(loaded):
        table = dict(loaded.named_parameters())[name]
        assert table.dtype == FP8 and torch.equal(table.view(torch.uint8), ref_params[name].view(torch.uint8))
        assert dict(loaded.named_buffers())[name + "_scale"].item() == ref_buffers[name + "_scale"].item() != 1.0
    wide = load_model(cfg, d, torch.float32, "cpu", ple_table_dtype="bfloat16")
    name = table_names(wide)[0]
    ids = torch.randint(0, 100, (5, 4))
    got = table_gather.gather_rows_ref(dict(wide.named_parameters())[name], ids,
                                       dict(wide.named_buffers())[name + "_scale"], torch.float32)
    want = table_gather.gather_rows_ref(ref_params[name], ids, ref_buffers[name + "_scale"], torch.float32)
    assert torch.equal(got, want)

    for f in files:  # drop the scales
        kept = {n: t for n, t in iterate_files([f]) if not n.endswith("weight_scale")}
        write_safetensors(f, [(n, tuple(t.shape), t.dtype) for n, t in kept.items()], kept.__getitem__)
    with pytest.raises(WeightLoadError, match=r"ngram_embedding\.weight_scale"):
        load_model(cfg, d, torch.float32, "cpu")


def test_table_placement_and_dtype_options():
    with pytest.raises(ConfigError, match="ple_table_device"):
        EngineConfig(ple_table_device="tpu")
    with pytest.raises(ConfigError, match="ple_table_dtype"):
        EngineConfig(ple_table_dtype="int4")
    with pytest.raises(ValueError, match="ple_table_device: 'gpu' needs a CUDA"):
        resolve_table_on_host("gpu", torch.device("cpu"), 10, 10, 0.9)
    assert resolve_table_on_host("auto", torch.device("cpu"), 10, 10, 0.9) is False
    assert resolve_table_on_host("cpu", torch.device("cpu"), 10, 10, 0.9) is True


def test_auto_places_the_table_on_the_host_when_the_gpu_budget_is_short(monkeypatch, caplog):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 * gib, 140 * gib))
    cuda = torch.device("cuda")
    with caplog.at_level(logging.INFO, logger="qwen4exp"):
        # 75 GiB of weights + a 48 GiB fp8 table exceed 90% of 0.9 x 140 GiB: host
        assert resolve_table_on_host("auto", cuda, 48 * gib, 75 * gib, 0.9) is True
        assert "host" in caplog.text
        # the 2M-base table (4.8 GiB) fits
        assert resolve_table_on_host("auto", cuda, int(4.8 * gib), 75 * gib, 0.9) is False
        assert resolve_table_on_host("gpu", cuda, 48 * gib, 75 * gib, 0.9) is False


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_sharded_table_streams_into_its_destination(tmp_path, dtype):
    """Peak RSS while loading a sharded table is at most the table + one shard (+ the small rest of the model and a
    fixed overhead), also when each shard is quantised to fp8 on the way (after a first pass for the scale)."""
    d = make_random(str(tmp_path / "big-table"), "tiny", dtype="float32", seed=0,
                    overrides=dict(ngram_vocab_size_base=200_000, ple_embed_dim=128, split_ngram_parts=16))
    shard = max(t.numel() * t.element_size() for n, t in iterate_files(checkpoint_files(d)) if ".shard_" in n)
    peak, sizes, tables = load_peak_rss(d, ple_table_device="cpu", ple_table_dtype=dtype)
    table = sum(sizes[n] for n in tables)
    other = sum(sizes.values()) - table
    assert table >= 4 * shard  # the table dominates, so a second copy of it would show
    print(f"\npeak RSS while loading: {peak / 2**20:.1f} MiB; table {table / 2**20:.1f} MiB, shard "
          f"{shard / 2**20:.1f} MiB, rest {other / 2**20:.1f} MiB")
    assert peak <= table + shard + other + (32 << 20), (peak, table, shard, other)


def test_host_tables_are_unregistered_and_forgotten_when_freed():
    t = ngram_table.host_empty((64, 8), torch.bfloat16, pin=False)
    ptr = t.untyped_storage().data_ptr()
    assert on_host(t) and on_host(t[3:])
    del t
    assert ptr not in ngram_table._host_tables
