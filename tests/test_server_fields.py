"""Every request field vLLM 0.33 accepts on /v1/completions and /v1/chat/completions does what it says, is accepted
where it cannot change the output, or is refused with a 400 naming it; and the serve options of the same kind
(--generation-config, several --served-model-name, --return-tokens-as-token-ids, --enable-request-id-headers).
The server is test_server.py's (its fixtures are imported), on the tiny random checkpoint."""

import json
import logging

import httpx
import pytest
from fastapi.testclient import TestClient
from test_server import MAX_LEN, MODEL, assert_envelope, client, live, poll, reference, tiny_dir  # noqa: F401

from qwen4exp import LLM, SamplingParams
from qwen4exp.entrypoints.async_engine import AsyncEngine
from qwen4exp.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from qwen4exp.entrypoints.server import build_app

CHAT = [{"role": "user", "content": "Tell me a story"}]


def post(live, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json={"model": MODEL, **body}, timeout=60, **kw)


def events(live, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{live.url}{path}", json={"model": MODEL, **body, "stream": True}, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


# ----- refused fields -----
# a value other than the default for every field the server refuses
REFUSED_VALUES = {
    "use_beam_search": True, "length_penalty": 0.5, "watermarking": True, "logprob_token_ids": [3],
    "logits_processors": ["my.module:Proc"], "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"x": 1}, "vllm_xargs": {"x": 1}, "repetition_detection": {"max_pattern_size": 4},
    "return_weight_versions": True, "routed_experts_prompt_start": 1, "return_token_offsets": True,
    "mm_payload": "none", "return_mm_kwargs": True, "priority": 1, "suffix": "the end", "prompt_embeds": "AAAA",
    "mm_processor_kwargs": {"fps": 1}, "media_io_kwargs": {"image": {"x": 1}}, "audio": {"voice": "alloy"},
    "web_search_options": {"search_context_size": "low"}, "verbosity": "low", "reasoning_effort": "low",
    "thinking_token_budget": 64,
}
REFUSED = ([("/v1/completions", name) for name in CompletionRequest.UNSUPPORTED]
           + [("/v1/chat/completions", name) for name in ChatCompletionRequest.UNSUPPORTED])


@pytest.mark.parametrize("path,name", REFUSED, ids=[f"{p}-{n}" for p, n in REFUSED])
def test_fields_the_server_cannot_honour_are_refused_by_name(live, path, name):
    base = {"prompt": "a"} if path == "/v1/completions" else {"messages": CHAT}
    err = assert_envelope(post(live, path, {**base, "max_tokens": 2, name: REFUSED_VALUES[name]}), 400, name)
    assert err["message"].startswith(f"{name}: not supported: ")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_refused_fields_at_their_defaults_and_fields_without_effect_are_accepted(live, path):
    base = {"prompt": "Once upon"} if path == "/v1/completions" else {"messages": CHAT}
    base |= {"max_tokens": 6, "temperature": 0}
    model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    defaults = {name: model.model_fields[name].default for name in model.UNSUPPORTED}
    accepted = {"user": "u1", "session_id": "s1", "cache_salt": "q9Zs0b3kXw", "priority": 0}
    if path == "/v1/chat/completions":
        accepted |= {"metadata": {"k": "v"}, "store": True, "service_tier": "auto", "modalities": ["text"],
                     "prediction": {"type": "content", "content": "abc"}}
    plain = post(live, path, base).json()
    r = post(live, path, {**base, **defaults, **accepted})
    assert r.status_code == 200, r.text
    text = (lambda b: b["choices"][0]["text"]) if path == "/v1/completions" else (
        lambda b: b["choices"][0]["message"]["content"])
    assert text(r.json()) == text(plain) and r.json()["usage"] == plain["usage"]


RULES = [
    # vLLM's request validators
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/v1/completions", {"prompt": "a", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"prompt": "a", "cache_salt": "a/b"}, "cache_salt"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": ["a"] * 1025, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": -2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/completions", {"prompt": "a", "best_of": 2}, "best_of"),
    # the fields this server implements, given values they cannot take
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": MAX_LEN + 1}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "truncation_side": "middle"}, "truncation_side"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "a", "bad_words": [" "]}, "bad_words"),
    ("/v1/completions", {"prompt": "a", "bad_words": ["x"] * 129}, "bad_words"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_interval": 0}, "stream_interval"),
    ("/v1/completions", {"prompt": "a", "request_id": "x" * 257}, "request_id"),
    ("/v1/chat/completions", {"messages": CHAT, "documents": [{"title": 1}]}, "documents"),
]


@pytest.mark.parametrize("path,body,param", RULES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(RULES)])
def test_vllm_request_rules_are_400s_naming_the_field(live, path, body, param):
    assert_envelope(post(live, path, body), 400, param)


