"""The OpenAI-compatible server, end to end: a real uvicorn server on a free port (in this process, so the engine's
cache can be inspected) over the tiny random checkpoint, driven by the official openai client, raw HTTP and
lm-evaluation-harness, and compared with the offline LLM on the same weights."""

import asyncio
import contextlib
import math
import os
import re
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from helpers import serve_on_loopback
from prometheus_client.parser import text_string_to_metric_families

from qwen4exp import LLM, SamplingParams
from qwen4exp.config import EngineConfig
from qwen4exp.engine.engine import LLMEngine
from qwen4exp.entrypoints.async_engine import AsyncEngine
from qwen4exp.entrypoints.server import build_app
from qwen4exp.weights.random_checkpoint import make_random

MODEL = "tiny"
MAX_LEN = 256
LIMITS = dict(max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=256, cpu_cache_bytes=1 << 24)
MAX_QUEUED = 2
TASK_DIR = os.path.join(os.path.dirname(__file__), "data", "lmeval_task")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    make_random(path, "tiny", dtype="float32")
    return path


class Live:
    def __init__(self, url: str, async_engine: AsyncEngine):
        self.url, self.async_engine, self.engine = url, async_engine, async_engine.engine

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        return sum(float(m.group(2))
                   for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))

    def idle(self) -> bool:
        return (self.engine.cache.all_free() and self.metric("vllm:num_requests_running") == 0
                and self.metric("vllm:num_requests_waiting") == 0)


