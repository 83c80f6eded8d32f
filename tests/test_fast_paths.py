"""The GPU dispatch (decode/prefill split, vectorised n-gram windows, batched QSA selection, Triton kernels) and the
CUDA-graph metadata buffers give the reference's tokens. On CPU the Triton kernels run in the interpreter."""

import pytest
import torch
from helpers import EagerBufferRunner, graph_runner, hf_config, hf_model, our_llm, random_prompt

import qwen4exp.ops as ops
from qwen4exp import SamplingParams
from qwen4exp.engine.cuda_graph import CUDAGraphRunner

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def model_pair():
    hf = hf_model(hf_config(ple_layer_ids=[1, 2]), seed=21)
    return hf


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [
        [next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]


def test_fast_dispatch_and_graph_buffers_match_reference(model_pair, monkeypatch):
    hf = model_pair
    gen = torch.Generator().manual_seed(6)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=5) for n in (1, 9, 30, 14)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (10, 5, 10, 8)]
    ref_llm = our_llm(hf, max_num_batched_tokens=16)
    ref_ids, ref_lps = generate(ref_llm, prompts, params)
    short = [prompts[0] + [7]]  # alone, its context stays under budget + C - 1: the dense-QSA graphs
    short_ref, _ = generate(ref_llm, short, params[:1])

    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    llm = our_llm(hf, max_num_batched_tokens=16)
    runner = llm.llm_engine.runner
    runner.graphs = graph_runner(llm, EagerBufferRunner, 512, 4, "cpu", buckets=[1, 2, 4])
    calls = []
    run = runner.graphs.execute
    runner.graphs.execute = lambda chunks, *pending: calls.append(len(chunks)) or run(chunks, *pending)
    ids, lps = generate(llm, prompts, params)
    assert generate(llm, short, params[:1])[0] == short_ref
    assert calls, "decode steps must go through the graph runner"
    assert 3 in calls, "a padded bucket (3 requests in the 4-bucket) must be exercised"
    assert runner.graphs.variants_used == {512, 11}, "both the short (dense QSA) and the general graphs must run"
    assert ids == ref_ids
    flat = lambda rows: torch.tensor([x for row in rows for x in row])  # noqa: E731
    torch.testing.assert_close(flat(lps), flat(ref_lps), atol=1e-4, rtol=0)
    assert llm.llm_engine.cache.all_free()


def test_mixed_step_graph_buffers_match_reference(model_pair, monkeypatch):
    """Steps mixing prefill chunks with decodes through the mixed-graph layout (the step's requests, empty rows, a
    padding request owning the bucket's unused tokens; every op on its in-graph path: GDN's recurrent kernel over
    each request's tokens, per-token attention), run on the metadata the graph captures (no host copies of the
    layout), give the reference's tokens and logprobs, and leak no cache."""
    from qwen4exp.engine import cuda_graph

    hf = model_pair
    gen = torch.Generator().manual_seed(8)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=5) for n in (3, 11, 23, 6, 4)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (5, 5, 3, 3, 2)]
    alone = [random_prompt(gen, 5, hf.config.vocab_size)]  # one 5-token prefill: the 8-token bucket
    ref_llm = our_llm(hf, max_num_batched_tokens=16)
    ref = [generate(ref_llm, p, params[: len(p)]) for p in (prompts, alone)]

    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    monkeypatch.setattr(cuda_graph, "MIXED_GRAPH_TOKENS", (8, 16))
    llm = our_llm(hf, max_num_batched_tokens=16)
    runner = llm.llm_engine.runner
    runner.graphs = graph_runner(llm, EagerBufferRunner, 512, 8, "cpu", buckets=[1, 2, 4, 8], max_num_batched_tokens=16)
    mixed = []
    prepare = runner.graphs.prepare_mixed

    def recorded(chunks, *pending):
        key, wanted = prepare(chunks, *pending)
        mixed.append(([len(c.token_ids) for c in chunks], key[1]))
        return key, wanted
    runner.graphs.prepare_mixed = recorded
    flat = lambda rows: torch.tensor([x for row in rows for x in row])  # noqa: E731
    for p, (ref_ids, ref_lps) in zip((prompts, alone), ref):
        ids, lps = generate(llm, p, params[: len(p)])
        assert ids == ref_ids
        torch.testing.assert_close(flat(lps), flat(ref_lps), atol=1e-4, rtol=0)
    assert any(1 in lengths and max(lengths) > 1 for lengths, _ in mixed), "prefill chunks must mix with decodes"
    assert {T for _, T in mixed} == {8, 16}, "both buckets must be exercised"
    assert any(sum(lengths) < T and len(lengths) > 1 for lengths, T in mixed), \
        "a step of live requests must leave tokens to the padding request"
    assert llm.llm_engine.cache.all_free()


