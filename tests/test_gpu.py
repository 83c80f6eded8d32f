"""On a GPU: the fast paths (Triton kernels, fla, inductor-fused ops) and CUDA-graph decode, in fp32, against the
CPU reference path on the same weights (tests/test_parity.py shows that reference equals transformers; with fla
installed, transformers' own CPU forward dispatches into fla's CUDA kernels, so it cannot be the reference here).
Skipped without CUDA; run on the H200 with `python -m pytest tests/test_gpu.py`."""

import copy

import pytest
import torch
from helpers import hf_config, hf_model, our_llm, random_prompt

from qwen4exp import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("indexer_budget", [16, 256])
def test_gpu_fast_paths_and_graphs_match_transformers(indexer_budget, monkeypatch):
    # budget 16: the prompts' steps select blocks (QSA); budget 256: every step is dense, and with the threshold
    # lowered below the step budget its prefill steps run the flash-style prefill attention kernel
    from qwen4exp.ops import tuning

    monkeypatch.setattr(tuning, "PREFILL_ATTN_MIN_TOKENS", 16)
    hf = hf_model(hf_config(ple_layer_ids=[1, 2], indexer_budget=indexer_budget, linear_key_head_dim=16,
                            linear_value_head_dim=16, head_dim=32, indexer_head_dim=16,
                            indexer_n_heads=8), seed=7)
    llm = our_llm(hf, device="cuda", max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.llm_engine.runner.graphs is not None
    gen = torch.Generator().manual_seed(9)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=13) for n in (5, 40, 90)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    cpu = our_llm(hf, device="cpu", max_num_seqs=4)
    for prompt, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        full = cpu.generate([{"prompt_token_ids": prompt + ids[:-1]}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)[0]
        # the reference's full forward: logprob of each next token, and its argmax, by position
        ref_lp = [next(iter(d.values())).logprob for d in full.prompt_logprobs[1:]]
        assert len(ref_lp) == len(prompt) + len(ids) - 2
        seq = prompt + ids[:-1]
        ours = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        ours += [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs[:-1], ids[:-1])]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref_lp), atol=2e-4, rtol=0)
        # greedy: each generated token (but the last) has rank 1 under the reference
        ranks = [d[t].rank for d, t in zip(full.prompt_logprobs[len(prompt):], seq[len(prompt):])]
        assert ranks == [1] * (len(ids) - 1)
    assert llm.llm_engine.cache.all_free()


@pytest.mark.parametrize("indexer_budget", [16, 256])
def test_gpu_mixed_step_graphs_match_the_reference(indexer_budget):
    """Prefill chunks mixed with decodes replay the mixed-step CUDA graphs (GDN's recurrent kernel over each request's
    tokens, per-token attention, a padding request): every generated token's logprob equals the CPU reference's
    full forward at that position, and each greedy token is the reference's argmax."""
    hf = hf_model(hf_config(ple_layer_ids=[1, 2], indexer_budget=indexer_budget, linear_key_head_dim=16,
                            linear_value_head_dim=16, head_dim=32, indexer_head_dim=16,
                            indexer_n_heads=8), seed=7)
    llm = our_llm(hf, device="cuda", max_num_seqs=4, max_num_batched_tokens=64)
    graphs = llm.llm_engine.runner.graphs
    assert graphs.mixed_sizes == [64]
    keys = []
    prepare = graphs.prepare_mixed
    graphs.prepare_mixed = lambda *a: keys.append(prepare(*a)) or keys[-1]
    gen = torch.Generator().manual_seed(9)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=13) for n in (5, 40, 90, 23)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(keys) >= 3, "the prefill steps must replay the mixed graphs"
    cpu = our_llm(hf, device="cpu", max_num_seqs=4)
    for prompt, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        full = cpu.generate([{"prompt_token_ids": prompt + ids[:-1]}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)[0]
        ref = full.prompt_logprobs[len(prompt):]  # the reference's distribution at each generated position
        ours = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs[:-1], ids[:-1])]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor([d[t].logprob for d, t in zip(ref, ids[:-1])]),
                                   atol=2e-4, rtol=0)
        assert [d[t].rank for d, t in zip(ref, ids[:-1])] == [1] * (len(ids) - 1)
    assert llm.llm_engine.cache.all_free()