@pytest.fixture(scope="module")
def live(tiny_dir):
    engine = LLMEngine(tiny_dir, EngineConfig(**LIMITS, dtype="float32", device="cpu"))
    async_engine = AsyncEngine(engine, max_queued_requests=MAX_QUEUED).start()
    app = build_app(async_engine, MODEL, max_model_len=MAX_LEN, model_path=tiny_dir)
    with serve_on_loopback(app) as url:
        yield Live(url, async_engine)
    async_engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return LLM(tiny_dir, dtype="float32", device="cpu", **LIMITS)


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def poll(cond, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.05)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_envelope(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# ----- openai client -----
def test_models_lists_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_offline_generate(client, reference):
    prompt = "The quick brown fox"
    ref = reference.generate(prompt, greedy(12, logprobs=0), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    c = r.choices[0]
    assert c.text == ref.text and c.finish_reason == ref.finish_reason
    assert c.logprobs.token_logprobs == pytest.approx(
        [lp[t].logprob for t, lp in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.id.startswith("cmpl-") and r.model == MODEL and r.created > 0
    ids = reference.get_tokenizer().encode(prompt, add_special_tokens=False)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0).choices[0].text == ref.text


def test_completion_prompt_lists_and_n(client, reference):
    prompts = ["Hello there", "Once upon a time"]
    tok = reference.get_tokenizer()
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    refs = [o.outputs[0] for o in reference.generate(prompts, greedy(8), use_tqdm=False)]
    for form in (prompts, ids):
        r = client.completions.create(model=MODEL, prompt=form, max_tokens=8, temperature=0, n=2)
        choices = sorted(r.choices, key=lambda c: c.index)
        assert [c.index for c in choices] == [0, 1, 2, 3]
        assert [c.text for c in choices] == [refs[0].text] * 2 + [refs[1].text] * 2
        assert r.usage.prompt_tokens == sum(map(len, ids))
        assert r.usage.completion_tokens == 2 * sum(len(o.token_ids) for o in refs)


def test_chat_equals_offline_chat(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    ref = reference.chat(messages, greedy(10, logprobs=2), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=2)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids) == len(c.logprobs.content)
    for entry, tid, lp in zip(c.logprobs.content, ref.outputs[0].token_ids, ref.outputs[0].logprobs):
        assert entry.logprob == pytest.approx(lp[tid].logprob, abs=1e-4)
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True) and tops[0] >= entry.logprob - 1e-6
    assert r.id.startswith("chatcmpl-") and r.model == MODEL


def test_streaming_completion_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="Streaming is", max_tokens=16, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_equals_non_streamed(client, live):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say something"}], max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    # raw framing: every event is a `data:` line and the stream ends with [DONE]
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**kw, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_echo_with_zero_max_tokens_scores_the_prompt(live, reference):
    tok = reference.get_tokenizer()
    ids = tok.encode("The capital of France is Paris", add_special_tokens=False)
    ref = reference.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                             use_tqdm=False)[0].prompt_logprobs
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json()
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == tok.decode(ids) and len(lp["tokens"]) == len(ids) and r["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([ref[i][t].logprob for i, t in enumerate(ids) if i], abs=1e-4)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids))]
    # streamed, the echo (with its prompt logprobs) arrives once the prompt is scored, then the generated tokens
    with httpx.stream("POST", f"{live.url}/v1/completions", timeout=60,
                      json={**body, "max_tokens": 3, "temperature": 0, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    import json
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"].startswith(tok.decode(ids))
    streamed = [x for ch in chunks for x in ch["logprobs"]["token_logprobs"]]
    assert len(streamed) == len(ids) + 3 and streamed[1:len(ids)] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)


# ----- errors -----
def test_context_length_error_names_both_numbers(live, reference):
    n_prompt = len(reference.get_tokenizer().encode("Hello world", add_special_tokens=False))
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 300})
    msg = assert_envelope(r, 400)["message"]
    assert str(MAX_LEN) in msg and str(n_prompt + 300) in msg
    r = httpx.post(f"{live.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000})
    assert str(MAX_LEN) in assert_envelope(r, 400)["message"]


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 4 + MAX_QUEUED + 1}, 400, "n"),  # could never be admitted
    ("/v1/completions", {"prompt": ["a"] * (4 + MAX_QUEUED + 1)}, 400, "prompt"),  # nor could these together
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 2, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": ', 400, None),
    ("/v1/completions", '[1, 2]', 400, None),
    ("/v1/completions", '{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "model": "nope"}, 404, "model"),
    ("/tokenize", {}, 400, None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/no-such-route", {}, 404, None),
    # JSON types are not coerced: a string, a number or a boolean in the wrong place is the client's mistake
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": "a", "ignore_eos": "true"}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "a", "n": "2"}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 2.0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "temperature": "0.5"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [True]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [[False, True]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": "yes"}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": 1}, 400, "logprobs"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": 0}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens"),
    # a stream has no place for prompt logprobs (vLLM refuses them too)
    ("/v1/completions", {"prompt": "a", "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stream": True, "prompt_logprobs": 0},
     400, "prompt_logprobs"),
    # only the checkpoint's template (or --chat-template's) renders unless the server trusts request templates
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ 1 }}"}, 400,
     "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ 1 }}"}, 400,
     "chat_template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "chat_template_kwargs": {"tokenize": True}}, 400, "messages"),
    # prompts are bounded before they are tokenized: more characters than MAX_LEN tokens can hold
    ("/v1/completions", {"prompt": "x" * (MAX_LEN * 100)}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "x" * (MAX_LEN * 100)]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x" * (MAX_LEN * 100)}, 400, "prompt"),
    # ... and by their tokens: ids, or a text that tokenizes longer than MAX_LEN
    ("/v1/completions", {"prompt": [5] * (MAX_LEN + 1)}, 400, "prompt"),
    ("/v1/completions", {"prompt": "9 " * MAX_LEN}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "9 " * MAX_LEN}]}, 400, "messages"),
    ("/tokenize", {"prompt": "9 " * MAX_LEN}, 400, "prompt"),
    ("/detokenize", {"tokens": [5] * (MAX_LEN + 1)}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS, ids=[f"{p}-{i}" for i, (p, *_) in
                                                                       enumerate(BAD_REQUESTS)])
def test_bad_request_gets_error_envelope(live, path, body, status, param):
    if isinstance(body, str):
        r = httpx.post(live.url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(live.url + path, json=({"model": MODEL} if path.startswith("/v1") else {}) | body)
    assert_envelope(r, status, param)


def test_server_healthy_after_bad_requests(live, client):
    # runs after the error tests: none of them may have hurt the engine loop or leaked a request
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=3).usage.completion_tokens >= 1
    poll(live.idle, 10)