def test_graph_block_tables_hold_each_rows_pages_then_zeros(model_pair):
    """The graph runner sends only the batch's widest block table each step; the buffer must still read as if every
    row were written in full: its pages, then zeros (padding rows all zero), also after the batch narrows."""
    from qwen4exp.engine.step_builder import RequestChunk

    llm = our_llm(model_pair)
    graphs = graph_runner(llm, CUDAGraphRunner, 512, 4, "cpu", buckets=[1, 2, 4])
    graphs._run = lambda key: torch.zeros(key[0], 8)
    ps = llm.llm_engine.cache.page_size

    def chunk(pages):
        return RequestChunk(token_ids=[3], context_len=len(pages) * ps - 1, history=[1, 2], pages=pages, state_slot=1,
                            logits_from=0)

    def expected(rows, bucket):
        out = torch.zeros(bucket, graphs.buf["block_tables"].shape[1], dtype=torch.int32)
        for r, pages in enumerate(rows):
            out[r, : len(pages)] = torch.tensor(pages)
        return out

    # full bucket, then a padded one (row 3 must be cleared), a narrower one, and a wider one again
    for rows in ([[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [20]], [[13], [21, 22], [23]], [[13]], [[14, 15], [16]]):
        bucket = next(b for b in graphs.buckets if b >= len(rows))
        graphs.execute([chunk(p) for p in rows])
        assert torch.equal(graphs.buf["block_tables"][:bucket], expected(rows, bucket))
        assert not graphs.buf["block_tables"][:, max(map(len, rows)):].any()


def test_decode_graph_buffers_hold_the_step_layout_then_null_rows(model_pair):
    """A decode graph's buffers hold the step's layout as the eager metadata has it, each QSA block in the row of
    the token that completes it (the null page's block row otherwise), async tokens from the previous step's ids,
    and padding rows on the null slot and null page, without state, with an EOS n-gram context."""
    from qwen4exp.engine.step_builder import RequestChunk, StepBuilder

    llm = our_llm(model_pair)
    engine = llm.llm_engine
    graphs = graph_runner(llm, CUDAGraphRunner, 512, 4, "cpu", buckets=[1, 2, 4])
    graphs._run = lambda key: torch.zeros(key[0], 8)
    ps, C, eos = engine.cache.page_size, engine.model_config.indexer_compress_ratio, engine.model_config.eos_token_id
    # contexts 11 and 3 complete a block with their token, 0 and 12 do not; the last two come from the device
    chunks = [RequestChunk(token_ids=[5 + r], context_len=ctx, history=list(range(20, 20 + ctx)),
                           pages=[10 * r + p + 1 for p in range(ctx // ps + 1)], state_slot=r + 1, logits_from=0,
                           pending_row=src)
              for r, (ctx, src) in enumerate([(11, -1), (0, -1), (3, 1), (12, 0)])]
    for n in (4, 3):  # a full bucket, then one padding row
        step = chunks[:n]
        graphs.execute(step, torch.tensor([70, 71]))
        meta = StepBuilder(engine.model_config, ps).build(step).to_metadata("cpu")
        b = graphs.buf
        ids = [ch.token_ids[0] if ch.pending_row < 0 else 70 + ch.pending_row for ch in step]
        assert b["input_ids"][:n].tolist() == ids
        for name in ("positions", "slot_mapping", "state_slots", "context_lens", "has_initial", "ngram_context"):
            assert b[name][:n].tolist() == getattr(meta, name).tolist(), name
        assert b["block_tables"][:n, : meta.block_tables.shape[1]].tolist() == meta.block_tables.tolist()
        completes = [r for r, ch in enumerate(step) if (ch.context_len + 1) % C == 0]
        assert completes == [0, 2]
        for name in ("new_block_token_slots", "new_block_slots", "new_block_positions"):
            assert b[name][completes].tolist() == getattr(meta, name).tolist(), name
            assert not b[name][[r for r in range(n) if r not in completes]].any(), name
        for name in ("input_ids", "positions", "slot_mapping", "state_slots", "context_lens", "has_initial",
                     "block_tables", "new_block_token_slots", "new_block_slots", "new_block_positions"):
            assert not b[name][n:4].any(), name
        assert (b["ngram_context"][n:4] == eos).all()


def test_graph_metadata_holds_no_host_copies(model_pair, monkeypatch):
    """A graph replays whatever step fills its buffers, so its metadata holds no host copy of the layout: reading
    one raises, naming the field and the device tensors to read instead; the sizes in-graph ops branch on hold."""
    from qwen4exp.engine import cuda_graph
    from qwen4exp.model.metadata import HostFieldUnset

    monkeypatch.setattr(cuda_graph, "MIXED_GRAPH_TOKENS", (8, 16))
    graphs = graph_runner(our_llm(model_pair), CUDAGraphRunner, 512, 4, "cpu", buckets=[1, 2, 4],
                          max_num_batched_tokens=16)
    decode, mixed = graphs._meta(3, 512), graphs._mixed_meta(16, 512)
    assert (decode.num_reqs, decode.num_tokens, decode.num_decode_reqs) == (3, 3, 3)
    assert (mixed.num_reqs, mixed.num_tokens, mixed.num_decode_reqs) == (5, 16, 0)
    for meta in (decode, mixed):
        for name in ("query_start_loc_cpu", "context_lens_cpu", "state_slots_cpu", "has_initial_state"):
            with pytest.raises(HostFieldUnset, match=f"StepMetadata.{name} is not set.*device tensors"):
                getattr(meta, name)
        with pytest.raises(HostFieldUnset, match="query_start_loc_cpu"):
            meta.prefill_chunk_indices(64)


def test_mixed_graph_buckets_longer_than_max_model_len(model_pair, monkeypatch):
    """A bucket longer than max_model_len (a step of several short prompts) hands the padding request positions past
    max_model_len: its block table row must still cover them (zeros: the null page), or the in-graph attention
    reads pages from past the table (an illegal memory access on the GPU)."""
    from qwen4exp.engine import cuda_graph

    hf = model_pair
    gen = torch.Generator().manual_seed(9)
    # one 12-token prefill step: the 32-token bucket, whose padding request reaches position 19 (tables: 16)
    prompts = [random_prompt(gen, n, hf.config.vocab_size, eos_every=5) for n in (5, 3, 4)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for m in (4, 3, 6)]
    ref_ids, ref_lps = generate(our_llm(hf, max_model_len=12, max_num_batched_tokens=32), prompts, params)

    monkeypatch.setattr(ops.settings, "fast_on_cpu", True)
    monkeypatch.setattr(cuda_graph, "MIXED_GRAPH_TOKENS", (8, 32))
    llm = our_llm(hf, max_model_len=12, max_num_batched_tokens=32)
    runner = llm.llm_engine.runner
    runner.graphs = graph_runner(llm, EagerBufferRunner, 12, 4, "cpu", buckets=[1, 2, 4], max_num_batched_tokens=32)
    graphs, ps, buckets = runner.graphs, llm.llm_engine.cache.page_size, []
    prepare = graphs.prepare_mixed

    def recorded(chunks, *pending):
        key, wanted = prepare(chunks, *pending)
        T, tables = key[1], graphs.mbuf["block_tables"]
        # the CPU kernels read past a table row without failing: check the reach the GPU needs instead
        assert int(graphs.mbuf["positions"][:T].max()) < tables.shape[1] * ps, "a token's page is past its table"
        buckets.append(T)
        return key, wanted
    graphs.prepare_mixed = recorded
    ids, lps = generate(llm, prompts, params)
    assert 32 in buckets, "a step must replay the bucket longer than max_model_len"
    assert ids == ref_ids
    flat = lambda rows: torch.tensor([x for row in rows for x in row])  # noqa: E731
    torch.testing.assert_close(flat(lps), flat(ref_lps), atol=1e-4, rtol=0)
    assert llm.llm_engine.cache.all_free()


def test_missing_fla_warns_once_naming_the_package(monkeypatch, caplog):
    """Without fla-core the GPU prefill runs the reference, several times slower, which is easy to mistake for a slow
    GPU: its absence must be said, once, with how to install it."""
    import sys

    from qwen4exp.ops import gated_delta

    for name in [n for n in sys.modules if n == "fla" or n.startswith("fla.")] or ["fla"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import fla...` raises ImportError, imported before or not
    gated_delta.fla_chunk.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="qwen4exp"):
            assert gated_delta.fla_chunk() is None
            assert gated_delta.fla_chunk() is None
    finally:
        gated_delta.fla_chunk.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "fla-core" in warnings[0] and "python -m pip install" in warnings[0]