@pytest.mark.parametrize("decodes,state_dtype", [(0, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_fla_bf16_prefill_matches_the_chunked_reference(decodes, state_dtype):
    """bf16 prefill through fla's varlen chunk kernel (state slots gathered / scattered) vs the fp32 reference; with
    decodes, a mixed step: one-token requests first (the recurrent kernel), fla's sequences starting after them;
    state slots in fp32 or bf16 (--mamba-ssm-cache-dtype)."""
    pytest.importorskip("fla")
    from functools import partial
    from types import SimpleNamespace

    from qwen4exp.model.metadata import StepMetadata
    from qwen4exp.ops.gated_delta import gated_delta_rule, gated_delta_rule_ref

    g = torch.Generator().manual_seed(0)
    lens, hk, hv, d = [1] * decodes + [37, 130, 5], 2, 6, 128
    T = sum(lens)
    q, k = (torch.randn(T, hk, d, generator=g) for _ in range(2))
    v = torch.randn(T, hv, d, generator=g)
    gate = -torch.rand(T, hv, generator=g) * 0.5
    beta = torch.rand(T, hv, generator=g)
    state = (torch.randn(5, hv, d, d, generator=g) * 0.1).to(state_dtype)
    qsl = [0] + torch.tensor(lens).cumsum(0).tolist()
    slots, has_init = [0, 2][:decodes] + [3, 1, 4], [True] * decodes + [True, False, True]
    ref_state = state.clone()
    ref = gated_delta_rule_ref(q, k, v, gate, beta, ref_state, qsl, slots, has_init)
    meta = SimpleNamespace(query_start_loc_cpu=qsl, query_start_loc=torch.tensor(qsl, dtype=torch.int32).cuda(),
                           state_slots_cpu=slots, state_slots=torch.tensor(slots).cuda(), has_initial_state=has_init,
                           has_initial=torch.tensor(has_init).cuda(), num_decode_reqs=decodes, num_verify_reqs=0,
                           num_reqs=len(lens), derived={})
    meta.prefill_chunk_indices = partial(StepMetadata.prefill_chunk_indices, meta)
    from fla.ops.utils.index import prepare_chunk_indices  # the layout fla derives itself (with a device sync)

    prefill_cu = meta.query_start_loc[decodes:].long() - qsl[decodes]
    assert meta.prefill_chunk_indices(64).tolist() == prepare_chunk_indices(prefill_cu, 64).tolist()
    gpu_state = state.cuda()
    out = gated_delta_rule(*(t.cuda().bfloat16() for t in (q, k, v)), gate.cuda(), beta.cuda().bfloat16(),
                           gpu_state, meta)
    torch.testing.assert_close(out.float().cpu(), ref, atol=5e-2, rtol=5e-2)
    assert gpu_state.dtype == state_dtype
    torch.testing.assert_close(gpu_state.cpu()[slots].float(), ref_state[slots].float(), atol=5e-2, rtol=5e-2)


def test_host_and_gpu_fp8_tables_give_identical_outputs_with_graphs():
    """bf16 engine with CUDA-graph decode: an fp8 n-gram table in page-locked host memory, read row by row over PCIe
    on a side stream, gives bit-identical tokens and logprobs to the same table in GPU memory."""
    from qwen4exp.weights.loader import table_names
    from qwen4exp.weights.ngram_table import FP8, on_host

    hf = hf_model(hf_config(ple_layer_ids=[1, 2], ngram_vocab_size_base=5000, linear_key_head_dim=16,
                            linear_value_head_dim=16, head_dim=32, indexer_head_dim=16), seed=3)
    gen = torch.Generator().manual_seed(4)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=9) for n in (3, 50, 130)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    results = {}
    for where in ("gpu", "cpu"):
        llm = our_llm(hf, device="cuda", dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64,
                      ple_table_device=where, ple_table_dtype="fp8")
        model = llm.llm_engine.model
        tables = [dict(model.named_parameters())[n] for n in table_names(model)]
        assert all(t.dtype == FP8 and on_host(t) == (where == "cpu") for t in tables)
        assert llm.llm_engine.runner.graphs is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[where] = ([o.outputs[0].token_ids for o in outs],
                          [d[t].logprob for o in outs for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        del llm, model, tables
    assert results["cpu"] == results["gpu"]


@pytest.mark.parametrize("max_model_len", [2048, 160])
def test_serving_compiles_nothing_after_the_warm_up(max_model_len):
    """Step sizes the warm-up never ran, odd and even, in every routed-expert kernel regime up to the full step
    budget, decodes mixed with prefills: no Triton kernel and no dynamo graph compiles while serving them (each
    compilation is a stall of 0.3-7 s in the middle of serving). With max_model_len 160 the steps over 192 tokens
    (the MoE's 64-row tile tier at 8 experts, top-2) are several prompts."""
    from qwen4exp.bench.compile_log import CompileLog

    hf = hf_model(hf_config(), seed=5)
    llm = our_llm(hf, device="cuda", dtype="bfloat16", max_model_len=max_model_len, num_pages=2048, max_num_seqs=16,
                  max_num_batched_tokens=1024)
    gen = torch.Generator().manual_seed(3)
    lengths = [n for n in (1, 2, 3, 17, 31, 64, 65, 100, 190, 250, 333, 700, 1023, 1500, 2000) if n < max_model_len]
    rounds = [lengths, torch.randint(1, min(1800, max_model_len - 8), (16,), generator=gen).tolist()]
    with CompileLog() as log:
        for lens in rounds:
            prompts = [random_prompt(gen, n, hf.config.vocab_size) for n in lens]
            want = [min(7, max_model_len - n) for n in lens]
            params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in want]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outs] == want
    assert [(e["kernel"], e["key"]) for e in log.events] == [] and log.dynamo_graphs == 0
    assert llm.llm_engine.cache.all_free()


def test_programmatic_dependent_launch_changes_no_output(monkeypatch):
    """With PDL each Triton kernel may launch while the kernel before it finishes, and waits before touching memory
    (ops/_triton_utils.py). 48 requests in bf16 (eager prefill, mixed-step graphs, graph decode at batch 48 with the
    sorted-pairs experts and the shared expert on its side stream) give bitwise the same tokens and logprobs with
    it on and off: a kernel that read or wrote too early would show here."""
    from qwen4exp import ops
    from qwen4exp.ops._triton_utils import launch_options

    if not launch_options(torch.zeros(1, device="cuda"))["PDL"]:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or later")
    hf = hf_model(hf_config(num_experts=16, num_experts_per_tok=4, indexer_budget=16), seed=3)
    gen = torch.Generator().manual_seed(5)
    prompts = [random_prompt(gen, int(n), hf.config.vocab_size) for n in torch.randint(4, 60, (48,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(ops.settings, "pdl", enabled)
        llm = our_llm(hf, device="cuda", dtype="bfloat16", max_num_seqs=48, max_num_batched_tokens=256,
                      num_pages=1024)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids,
                         [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs])
        assert llm.llm_engine.cache.all_free()
        del llm
    assert results[0] == results[1]


def test_gpu_structured_output_with_graphs_and_deferred_sampling(tmp_path):
    """Constrained requests beside free ones on the GPU: CUDA-graph decode, asynchronous scheduling (a constrained
    row's sampling waits for its previous id, read while the model runs), the bitmask copied from pinned memory
    and applied on the device. Every constrained output satisfies its constraint and ends by its grammar; the
    device mask equals the CPU's."""
    import json
    import re

    from transformers import AutoTokenizer

    from qwen4exp import StructuredOutputsParams
    from qwen4exp.engine.structured_output import StructuredOutputs
    from qwen4exp.weights.tokenizer import build_tokenizer

    special = build_tokenizer(str(tmp_path), vocab_size=300)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    hf = hf_model(hf_config(eos_token_id=special["<|im_end|>"]), seed=7)
    llm = our_llm(hf, device="cuda", tokenizer=tok, max_num_seqs=16, max_num_batched_tokens=64)
    engine = llm.llm_engine
    assert engine.runner.graphs is not None and engine.async_scheduling
    deferred = []
    launch = engine._launch
    engine._launch = lambda *a: (lambda step: deferred.append(step.to_sample is not None) or step)(launch(*a))
    regex = r"[a-c]{2,5}-[0-9]{1,3}"
    ints = {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 3}
    constrained = ([StructuredOutputsParams(regex=regex)] * 4
                   + [StructuredOutputsParams(json=ints, disable_any_whitespace=True)] * 4)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=so)
              for i, so in enumerate(constrained)]
    params += [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 4
    outs = llm.generate([f"request {i}" for i in range(len(params))], params, use_tqdm=False)
    for p, out in zip(params, outs):
        c = out.outputs[0]
        if p.structured_outputs is None:
            assert len(c.token_ids) == 24
        elif p.structured_outputs.regex is not None:
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text
        else:
            values = json.loads(c.text)
            assert c.finish_reason == "stop" and 1 <= len(values) <= 3 and all(-5 <= v <= 5 for v in values)
    assert sum(deferred) > 5
    assert engine.cache.all_free()
    # the device mask sets the same logits as the host one, padding included
    logits = torch.randn(5, hf.config.vocab_size)

    def masked(so, device):
        matchers = [so.matcher(so.compile(StructuredOutputsParams(json={"type": "string"})), []) for _ in range(3)]
        for m, prefix in zip(matchers, ['"', '"a', '"ab"']):
            assert m.accept_string(prefix)
        out = logits.to(device)
        so.bitmask([0, 2, 3], matchers, 5).apply(out)
        return out.cpu()

    gpu = masked(engine.structured_outputs, "cuda")
    cpu = masked(StructuredOutputs(tok, hf.config.vocab_size, 4, "cpu", engine.eos_token_ids), "cpu")
    assert torch.equal(gpu, cpu) and torch.isinf(gpu[[0, 2, 3]]).any()
    assert torch.equal(gpu[[1, 4]], logits[[1, 4]])


@pytest.mark.parametrize("k", [1, 3])
def test_gpu_speculative_decoding_equals_decoding_without_it(k, tmp_path):
    """Speculative decoding on the GPU (its CUDA graphs and the draft layer's, the recurrent kernels storing each
    verified row's state): greedy tokens and logprobs equal decoding's without speculation on the GPU (whose paths the
    tests above hold to the reference), with the draft layer's drafts and with drafts half right; the step graphs
    replay, the draft layer's too. (QSA dense: its batched selection breaks ties between equal block scores by the
    batch's layout.)"""
    import random

    from test_spec_decode import ScriptedProposer, assert_same_outputs, serve, wrong_half

    from qwen4exp import LLM
    from qwen4exp.weights.random_checkpoint import make_random

    d = make_random(str(tmp_path / "tiny"), "tiny", dtype="float32", seed=1, overrides={"indexer_budget": 256})
    rng = random.Random(4)
    requests = [(str(i), [rng.randrange(3, 500) for _ in range(rng.randrange(2, 60))],
                 SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 30), ignore_eos=True, logprobs=1))
                for i in range(12)]
    engine = dict(dtype="float32", max_model_len=256, page_size=8, num_pages=200, max_num_seqs=8,
                  max_num_batched_tokens=64)
    expected = serve(LLM(d, device="cuda", **engine), requests)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    for drafts in ("mtp", "half right"):
        llm = LLM(d, device="cuda", speculative_config=spec, **engine)
        graphs = llm.llm_engine.runner.graphs
        assert graphs is not None and graphs.speculative == k
        replayed = []
        run = graphs._run
        graphs._run = lambda key: replayed.append(key) or run(key)
        draft_replayed = []
        if drafts == "mtp":  # the draft layer's own graphs
            draft_graphs = llm.llm_engine.spec.proposer.graphs
            run_draft = draft_graphs._run
            draft_graphs._run = lambda key: draft_replayed.append(key) or run_draft(key)
        else:
            llm.llm_engine.spec.proposer = ScriptedProposer(
                {rid: o.outputs[0].token_ids for rid, o in expected.items()}, wrong_half)
        assert_same_outputs(serve(llm, requests), expected, requests)
        assert replayed, "decode and verify steps must replay the speculative graphs"
        assert bool(draft_replayed) == (drafts == "mtp"), "draft steps must replay the draft layer's graphs"
        assert llm.llm_engine.cache.all_free()


def test_gpu_decode_of_requests_with_images_replays_graphs_and_equals_the_cpu(tmp_path):
    """Requests with images on the GPU: the steps that feed image tokens run eagerly, the decodes after them replay
    CUDA graphs at offset rotary positions (StepLayout.text_rope), beside a text-only request. Greedy tokens and
    logprobs equal the CPU reference's, fp32. (A QSA budget past every context: block selection breaks ties of zero
    scores by its row's length, which differs between graph rows, eager steps and the reference.)"""
    import json

    import numpy as np
    from PIL import Image

    from qwen4exp import LLM
    from qwen4exp.weights.random_checkpoint import make_random

    d = make_random(str(tmp_path), "tiny", dtype="float32", vision=True, seed=3, overrides={"indexer_budget": 256})
    cfg = json.load(open(f"{d}/config.json"))
    start, pad, end = cfg["vision_start_token_id"], cfg["image_token_id"], cfg["vision_end_token_id"]
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((64, 32), (48, 48))]
    gen = torch.Generator().manual_seed(2)
    text = [random_prompt(gen, n, 400) for n in (12, 9, 20)]
    requests = [{"prompt_token_ids": text[0] + [start, pad, end] + text[1], "multi_modal_data": {"image": images[:1]}},
                {"prompt_token_ids": [start, pad, end] + text[2] + [start, pad, end],
                 "multi_modal_data": {"image": images}},
                {"prompt_token_ids": text[2]}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(d, device=device, dtype="float32", max_model_len=512, max_num_seqs=4)
        replays = []
        graphs = llm.llm_engine.runner.graphs
        if device == "cuda":
            assert graphs is not None
            run = graphs._run
            graphs._run = lambda key: replays.append(key) or run(key)
        outs[device] = llm.generate(requests, params, use_tqdm=False)
        assert llm.llm_engine.cache.all_free()
        if device == "cuda":
            assert len(replays) >= 14  # the decodes of all three after their prefills
    for ref, out in zip(outs["cpu"], outs["cuda"]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        lp = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        lp_ref = [d[t].logprob for d, t in zip(ref.outputs[0].logprobs, ref.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp_ref), atol=2e-3, rtol=0)


@pytest.mark.parametrize("k", [1, 2])
def test_gpu_bf16_state_speculation_follows_decoding_without_it(k, tmp_path):
    """--mamba-ssm-cache-dtype bfloat16 on the GPU (graphs, the recurrent kernel going on from each verified row's
    stored, rounded state): greedy outputs with speculation follow decoding's without it on the same state dtype,
    logprobs within 1e-2, up to a near tie where the two may part. Exact equality (the CPU test of the rounding
    rule) does not hold here: the two run the same rows in matmuls of other shapes and prefill in other kernels
    (fla's chunk kernel eagerly, the recurrent one in a mixed graph), so their fp32 states differ in the last bits,
    which rounding to bf16 can turn into a whole bf16 step of a state element (1.1e-3 in a logprob measured on an
    H100). So this holds the graphs and kernels to what goes grossly wrong (a state read from the wrong slot or row);
    the CPU test holds the rounding itself, exactly."""
    import random

    from qwen4exp import LLM
    from qwen4exp.weights.random_checkpoint import make_random

    d = make_random(str(tmp_path / "tiny"), "tiny", dtype="float32", seed=1, overrides={"indexer_budget": 256})
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 60))] for _ in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 30), ignore_eos=True, logprobs=2)
              for _ in prompts]
    engine = dict(dtype="float32", max_model_len=256, page_size=8, num_pages=200, max_num_seqs=8,
                  mamba_ssm_cache_dtype="bfloat16")
    expected = LLM(d, device="cuda", **engine).generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = LLM(d, device="cuda", speculative_config={"method": "mtp", "num_speculative_tokens": k}, **engine)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    compared = total = 0
    for got, want in zip(outputs, expected, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        total += len(w.token_ids)
        for a, b, lp_a, lp_b in zip(g.token_ids, w.token_ids, g.logprobs, w.logprobs):
            if a != b:  # the two part only where decoding's top two tokens are within the tolerance
                assert a in lp_b and abs(lp_b[a].logprob - lp_b[b].logprob) < 1e-2, (got.request_id, lp_a, lp_b)
                break
            assert abs(lp_a[a].logprob - lp_b[b].logprob) < 1e-2, (got.request_id, lp_a, lp_b)
            compared += 1
        else:
            assert len(g.token_ids) == len(w.token_ids)
    assert compared >= total // 2, "outputs parted early in most requests"
    assert llm.llm_engine.cache.all_free()


@pytest.mark.parametrize("k,drafts", [(1, "mtp"), (1, "half right"), (3, "mtp"), (3, "half right")])
def test_gpu_chained_speculative_steps_equal_decoding_without_them(k, drafts, tmp_path):
    """Greedy requests from raw logits: steps launched before the step before them is read (SpecDecoder.chain: the
    layout derived on the device, then one graph of the step and its draft step 0, and for k >= 2 the further draft
    steps moved on the device) give decoding's tokens, with the draft layer's drafts (mostly rejected) and with
    drafts half right (the chained steps run eagerly with scripted drafts, tests/test_spec_decode.py)."""
    import random

    from test_spec_decode import ScriptedDraftGraphs, assert_same_outputs, serve

    from qwen4exp import LLM
    from qwen4exp.weights.random_checkpoint import make_random

    d = make_random(str(tmp_path / "tiny"), "tiny", dtype="float32", seed=1, overrides={"indexer_budget": 256})
    rng = random.Random(6)
    requests = [(str(i), [rng.randrange(3, 500) for _ in range(rng.randrange(2, 60))],
                 SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 40) + 16 * (k - 1), ignore_eos=True))
                for i in range(6)]
    engine = dict(dtype="float32", max_model_len=256, page_size=8, num_pages=200, max_num_seqs=8,
                  max_num_batched_tokens=64)
    expected = serve(LLM(d, device="cuda", **engine), requests)
    llm = LLM(d, device="cuda", speculative_config={"method": "mtp", "num_speculative_tokens": k}, **engine)
    spec = llm.llm_engine.spec
    graphs, replayed, same_drafts = llm.llm_engine.runner.graphs, [], []
    run = graphs._run

    def run_and_check(key):
        """A chained step's graph, its drafts checked against the draft layer run eagerly on its outputs."""
        replayed.append(key[0])
        out = run(key)
        if key[0] == "chained":
            meta, _, rope_offset, _ = graphs.graph_inputs(key)
            meta = copy.copy(meta)
            streams, tokens, _, drafts, _ = out
            meta.positions, meta.input_ids, meta.state_token_slots = meta.token_pos + rope_offset, tokens, None
            rows = int(meta.query_start_loc[-2])  # the requests' rows, before the padding request's
            eager, _ = graphs.drafter.draft_forward(meta, streams)
            same_drafts.append(torch.equal(eager[:rows], drafts[:rows]))
        return out

    graphs._run = run_and_check
    if drafts == "half right":  # the chained steps' graphs hold the draft layer: they run eagerly with the script
        sequences = {rid: p + expected[rid].outputs[0].token_ids for rid, p, _ in requests}
        spec.proposer.graphs = ScriptedDraftGraphs(llm.llm_engine, graphs, sequences, k)
        graphs._run = lambda key: (replayed.append(key[0]) or graphs.graph_step(*graphs.graph_inputs(key))
                                   if key[0] == "chained" else run(key))
    chained = []
    chain = spec.chain
    spec.chain = lambda engine, step: (lambda nxt: chained.append(nxt is not None) or nxt)(chain(engine, step))
    assert_same_outputs(serve(llm, requests), expected, requests)
    assert sum(chained) > 10, "steps must chain"
    assert replayed.count("chained") == sum(chained), "every chained step runs its own graph"
    assert all(same_drafts), "a chained step's graph drafts as the draft layer does from the step's tokens"
    assert llm.llm_engine.cache.all_free()


