"""Shared test helpers: random configs, the transformers reference, our engine on the same weights."""

from __future__ import annotations

import contextlib

import torch

from qwen4exp.config import ModelConfig
from qwen4exp.engine.cuda_graph import CUDAGraphRunner
from qwen4exp.weights.init import fill_

EOS = 1


def hf_config(**overrides):
    from transformers import Qwen4ExpTextConfig

    kw = dict(
        vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, hc_count=4, hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=16,
        ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=60, eos_token_id=EOS, indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        output_gate_type="sigmoid", dtype="float32",
    )
    kw.update(overrides)
    return Qwen4ExpTextConfig(**kw)


def hf_model(config, seed: int = 0):
    """transformers' model with every parameter random (norms and convs included)."""
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fill_(name, p.data, g)
    return model


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' full forward without a cache: [len, vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def our_llm(hf, **kw):
    """qwen4exp.LLM holding the same weights as `hf` (handed over in memory)."""
    from qwen4exp import LLM

    config = ModelConfig.from_hf(hf.config)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("num_pages", 256)
    kw.setdefault("page_size", 8)
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return LLM(None, model_config=config, weights=hf.state_dict().items(), **kw)


def random_prompt(gen: torch.Generator, length: int, vocab: int, eos_every: int | None = 11) -> list[int]:
    ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
    if eos_every:
        for i in range(eos_every // 2, length, eos_every):
            ids[i] = EOS
    return ids


_LOAD_RSS_SCRIPT = """
import json, sys, torch
from qwen4exp.config import load_model_config
from qwen4exp.model import Qwen4ExpForCausalLM
from qwen4exp.weights.loader import load_model, table_names

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

d, kwargs = sys.argv[1], json.loads(sys.argv[2])
cfg = load_model_config(d)
with torch.device("meta"):  # the first model construction imports modules lazily (~80 MB): not loading's cost
    Qwen4ExpForCausalLM(cfg)
open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from the current RSS
before = status("VmRSS")
m = load_model(cfg, d, torch.float32, "cpu", **kwargs)
peak = status("VmHWM") - before
sizes = {n: p.numel() * p.element_size() for n, p in m.named_parameters()}
print(json.dumps({"peak": peak, "sizes": sizes, "tables": table_names(m)}))
"""


def load_peak_rss(model_dir: str, **load_kwargs) -> tuple[int, dict[str, int], list[str]]:
    """Peak resident memory added while `load_model` (fp32, CPU) loads `model_dir` in a fresh process, with the
    loaded parameters' sizes in bytes and the n-gram table names."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LOAD_RSS_SCRIPT, model_dir, json.dumps(load_kwargs)],
                         capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["peak"], result["sizes"], result["tables"]


@contextlib.contextmanager
def serve_on_loopback(app, log_level: str = "warning", timeout: float = 30.0):
    """An ASGI app served by uvicorn on a free loopback port, in a thread of this process; yields its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def run_arriving(engine, prompts: list[list[int]], params: list, rng, max_arrivals: int = 2,
                 max_steps: int = 5000) -> dict:
    """Steps `engine` while the requests arrive over time (0..max_arrivals of them before each step, in order);
    returns each request's final RequestOutput by its index."""
    pending, outputs, steps = list(range(len(prompts))), {}, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, max_arrivals + 1)):
            if pending:
                i = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i])
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = out
        steps += 1
        assert steps < max_steps
    return outputs


class EagerBufferRunner(CUDAGraphRunner):
    """CUDAGraphRunner whose replays run eagerly (no capture: the CPU) on the metadata a graph captures, buffers and
    padding filled as for a replay: its host copies are unset, so an op that read them on the in-graph path would
    raise."""

    def _run(self, key):
        self.variants_used.add(key[-1])
        return self.graph_step(*self.graph_inputs(key))


def graph_runner(llm, cls=EagerBufferRunner, *args, **kw):
    """A graph runner over `llm`'s model and cache tensors."""
    engine = llm.llm_engine
    graphs = cls(engine.model, engine.runner.cache, engine.cache.page_size, *args, **kw)
    graphs.variants_used = set()
    return graphs