def test_api_key_guards_every_route_that_does_work(live):
    with TestClient(build_app(live.async_engine, MODEL, api_key="sekret")) as c:
        assert_envelope(c.get("/v1/models"), 401)
        assert_envelope(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_envelope(c.get("/v1/models", headers={"Authorization": "Basic sekret"}), 401)
        assert_envelope(c.post("/v1/completions", content="{bad json"), 401)  # auth is checked first
        # the template is never rendered without the key (and /tokenize renders templates)
        bomb = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% for i in range(99999) %}"
                "{% for j in range(99999) %}{% endfor %}{% endfor %}"}
        assert_envelope(c.post("/tokenize", json=bomb), 401)
        assert_envelope(c.post("/tokenize", json={"prompt": "hi"}), 401)
        assert_envelope(c.post("/detokenize", json={"tokens": [1]}), 401)
        assert_envelope(c.get("/v1/no-such-route"), 401)
        ok = {"Authorization": "Bearer sekret"}
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
        r = c.post("/v1/completions", headers=ok, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert c.post("/tokenize", headers=ok, json={"prompt": "hi"}).json()["count"] >= 1
        assert_envelope(c.post("/tokenize", headers=ok, json=bomb), 400, "chat_template")  # refused, not run
        # probes and the API's description stay open, as in vLLM
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        spec = c.get("/openapi.json").json()
        assert spec["components"]["securitySchemes"] == {"apiKey": {"type": "http", "scheme": "bearer"}}
        assert spec["paths"]["/tokenize"]["post"]["security"] == [{"apiKey": []}]
        assert "security" not in spec["paths"]["/health"]["get"]


def test_queue_full_returns_503_and_closed_streams_free_everything(live):
    url = f"{live.url}/v1/completions"
    finished = live.metric("vllm:request_success_total")
    body = {"model": MODEL, "prompt": "Queue up", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, contextlib.ExitStack() as streams:
        # 4 seats in the batch + MAX_QUEUED waiting; the streams stay open (generating) while we add more
        statuses = [streams.enter_context(c.stream("POST", url, json=body)).status_code for _ in range(4 + MAX_QUEUED)]
        assert statuses == [200] * (4 + MAX_QUEUED)
        full = c.post(url, json={**body, "stream": False})
        err = assert_envelope(full, 503)
        assert err["type"] == "ServiceUnavailableError" and "max_queued_requests" in err["message"]
        assert int(full.headers["Retry-After"]) >= 1
        poll(lambda: live.metric("vllm:num_requests_waiting") == MAX_QUEUED, 10)
    # closing the streams aborts all six, including the two that never got a seat
    poll(live.idle, 10)
    assert live.metric("vllm:request_success_total") == finished
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_client_disconnect_mid_stream_aborts_the_request(live):
    generated = live.metric("vllm:generation_tokens_total")
    finished = live.metric("vllm:request_success_total")
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    poll(live.idle, 10)
    assert live.metric("vllm:generation_tokens_total") - generated < 100  # stopped long before max_tokens
    assert live.metric("vllm:request_success_total") == finished  # aborted, not finished


def test_async_engine_generate_aborts_when_the_consumer_stops(live):
    generated = live.metric("vllm:generation_tokens_total")
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def close_early():
        outputs = live.async_engine.generate("Tell me more", params, "direct-close")
        async for out in outputs:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await outputs.aclose()

    async def cancel_early():
        async def consume():
            async for _ in live.async_engine.generate("Tell me more", params, "direct-cancel"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(close_early())
    asyncio.run(cancel_early())
    poll(live.idle, 10)
    assert live.metric("vllm:generation_tokens_total") - generated < 200  # neither ran to max_tokens


def test_engine_step_failure_fails_requests_not_the_server(live):
    engine, real_step, calls = live.engine, live.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = failing_step
    try:
        r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 4})
        assert "injected step failure" in assert_envelope(r, 500)["message"]
        with httpx.stream("POST", f"{live.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "boom", "max_tokens": 4, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line]
        assert '"error"' in events[0] and events[-1] == "data: [DONE]"
    finally:
        del engine.step
    poll(live.idle, 10)
    assert httpx.get(f"{live.url}/health").status_code == 200
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "fine again", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_health_is_503_without_a_running_engine_loop(live):
    with TestClient(build_app(AsyncEngine(live.engine), MODEL)) as c:  # never started
        for r in (c.get("/health"), c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})):
            assert "not running" in assert_envelope(r, 503)["message"] and int(r.headers["Retry-After"]) >= 1


