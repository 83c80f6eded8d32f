"""The model split over two CPU processes (gloo): tensor parallel and expert parallel give one process's greedy
tokens and logprobs, through the engine (chunked prefill, preemption) and the server; a killed worker ends the engine
with an error; two launches joining one rendezvous give the same tokens; each rank loads only its parts."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from helpers import run_arriving, serve_on_loopback

from qwen4exp import LLM, SamplingParams, distributed
from qwen4exp.config import EngineConfig, load_model_config
from qwen4exp.engine.engine import LLMEngine
from qwen4exp.engine.step_builder import RequestChunk
from qwen4exp.engine.workers import WorkerDiedError, decode_step, encode_step
from qwen4exp.entrypoints.async_engine import AsyncEngine
from qwen4exp.entrypoints.server import build_app
from qwen4exp.model.merged_linear import named_checkpoint_tensors
from qwen4exp.weights.loader import load_model
from qwen4exp.weights.random_checkpoint import make_random
from qwen4exp.weights.safetensors_io import checkpoint_files, iterate_files

# small budgets: 24-token steps chunk the prompts, 24 pages for 10 requests force preemption
ENGINE = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "page_size": 8, "num_pages": 24,
          "max_num_batched_tokens": 24, "max_num_seqs": 8}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=3)


def workload():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))] for _ in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 20), ignore_eos=True,
                             prompt_logprobs=0 if i % 3 == 0 else None, logprobs=2 if i % 2 else None)
              for i in range(10)]
    return prompts, params


def run(engine: LLMEngine, prompts, params) -> dict:
    """Requests arriving over time, a few per step."""
    return run_arriving(engine, prompts, params, random.Random(1), max_steps=2000)


@pytest.fixture(scope="module")
def expected(tiny_dir):
    engine = LLMEngine(tiny_dir, EngineConfig(**ENGINE))
    return run(engine, *workload())


def assert_same(outputs: dict, expected: dict) -> None:
    assert sorted(outputs) == sorted(expected)
    for i, want in expected.items():
        got, ref = outputs[i], want
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids, f"request {i}"
        if ref.prompt_logprobs is not None:
            for token, a, b in zip(ref.prompt_token_ids[1:], got.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
                assert abs(a[token].logprob - b[token].logprob) <= TOLERANCE, f"request {i} prompt token {token}"
        if ref.outputs[0].logprobs is not None:
            for token, a, b in zip(ref.outputs[0].token_ids, got.outputs[0].logprobs, ref.outputs[0].logprobs):
                assert abs(a[token].logprob - b[token].logprob) <= TOLERANCE, f"request {i} token {token}"


@pytest.mark.parametrize("options", [{}, {"enable_expert_parallel": True, "ple_table_parallel": "rows"}],
                         ids=["tensor-parallel", "expert-parallel-table-rows"])
def test_two_ranks_match_one_process(tiny_dir, expected, options):
    engine = LLMEngine(tiny_dir, EngineConfig(tensor_parallel_size=2, **options, **ENGINE))
    try:
        outputs = run(engine, *workload())
        assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
        assert_same(outputs, expected)
        assert engine.cache.all_free()
    finally:
        engine.shutdown()
    assert distributed.world_size() == 1  # the process left the group: a later engine is a single process again


@pytest.mark.slow
def test_small_preset_two_ranks_match_one_process(tmp_path):
    """The small preset (more heads, wider experts than tiny), tensor parallel and expert parallel: one process's
    tokens and logprobs."""
    d = make_random(str(tmp_path / "small"), "small", dtype="float32", seed=4)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1,
                             prompt_logprobs=0 if i == 0 else None) for i in range(3)]
    config = dict(ENGINE, num_pages=64)
    expected = run(LLMEngine(d, EngineConfig(**config)), prompts, params)
    for options in ({}, {"enable_expert_parallel": True}):
        engine = LLMEngine(d, EngineConfig(tensor_parallel_size=2, **options, **config))
        try:
            assert_same(run(engine, prompts, params), expected)
            assert engine.cache.all_free()
        finally:
            engine.shutdown()


def test_killed_worker_ends_engine_within_30s(tiny_dir):
    engine = LLMEngine(tiny_dir, EngineConfig(tensor_parallel_size=2, **ENGINE))
    try:
        engine.add_request("a", {"prompt_token_ids": list(range(3, 40))},
                           SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
        engine.step()
        [(rank, process)] = engine.workers.processes
        os.kill(process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=f"rank {rank} .* exited"):
            while time.monotonic() - start < 60:
                engine.step()
        assert time.monotonic() - start < 30
        assert "rank 1" in engine.worker_failure()
    finally:
        engine.shutdown()


def test_server_two_ranks(tiny_dir):
    prompts = [[5, 9, 33, 100, 7], list(range(3, 50))]
    reference = LLM(tiny_dir, **ENGINE).generate([{"prompt_token_ids": p} for p in prompts],
                                                SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                                use_tqdm=False)
    engine = LLMEngine(tiny_dir, EngineConfig(tensor_parallel_size=2, **ENGINE))
    async_engine = AsyncEngine(engine).start()
    try:
        app = build_app(async_engine, "tiny", max_model_len=128, model_path=tiny_dir)
        with serve_on_loopback(app) as url:
            for prompt, want in zip(prompts, reference):
                r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want.outputs[0].text
            assert httpx.get(f"{url}/health").status_code == 200
            [(_, process)] = engine.workers.processes
            os.kill(process.pid, signal.SIGKILL)
            start = time.monotonic()
            while httpx.get(f"{url}/health").status_code != 503:
                assert time.monotonic() - start < 30, "/health still answers 200"
                time.sleep(0.2)
            assert "exited" in httpx.get(f"{url}/health").text
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompts[0], "max_tokens": 4})
            assert r.status_code >= 500
    finally:
        async_engine.shutdown()
        engine.shutdown()


NODE0 = """
import json, sys
from qwen4exp import LLM, SamplingParams
if __name__ == "__main__":
    prompts, options = json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(sys.argv[1], tensor_parallel_size=2, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_two_launches_join_one_rendezvous(tiny_dir, tmp_path):
    prompts = [[5, 9, 33, 100, 7], list(range(3, 50))]
    want = [o.outputs[0].token_ids for o in LLM(tiny_dir, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "NNODES": "2"}
    script = tmp_path / "node0.py"
    script.write_text(NODE0)
    # node 1 is the serving command with only its ranks, the model and the device: the rest comes from node 0
    node1 = subprocess.Popen([sys.executable, "-m", "qwen4exp", "serve", tiny_dir, "--tensor-parallel-size", "2",
                              "--device", "cpu"], env={**env, "NODE_RANK": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        node0 = subprocess.run([sys.executable, str(script), tiny_dir, json.dumps(prompts), json.dumps(ENGINE)],
                               env={**env, "NODE_RANK": "0"}, capture_output=True, text=True, timeout=180, check=False)
        assert node0.returncode == 0, node0.stderr[-3000:]
        assert json.loads(node0.stdout.strip().splitlines()[-1]) == want
        assert node1.wait(timeout=30) == 0, node1.stdout.read()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()


def stacked_experts(tensors: dict, num_experts: int) -> dict:
    """The checkpoint's per-expert tensors stacked as the model stacks them (transformers' layout)."""
    out = {}
    for name in list(tensors):
        if name.endswith(".experts.0.gate_proj.weight"):
            prefix = name.removesuffix(".0.gate_proj.weight")
            gate, up, down = ([tensors[f"{prefix}.{i}.{p}.weight"] for i in range(num_experts)]
                              for p in ("gate_proj", "up_proj", "down_proj"))
            out[prefix + ".gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
            out[prefix + ".down_proj"] = torch.stack(down)
    return out


def test_each_rank_loads_only_its_parts(tiny_dir):
    """Per rank, every parameter holds its part of the checkpoint tensor; together the ranks hold all of it."""
    config = load_model_config(tiny_dir)
    whole = dict(iterate_files(checkpoint_files(tiny_dir)))
    whole.update(stacked_experts(whole, config.num_experts))
    for expert_parallel in (False, True):
        seen: dict[str, list[torch.Tensor]] = {}
        for rank in range(2):
            distributed.set_state(distributed.ParallelState(2, rank, expert_parallel, ple_table_rows=True))
            try:
                model = load_model(config, tiny_dir, torch.float32, "cpu")
            finally:
                distributed.set_state(distributed.ParallelState())
            for t in named_checkpoint_tensors(model):
                if t.shard is not None:
                    torch.testing.assert_close(t.tensor, distributed.take(whole[t.name], t.shard), rtol=0, atol=0)
                    seen.setdefault(t.name, []).append(t.tensor)
            experts = model.model.layers[0].mlp.experts
            assert experts.num_experts == (4 if expert_parallel else 8)
            assert experts.intermediate_size == (32 if expert_parallel else 16)
            table = model.model.layers[2].ple.ple_embedding.ngram_embedding.weight
            prefix = "model.layers.2.ple.ple_embedding.ngram_embedding"
            shards = sorted((int(n.split(".shard_")[1].split(".")[0]), t) for n, t in whole.items()
                            if n.startswith(prefix + ".shard_"))
            full = torch.cat([t for _, t in shards])
            half = table.shape[0]
            torch.testing.assert_close(table, full[rank * half:(rank + 1) * half], rtol=0, atol=0)
        assert "model.embed_tokens.weight" in seen and "lm_head.weight" in seen
        assert all(sum(p.numel() for p in parts) == whole[name].numel() for name, parts in seen.items())


def test_part_reads_match_slices(tiny_dir):
    name = "model.layers.0.linear_attn.out_proj.weight"
    whole = dict(iterate_files(checkpoint_files(tiny_dir)))[name]
    for shard in [(1, ((16, 48),)), (0, ((0, 8), (40, 64)))]:
        [(_, part)] = iterate_files(checkpoint_files(tiny_dir), only=lambda n: n == name,
                                    parts=lambda n, shape, s=shard: s)
        torch.testing.assert_close(part, distributed.take(whole, shard), rtol=0, atol=0)


def test_step_buffer_round_trip():
    chunks = [RequestChunk([7], 12, [3, 4], [1, 2], 3, 0, 0),
              RequestChunk([5, 6, 7, 8], 0, [], [4], 1, 4, -1)]
    decoded, pending, mixed, streams = decode_step(encode_step(chunks, 3, False, True))
    assert decoded == chunks and (pending, mixed, streams) == (3, False, True)


def test_tensor_parallel_size_must_divide_the_heads(tiny_dir):
    config = load_model_config(tiny_dir)
    distributed.set_state(distributed.ParallelState(3, 0))
    try:
        with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
            load_model(config, tiny_dir, torch.float32, "cpu")
    finally:
        distributed.set_state(distributed.ParallelState())