def test_unknown_fields_are_logged_once_and_have_no_effect(live, caplog):
    body = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0}
    plain = post(live, "/v1/completions", body).json()
    with caplog.at_level(logging.WARNING, logger="qwen4exp"):
        first = post(live, "/v1/completions", {**body, "frobnicate_level": 3}).json()
        again = post(live, "/v1/completions", {**body, "frobnicate_level": 4}).json()
    assert first["choices"][0]["text"] == again["choices"][0]["text"] == plain["choices"][0]["text"]
    warnings = [r.getMessage() for r in caplog.records if "frobnicate_level" in r.getMessage()]
    assert len(warnings) == 1 and "no effect" in warnings[0]


# ----- implemented fields -----
def test_allowed_token_ids_and_bad_words_equal_offline(live, reference):
    allowed = list(range(100, 160))
    for path, body in [("/v1/completions", {"prompt": "Once upon a time"}), ("/v1/chat/completions",
                                                                               {"messages": CHAT})]:
        r = post(live, path, {**body, "max_tokens": 8, "temperature": 1.0, "seed": 4, "ignore_eos": True,
                              "allowed_token_ids": allowed, "return_token_ids": True}).json()
        assert set(r["choices"][0]["token_ids"]) <= set(allowed)
    tok = reference.get_tokenizer()
    ids = tok.encode("Once upon a time", add_special_tokens=False)
    base = reference.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    word = tok.decode(base[2:4])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=[word, "the"])
    want = reference.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    r = post(live, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                       "bad_words": [word, "the"], "return_token_ids": True}).json()
    assert r["choices"][0]["token_ids"] == want.token_ids != base
    assert r["choices"][0]["text"] == want.text


def test_truncate_prompt_tokens_equals_sending_the_truncated_prompt(live, reference):
    tok = reference.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 20
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}

    def completion(prompt, **kw):
        return post(live, "/v1/completions", {**body, "prompt": prompt, **kw}).json()

    for side, kept in [(None, ids[-10:]), ("left", ids[-10:]), ("right", ids[:10])]:
        want = completion(kept)
        for prompt in (text, ids):
            got = completion(prompt, truncate_prompt_tokens=10, truncation_side=side)
            assert got["usage"] == want["usage"] and got["usage"]["prompt_tokens"] == 10
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
    echoed = completion(text, truncate_prompt_tokens=10, echo=True)["choices"][0]["text"]
    assert echoed == tok.decode(ids[-10:]) + completion(ids[-10:])["choices"][0]["text"]
    # -1: as many as max_model_len allows, leaving room for one token, however long the prompt
    long = [5, 6, 7] * MAX_LEN
    got = completion(long, truncate_prompt_tokens=-1, max_tokens=1)
    assert got["usage"]["prompt_tokens"] == MAX_LEN - 1
    assert got["choices"][0]["text"] == completion(long[-(MAX_LEN - 1):], max_tokens=1)["choices"][0]["text"]
    # chat: the rendered conversation's last tokens
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    got = post(live, "/v1/chat/completions", {**body, "messages": CHAT, "truncate_prompt_tokens": 6}).json()
    assert got["usage"]["prompt_tokens"] == 6
    assert got["choices"][0]["message"]["content"] == completion(list(rendered[-6:]))["choices"][0]["text"]