@pytest.mark.parametrize("k", [2, 3])
def test_gpu_chained_steps_verify_the_drafts_unchained_steps_verify(k, tmp_path):
    """With the draft layer's own drafts (mostly rejected: random weights), steps chained before the step before
    them is read (the further drafts made on the device from rows it moved by what both steps keep) feed the target
    the very tokens, position by position, that steps launched after each read feed it: a draft made from the wrong
    row or states keeps outputs exact and loses only acceptance, which no output comparison shows."""
    import random

    from test_spec_decode import generate

    from qwen4exp import LLM
    from qwen4exp.weights.random_checkpoint import make_random

    d = make_random(str(tmp_path / "tiny"), "tiny", dtype="float32", seed=1, overrides={"indexer_budget": 256})
    rng = random.Random(8)
    requests = [(str(i), [rng.randrange(3, 500) for _ in range(rng.randrange(2, 60))],
                 SamplingParams(temperature=0.0, max_tokens=24 + 16 * (k - 1), ignore_eos=True)) for i in range(4)]
    engine = dict(dtype="float32", max_model_len=256, page_size=8, num_pages=200, max_num_seqs=8,
                  max_num_batched_tokens=64)
    fed, kinds, outputs = {}, {}, {}
    for chains in (False, True):
        llm = LLM(d, device="cuda", speculative_config={"method": "mtp", "num_speculative_tokens": k}, **engine)
        eng, graphs = llm.llm_engine, llm.llm_engine.runner.graphs
        graphs.chains = graphs.chains and chains
        rows, replayed, run = fed.setdefault(chains, set()), kinds.setdefault(chains, []), graphs._run

        def record(key, rows=rows, replayed=replayed, run=run, eng=eng, graphs=graphs):
            """(request, position, token) of every row of a step the graphs run"""
            if key[0] in ("mixed", "chained"):
                replayed.append(key[0])
                meta = graphs._mixed_meta(*key[1:])
                owner = {r.pages[0]: r.request_id for r in eng.scheduler.running if r.pages}
                n = int(meta.query_start_loc[-2])  # the requests' rows, before the padding request's
                pages = graphs.mbuf["block_tables"][:, 0][meta.token_req[:n]].tolist()
                rows.update((owner.get(p), q, t) for p, q, t in
                            zip(pages, meta.token_pos[:n].tolist(), meta.input_ids[:n].tolist()))
            return run(key)
        graphs._run = record
        outputs[chains] = generate(llm, requests)
    assert kinds[True].count("chained") > 10 and "chained" not in kinds[False]
    for rid, _, _ in requests:
        assert outputs[True][rid].outputs[0].token_ids == outputs[False][rid].outputs[0].token_ids
    # the last steps differ: a chained step runs in vain past a request's end, an unchained one drafts fewer there
    limit = {rid: len(prompt) + params.max_tokens - 2 * (k + 1) for rid, prompt, params in requests}
    a, b = ({x for x in fed[c] if x[0] in limit and x[1] < limit[x[0]]} for c in (False, True))
    assert len(a) > 50 * k and a == b, (len(a), sorted(a - b)[:10], sorted(b - a)[:10])