# ----- vLLM's extra routes -----
def test_tokenize_detokenize_metrics(live, reference):
    tok = reference.get_tokenizer()
    r = httpx.post(f"{live.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_LEN
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{live.url}/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
    assert httpx.post(f"{live.url}/detokenize", json={"tokens": tok.encode("Hello world")}).json() == {
        "prompt": "Hello world"}
    text = httpx.get(f"{live.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket", "request_success_total"):
        assert f"vllm:{name}" in text
    assert live.metric("vllm:generation_tokens_total") > 0


def test_metrics_count_what_the_requests_did(live):
    """/metrics after two completions: the token counters equal their usage, each histogram of a request grew by
    one sample per request, every series carries the served name."""

    def scrape() -> dict:
        text = httpx.get(f"{live.url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = dict(s.labels)
                if family.name != "vllm:cache_config_info":
                    assert (labels.pop("model_name"), labels.pop("engine")) == (MODEL, "0"), s
                out[(s.name, tuple(sorted(labels.items())))] = s.value
        return out

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before[key]

    poll(live.idle, 10)
    before = scrape()
    usages = []
    for prompt, max_tokens in (("Count the tokens", 5), ("One more request, a little longer than the first", 9)):
        r = httpx.post(f"{live.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        usages.append(r.json()["usage"])
    poll(live.idle, 10)
    after = scrape()
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 5 + 9
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:iteration_tokens_total_sum") == prompt_tokens + generated
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_params_n"):
        assert delta(f"vllm:{name}_count") == 2, name
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 2
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == generated
    assert delta("vllm:request_params_max_tokens_sum") == 5 + 9
    assert after[("vllm:num_requests_running", ())] == 0 and after[("vllm:kv_cache_usage_perc", ())] == 0


def test_bench_serve_against_the_server(live):
    from qwen4exp.bench.serving import run

    result = run(live.url, None, num_prompts=3, input_len=6, output_len=4, max_concurrency=2,
                 request_rate=float("inf"), save_detailed=True)
    assert result["model_id"] == MODEL  # the server's first model
    assert (result["completed"], result["failed"], result["error_summary"]) == (3, 0, {})
    assert result["total_input_tokens"] == 3 * 6 and result["total_output_tokens"] == 3 * 4
    assert result["output_lens"] == [4, 4, 4] and all(len(itl) >= 1 for itl in result["itls"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert result[f"{stat}_{metric}_ms"] >= 0
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] >= result["median_ttft_ms"] > 0


# ----- lm-evaluation-harness -----
def test_lm_eval_loglikelihoods_equal_engine_prompt_logprobs(live, reference, tiny_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{live.url}/v1/completions", "model": MODEL, "tokenizer_backend": "huggingface",
                    "tokenizer": tiny_dir, "num_concurrent": 1, "max_retries": 1},
        tasks=["qwen4exp_tiny_mc"], task_manager=TaskManager(include_path=TASK_DIR, include_defaults=False),
        log_samples=True, batch_size=1,
    )
    tok = reference.get_tokenizer()
    pairs, got = [], []
    for sample in results["samples"]["qwen4exp_tiny_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            # lm-eval's causal encoding: tokenize context+continuation, the continuation is what follows the context
            ctx = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + continuation, add_special_tokens=False)
            pairs.append((whole, len(ctx)))
            got.append(resp[0][0])
    assert len(got) == 14
    outs = reference.generate([{"prompt_token_ids": ids} for ids, _ in pairs],
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    expected = [sum(o.prompt_logprobs[i][ids[i]].logprob for i in range(n_ctx, len(ids)))
                for o, (ids, n_ctx) in zip(outs, pairs)]
    assert all(math.isfinite(x) for x in got)
    assert got == pytest.approx(expected, abs=1e-4)
    poll(live.idle, 10)


# ----- hardening: body size, templates, the OpenAPI document, shutdown -----
def test_request_body_limit_answers_413_without_reading_the_body(live):
    url = f"{live.url}/v1/completions"
    with TestClient(build_app(live.async_engine, MODEL, max_request_body_bytes=1000)) as c:
        assert_envelope(c.post("/tokenize", json={"prompt": "x" * 2000}), 413)
        assert c.post("/tokenize", json={"prompt": "x" * 200}).status_code == 200
    big = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'  # over the default 4 MiB
    r = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert "--max-request-body-bytes" in assert_envelope(r, 413)["message"]

    def chunks():  # no Content-Length: the server counts what arrives
        for _ in range(6):
            yield b"x" * (1 << 20)

    r = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30)
    assert_envelope(r, 413)
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_request_templates_when_trusted_and_runaway_work_is_stopped(live, reference):
    tok = reference.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(build_app(live.async_engine, MODEL, trust_request_chat_template=True,
                              renderer_timeout=1.0)) as c:
        r = c.post("/tokenize", json={"messages": messages, "chat_template": "{{ messages[0].content }}!"})
        assert r.json()["tokens"] == tok.encode("hi!", add_special_tokens=False)
        r = c.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"chat_template": "<{{ x }}>",
                                                                                    "x": "hi"}})
        assert r.json()["tokens"] == tok.encode("<hi>", add_special_tokens=False)
        loops = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
        start = time.monotonic()
        r = c.post("/v1/chat/completions", json={"messages": messages, "chat_template": loops})
        assert "time limit" in assert_envelope(r, 400, "messages")["message"]
        assert time.monotonic() - start < 10  # killed at the limit, not run to the end (hours)
        r = c.post("/tokenize", json={"messages": messages, "chat_template": "{{ 'a' * 10**11 }}"})
        assert "memory" in assert_envelope(r, 400, "messages")["message"]
        # a rendering that would not fit max_model_len tokens is stopped before it is tokenized
        r = c.post("/tokenize", json={"messages": messages, "chat_template": "{{ 'a' * 10**6 }}"})
        assert "characters" in assert_envelope(r, 400, "messages")["message"]
        # the killed workers were replaced
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_runaway_template_stalls_neither_health_nor_generation(live):
    """The template runs in a worker process: the event loop answers /health and the engine generates meanwhile."""
    loops = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    with TestClient(build_app(live.async_engine, MODEL, trust_request_chat_template=True,
                              renderer_timeout=3.0)) as c:
        bomb = threading.Thread(target=c.post, args=("/tokenize",), kwargs={"json": {
            "messages": [{"role": "user", "content": "hi"}], "chat_template": loops}})
        bomb.start()
        time.sleep(0.3)
        waits = []
        while bomb.is_alive():
            start = time.monotonic()
            assert c.get("/health").status_code == 200
            waits.append(time.monotonic() - start)
            r = c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
            assert r.status_code == 200
            time.sleep(0.05)
        bomb.join()
    assert len(waits) >= 5 and sorted(waits)[len(waits) // 2] < 0.1


def test_server_chat_template_option(live, reference, tmp_path):
    from qwen4exp.entrypoints.server import load_chat_template

    tok = reference.get_tokenizer()
    path = tmp_path / "template.jinja"
    path.write_text("[{{ messages[0].content }}]")
    assert load_chat_template(str(path)) == "[{{ messages[0].content }}]"
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with TestClient(build_app(live.async_engine, MODEL, chat_template=load_chat_template(str(path)))) as c:
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["tokens"] == tok.encode("[hi]", add_special_tokens=False)


def test_openapi_documents_every_status_and_media_type(live):
    spec = httpx.get(f"{live.url}/openapi.json").json()
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/tokenize", "post"),
                         ("/detokenize", "post")]:
        responses = spec["paths"][path][method]["responses"]
        assert "422" not in responses
        for code in ("400", "404", "413"):
            assert responses[code]["content"] == error, (path, code)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "Retry-After" in responses["503"]["headers"]
    assert spec["paths"]["/health"]["get"]["responses"]["200"].get("content", {}) == {}
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    r = httpx.get(f"{live.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert "content-type" not in httpx.get(f"{live.url}/health").headers


def test_abort_all_ends_running_and_waiting_requests_with_finish_reason_abort(live):
    """What a shutdown does at --shutdown-timeout: every request still in the engine gets its last output, with
    finish_reason "abort" (the one still waiting for a seat has generated nothing)."""
    params = SamplingParams(max_tokens=240, ignore_eos=True)

    async def run():
        engine = live.async_engine
        streams = [await engine.add_request(f"abort-all-{i}", [5, 6, 7], params) for i in range(5)]  # 4 seats
        first = await streams[0].get()
        assert not first.finished
        assert await engine.abort_all() == 5
        finals = []
        for s in streams:
            async for out in engine.stream_outputs(s):
                last = out
            finals.append(last)
        return first, finals

    first, finals = asyncio.run(run())
    assert all(out.finished and out.outputs[0].finish_reason == "abort" for out in finals)
    assert len(finals[0].outputs[0].token_ids) >= len(first.outputs[0].token_ids)
    assert finals[4].outputs[0].token_ids == [] and finals[4].prompt_token_ids == [5, 6, 7]
    poll(live.idle, 10)


def test_serve_flags(capsys):
    from qwen4exp.entrypoints.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--chat-template", "t.jinja", "--trust-request-chat-template",
                                      "--max-request-body-bytes", "1000", "--renderer-num-workers", "3",
                                      "--renderer-timeout", "2.5", "--shutdown-timeout", "7"])
    assert (args.chat_template, args.trust_request_chat_template, args.max_request_body_bytes,
            args.renderer_num_workers, args.renderer_timeout, args.shutdown_timeout) == ("t.jinja", True, 1000, 3,
                                                                                         2.5, 7)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.trust_request_chat_template, defaults.max_request_body_bytes, defaults.shutdown_timeout) == (
        False, 4 << 20, 0)
    for flag, value in [("--renderer-num-workers", "0"), ("--renderer-timeout", "0"), ("--shutdown-timeout", "-1"),
                        ("--max-request-body-bytes", "0")]:
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, value])
        assert e.value.code == 2 and flag in capsys.readouterr().err