def test_return_token_ids_streamed_and_not(live, reference):
    tok = reference.get_tokenizer()
    prompt = "Once upon a time"
    ids = tok.encode(prompt, add_special_tokens=False)
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = post(live, "/v1/completions", {**body, "prompt": prompt}).json()["choices"][0]
    assert full["prompt_token_ids"] == ids and len(full["token_ids"]) == 8
    assert tok.decode(full["token_ids"]) == full["text"]
    chunks = [c["choices"][0] for c in events(live, "/v1/completions", {**body, "prompt": prompt})]
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == full["token_ids"]

    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    chat = post(live, "/v1/chat/completions", {**body, "messages": CHAT}).json()
    assert chat["prompt_token_ids"] == list(rendered) and len(chat["choices"][0]["token_ids"]) == 8
    streamed = events(live, "/v1/chat/completions", {**body, "messages": CHAT})
    assert streamed[0]["prompt_token_ids"] == list(rendered)
    assert [t for c in streamed[1:] for t in c["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]
    plain = post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_return_tokens_as_token_ids(live):
    r = post(live, "/v1/completions", {"prompt": "Once upon", "max_tokens": 4, "temperature": 0, "logprobs": 2,
                                       "return_tokens_as_token_ids": True, "return_token_ids": True}).json()
    c = r["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(all(k.startswith("token_id:") for k in top) for top in c["logprobs"]["top_logprobs"])
    with TestClient(build_app(live.async_engine, MODEL, return_tokens_as_token_ids=True)) as tc:
        body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1,
                "return_token_ids": True}
        chat = tc.post("/v1/chat/completions", json=body).json()["choices"][0]
        content = chat["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in chat["token_ids"]]
        assert all(e["top_logprobs"][0]["token"].startswith("token_id:") for e in content)
        own = tc.post("/v1/chat/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        assert not own["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")


def test_stream_interval_groups_tokens(live):
    body = {"prompt": "Once upon", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = post(live, "/v1/completions", body).json()["choices"][0]
    chunks = [c["choices"][0] for c in events(live, "/v1/completions", {**body, "stream_interval": 4})]
    sizes = [len(c["token_ids"]) for c in chunks]
    # the first chunk goes out with the first text, the rest in groups of at least 4, the last with the end
    assert all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 10 and len(sizes) <= 4
    assert "".join(c["text"] for c in chunks) == full["text"]


def test_request_ids_and_the_x_request_id_header(live):
    body = {"prompt": "hi", "max_tokens": 2}
    assert post(live, "/v1/completions", {**body, "request_id": "mine"}).json()["id"] == "cmpl-mine"
    r = post(live, "/v1/completions", {**body, "request_id": "mine"}, headers={"X-Request-Id": "hdr-1"})
    assert r.json()["id"] == "cmpl-hdr-1" and "x-request-id" not in r.headers
    again = post(live, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, headers={"X-Request-Id": "hdr-1"})
    assert again.json()["id"] == "chatcmpl-hdr-1"  # reused ids are the client's business
    with TestClient(build_app(live.async_engine, MODEL, enable_request_id_headers=True)) as tc:
        r = tc.post("/v1/completions", json=body, headers={"X-Request-Id": "hdr-2"})
        assert r.headers["x-request-id"] == "hdr-2" and r.json()["id"] == "cmpl-hdr-2"
        generated = tc.post("/v1/completions", json=body).headers["x-request-id"]
        assert len(generated) == 32 and int(generated, 16) >= 0
        with tc.stream("POST", "/v1/completions", json={**body, "stream": True},
                       headers={"X-Request-Id": "hdr-3"}) as s:
            assert s.headers["x-request-id"] == "hdr-3"
        assert tc.get("/health").headers["x-request-id"]


def test_continue_final_message_add_generation_prompt_and_echo(live, reference):
    tok = reference.get_tokenizer()
    msgs = CHAT + [{"role": "assistant", "content": "Once upon"}]
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = post(live, "/v1/chat/completions", {**body, "continue_final_message": True, "echo": True}).json()
    continued = tok.apply_chat_template(msgs, continue_final_message=True, tokenize=True, return_dict=False)
    assert r["usage"]["prompt_tokens"] == len(continued)
    want = post(live, "/v1/completions", {"prompt": list(continued), "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True}).json()["choices"][0]["text"]
    assert r["choices"][0]["message"]["content"] == "Once upon" + want
    r = post(live, "/v1/chat/completions", {**body, "add_generation_prompt": False}).json()
    plain = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=True, return_dict=False)
    assert r["usage"]["prompt_tokens"] == len(plain) != len(continued)


def test_max_completion_tokens_wins_over_max_tokens(live):
    r = post(live, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 9, "max_completion_tokens": 3,
                                            "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"


def test_documents_reach_the_template_and_prompt_text_comes_back(live):
    template = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[-1].content }}"
    body = {"messages": CHAT, "max_tokens": 2, "chat_template": template, "return_prompt_text": True,
            "documents": [{"title": "a", "text": "first"}, {"title": "b", "text": "second"}]}
    with TestClient(build_app(live.async_engine, MODEL, trust_request_chat_template=True)) as tc:
        r = tc.post("/v1/chat/completions", json=body).json()
        assert r["prompt_text"] == "[a: first][b: second]Tell me a story"
        with tc.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            first = json.loads(next(line for line in s.iter_lines() if line.startswith("data: "))[6:])
        assert first["prompt_text"] == r["prompt_text"]


def test_continuous_usage_stats(live):
    body = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(live, "/v1/completions", body)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1]["usage"]["completion_tokens"] == 4


def test_several_served_model_names(live):
    with TestClient(build_app(live.async_engine, ["first", "second"])) as tc:
        assert [m["id"] for m in tc.get("/v1/models").json()["data"]] == ["first", "second"]
        r = tc.post("/v1/completions", json={"model": "second", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "first"
        assert_envelope(tc.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 404, "model")


def test_openapi_documents_the_new_fields(live):
    schemas = httpx.get(f"{live.url}/openapi.json").json()["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    assert completion["allowed_token_ids"]["anyOf"][0] == {"type": "array", "items": {"type": "integer"}}
    assert completion["bad_words"]["type"] == "array" and completion["bad_words"]["items"] == {"type": "string"}
    for name in ("truncate_prompt_tokens", "truncation_side", "return_token_ids", "use_beam_search", "priority",
                 "request_id", "add_special_tokens", "best_of", "prompt_embeds"):
        assert name in completion, name
    for name in ("continue_final_message", "documents", "max_completion_tokens", "return_prompt_text", "store",
                 "metadata", "modalities", "mm_processor_kwargs", "allowed_token_ids"):
        assert name in chat, name


def test_generation_config_and_add_special_tokens(tiny_dir, tmp_path):
    """A model whose generation_config.json sets sampling defaults: requests that leave a field unset get the
    model's value, those that set it their own; offline `LLM` does the same. The tokenizer here adds a BOS token, so
    add_special_tokens shows (on for completions, off for chat, as vLLM)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[
        ("<|endoftext|>", bos)])
    kw = dict(dtype="float32", device="cpu", max_model_len=MAX_LEN, num_pages=80, page_size=16)
    llm = LLM(tiny_dir, tokenizer=tok, generation_config=str(tmp_path), **kw)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
    ids = tok.encode("Once upon", add_special_tokens=False)
    greedy = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    defaulted = llm.generate({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs[0]
    assert defaulted.token_ids == greedy.token_ids[: len(defaulted.token_ids)]
    vllm_defaults = LLM(tiny_dir, tokenizer=tok, generation_config="vllm", **kw).get_default_sampling_params()
    assert vllm_defaults == SamplingParams()
    seeded = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=1.0, seed=3, max_tokens=6,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    engine = AsyncEngine(llm.llm_engine).start()
    try:
        with TestClient(build_app(engine, MODEL)) as tc:
            def completion(**body):
                r = tc.post("/v1/completions", json={"prompt": ids, "ignore_eos": True, **body})
                assert r.status_code == 200, r.text
                return r.json()

            assert completion(max_tokens=5)["choices"][0]["text"] == greedy.text  # temperature 0 by default
            assert completion(max_tokens=6, temperature=1.0, seed=3)["choices"][0]["text"] == seeded.text
            assert completion()["usage"]["completion_tokens"] == 16  # completions' own default max_tokens
            chat = tc.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True}).json()
            assert chat["usage"]["completion_tokens"] == 5  # the generation config's max_new_tokens
            chat = tc.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True, "max_tokens": 7})
            assert chat.json()["usage"]["completion_tokens"] == 7
            # add_special_tokens: the BOS token on completions' text prompts by default, not on chat's
            n = len(ids)
            assert completion(prompt="Once upon", max_tokens=1)["usage"]["prompt_tokens"] == n + 1
            assert completion(prompt="Once upon", max_tokens=1, add_special_tokens=False)["usage"][
                "prompt_tokens"] == n
            rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
            for flag, extra in ((False, 0), (True, 1)):
                body = {"messages": CHAT, "max_tokens": 1, "add_special_tokens": flag, "return_token_ids": True}
                r = tc.post("/v1/chat/completions", json=body).json()
                assert r["prompt_token_ids"] == [bos] * extra + list(rendered)
    finally:
        engine.shutdown()
