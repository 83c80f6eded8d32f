"""Tool calling and reasoning through the server: tools and tool turns rendered into the prompt, tool_choice checked
as vLLM checks it, and the engine's text turned into message.reasoning, content and tool_calls, streamed or not.

The tiny model's answers are random, so the parsers' results are checked two ways: on the server's own answers
against the same parsers applied to the offline engine's text for the same prompt, and, through the response
formatting, on scripted answers that do hold calls and reasoning. tool_choice "required" and a named function
generate under the tools' JSON schema: sampled over several seeds, the random model's every answer is valid calls."""

import json
import re

import httpx
import jsonschema_rs
import openai
import pytest
from fastapi.testclient import TestClient
from helpers import serve_on_loopback

from qwen4exp import LLM, SamplingParams
from qwen4exp.config import EngineConfig
from qwen4exp.engine.engine import LLMEngine
from qwen4exp.engine.request import CompletionOutput, RequestOutput
from qwen4exp.entrypoints.async_engine import AsyncEngine
from qwen4exp.entrypoints.openai_format import ChatParsing, Formatter
from qwen4exp.entrypoints.protocol import ChatCompletionRequest, ChatMessage
from qwen4exp.entrypoints.reasoning import Qwen3ReasoningParser
from qwen4exp.entrypoints.server import build_app
from qwen4exp.entrypoints.serving_chat import ServingChat
from qwen4exp.entrypoints.tool_parsers import HermesToolParser, Qwen3CoderToolParser
from qwen4exp.entrypoints.tool_schema import tool_call_constraint
from qwen4exp.weights.random_checkpoint import make_random

MODEL = "tiny"
MAX_LEN = 1024
LIMITS = dict(max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=1024, cpu_cache_bytes=1 << 25)
SERVER_OPTIONS = dict(tool_call_parser="hermes", reasoning_parser="qwen3", enable_auto_tool_choice=True)
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
USER = {"role": "user", "content": "What is the weather in Paris?"}
# a call, its result, and the answer: as OpenAI's clients send the conversation back
CONVERSATION = [
    {"role": "system", "content": "Be brief."}, USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C and sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    make_random(path, "tiny", dtype="float32")
    return path


@pytest.fixture(scope="module")
def engine(tiny_dir):
    async_engine = AsyncEngine(LLMEngine(tiny_dir, EngineConfig(**LIMITS, dtype="float32", device="cpu"))).start()
    yield async_engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    app = build_app(engine, MODEL, max_model_len=MAX_LEN, **SERVER_OPTIONS)
    with serve_on_loopback(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return LLM(tiny_dir, dtype="float32", device="cpu", **LIMITS)


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)


def streamed(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": MODEL, **body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def added_up(chunks: list[dict]) -> dict:
    """The message a stream's deltas add up to, checking the shape of each tool-call delta on the way."""
    message = {"content": "", "reasoning": "", "tool_calls": []}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning"] += delta.get("reasoning") or ""
            for d in delta.get("tool_calls", []):
                if d["index"] == len(message["tool_calls"]):  # a call's first delta: id, type and name
                    assert ID.fullmatch(d["id"]) and d["type"] == "function" and d["function"]["name"]
                    message["tool_calls"].append({"id": d["id"], "type": "function", "function": dict(d["function"])})
                else:
                    assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                    message["tool_calls"][d["index"]]["function"]["arguments"] += d["function"]["arguments"]
            if choice["finish_reason"] is not None:
                assert finish is None
                finish = choice["finish_reason"]
    message["content"] = message["content"] or None
    message["reasoning"] = message["reasoning"] or None
    return {"message": message, "finish_reason": finish}


def without_ids(message: dict) -> dict:
    calls = [{**c, "id": None} for c in message["tool_calls"]]
    return {"content": message["content"], "reasoning": message["reasoning"], "tool_calls": calls}


# ----- the prompt -----
def test_prompt_renders_tools_calls_and_results(url, reference):
    tok = reference.get_tokenizer()
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": CONVERSATION, "tools": TOOLS})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    for tool in TOOLS:
        assert "\n" + json.dumps(tool, ensure_ascii=False) + "\n" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n') in text
    assert ("<|im_start|>user\n<tool_response>\n18°C and sunny\n</tool_response>\n<tool_response>\nnoon\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):  # one token each
        assert ids.count(tok.convert_tokens_to_ids(tag)) == text.count(tag) >= 2
    # offline, LLM.chat(tools=...) renders the same prompt, and chat_template= replaces the template
    assert reference.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False,
                          tools=TOOLS)[0].prompt_token_ids == ids
    out = reference.chat([USER], SamplingParams(max_tokens=1), use_tqdm=False,
                         chat_template="[{{ messages[0].content }}|{{ tools[0].function.name }}]", tools=TOOLS)[0]
    assert out.prompt_token_ids == tok.encode(f"[{USER['content']}|get_weather]", add_special_tokens=False)


def test_tool_choice_none_keeps_the_tools_in_the_prompt_unless_excluded(url, engine):
    with_tools = len(httpx.post(f"{url}/tokenize", json={"messages": [USER], "tools": TOOLS}).json()["tokens"])
    without = len(httpx.post(f"{url}/tokenize", json={"messages": [USER]}).json()["tokens"])
    assert with_tools > without
    body = {"messages": [USER], "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}
    assert post(url, body).json()["usage"]["prompt_tokens"] == with_tools
    with TestClient(build_app(engine, MODEL, exclude_tools_when_tool_choice_none=True, **SERVER_OPTIONS)) as c:
        for choice, prompt_tokens in (("none", without), ("auto", with_tools)):
            r = c.post("/v1/chat/completions", json={**body, "tool_choice": choice})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == prompt_tokens, r.text


# ----- the request checks -----
BAD = [
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),  # tool_choice needs tools
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}]}, "messages"),
    # vLLM: a named function and a structured_outputs constraint exclude each other
    ({"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    # the forced call's grammar is built from the parameters: a schema it cannot compile
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}], "tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_tool_use_is_a_400_naming_the_field(url, body, param):
    r = post(url, {"messages": [USER], "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tool_choice_needs_the_server_flags(engine):
    """vLLM's rule: "auto" (the default with tools) needs --enable-auto-tool-choice and --tool-call-parser,
    "required" and named functions --tool-call-parser; "none" needs neither."""
    body = {"messages": [USER], "tools": TOOLS, "max_tokens": 2, "temperature": 0}
    with TestClient(build_app(engine, MODEL)) as c:
        for choice, flag in ((None, "--enable-auto-tool-choice"), ("required", "--tool-call-parser"),
                             (NAMED, "--tool-call-parser")):
            r = c.post("/v1/chat/completions", json=body if choice is None else {**body, "tool_choice": choice})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
            assert flag in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []
    # with a parser but without --enable-auto-tool-choice, "auto" is answered without parsing calls
    with TestClient(build_app(engine, MODEL, tool_call_parser="hermes")) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []
    with pytest.raises(ValueError, match="enable_auto_tool_choice"):
        build_app(engine, MODEL, enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        build_app(engine, MODEL, tool_call_parser="nope")


# ----- the server's answers: the parsers applied to the engine's text -----
def expected_answer(reference, messages: list[dict], tool_choice, kwargs: dict, max_tokens: int) -> dict:
    """What the server must answer: the offline engine's greedy text for the same prompt (a forced call's under the
    tools' JSON schema), through the parsers."""
    tok = reference.get_tokenizer()
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    forced = named is not None or tool_choice == "required"
    text = tok.apply_chat_template([ChatMessage.model_validate(m).for_template() for m in messages], tools=TOOLS,
                                   add_generation_prompt=True, tokenize=False, **kwargs)
    out = reference.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False)},
                             SamplingParams(temperature=0, max_tokens=max_tokens, skip_special_tokens=False,
                                            structured_outputs=tool_call_constraint(TOOLS, tool_choice)),
                             use_tqdm=False)[0]
    thinking = kwargs.get("enable_thinking", True)
    parsing = ChatParsing(reasoning=None if forced else Qwen3ReasoningParser, in_reasoning=thinking and not forced,
                          max_calls=1 if named else None, forced=forced, named=named)
    if tool_choice != "none":
        parsing.tool_parser, parsing.tools = HermesToolParser, TOOLS
    parser = parsing.new_parser()
    reasoning, content, _ = parser.feed(out.outputs[0].text, final=True)
    calls = parser.tool_calls()
    finish = out.outputs[0].finish_reason
    return {"message": {"content": content or ("" if forced else None), "reasoning": reasoning or None,
                        "tool_calls": calls},
            "finish_reason": "tool_calls" if calls and finish == "stop" and not named else finish,
            "prompt_tokens": len(out.prompt_token_ids)}


@pytest.mark.parametrize("tool_choice,kwargs", [
    ("auto", {}), ("auto", {"enable_thinking": False}), ("none", {}), ("required", {}), (NAMED, {}),
], ids=["auto", "auto-no-thinking", "none", "required", "named"])
def test_answer_is_the_engine_text_parsed(url, reference, tool_choice, kwargs):
    body = {"messages": [USER], "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 24, "temperature": 0,
            "chat_template_kwargs": kwargs}
    want = expected_answer(reference, [USER], tool_choice, kwargs, 24)
    r = post(url, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert without_ids(choice["message"]) == without_ids(want["message"])
    assert choice["finish_reason"] == want["finish_reason"]
    assert r.json()["usage"]["prompt_tokens"] == want["prompt_tokens"]
    assert all(ID.fullmatch(c["id"]) for c in choice["message"]["tool_calls"])
    stream = added_up(streamed(url, body))
    if choice["message"]["content"] == "":  # a forced call's empty content streams as nothing
        stream["message"]["content"] = ""
    assert without_ids(stream["message"]) == without_ids(choice["message"])
    assert stream["finish_reason"] == choice["finish_reason"]
    if isinstance(tool_choice, dict):  # the grammar starts the answer with the function's arguments
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
        assert choice["finish_reason"] in ("stop", "length")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        assert choice["message"]["content"] == "" and choice["message"]["reasoning"] is None


def test_a_forced_call_with_the_request_fields(url, reference):
    """return_token_ids, return_prompt_text, return_tokens_as_token_ids, request_id, stream_interval and
    truncate_prompt_tokens work on an answer that is parsed into calls."""
    tok = reference.get_tokenizer()
    body = {"messages": [USER], "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 16, "temperature": 0,
            "return_token_ids": True, "return_prompt_text": True, "logprobs": True,
            "return_tokens_as_token_ids": True, "request_id": "forced-1"}
    want = expected_answer(reference, [USER], NAMED, {}, 16)
    r = post(url, body).json()
    assert r["id"] == "chatcmpl-forced-1"
    assert r["prompt_text"].endswith(f"<|im_start|>user\n{USER['content']}<|im_end|>\n<|im_start|>assistant\n")
    assert r["prompt_token_ids"] == tok.encode(r["prompt_text"], add_special_tokens=False)
    assert len(r["prompt_token_ids"]) == want["prompt_tokens"]
    choice = r["choices"][0]
    assert without_ids(choice["message"]) == without_ids(want["message"])
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert len(choice["token_ids"]) == r["usage"]["completion_tokens"]
    chunks = streamed(url, {**body, "stream_interval": 3})
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"] and chunks[0]["prompt_text"] == r["prompt_text"]
    assert all(c["id"] == "chatcmpl-forced-1" for c in chunks)
    deltas = [c["choices"][0] for c in chunks[1:]]
    assert [t for d in deltas for t in d["token_ids"]] == choice["token_ids"]
    assert [e["token"] for d in deltas for e in d["logprobs"]["content"]] == [
        e["token"] for e in choice["logprobs"]["content"]]
    stream = added_up(chunks)
    stream["message"]["content"] = stream["message"]["content"] or ""  # a forced call's empty content
    assert without_ids(stream["message"]) == without_ids(choice["message"])
    # truncated from the left, the prompt keeps its end; the answer is still the call
    kept = post(url, {**body, "truncate_prompt_tokens": 12}).json()
    assert kept["prompt_token_ids"] == r["prompt_token_ids"][-12:]
    assert [c["function"]["name"] for c in kept["choices"][0]["message"]["tool_calls"]] == ["get_weather"]


def test_a_forced_choice_leaves_the_prompt_as_the_template_renders_it(url):
    """The grammar forces the call, not the prompt: "required" and a named function get the prompt "auto" gets,
    with a generation prompt, with a continued final message and with neither."""
    messages = [USER, {"role": "assistant", "content": "Let me check"}]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0, "return_prompt_text": True}
    for extra in ({}, {"continue_final_message": True}, {"add_generation_prompt": False}):
        auto = post(url, {**body, **extra, "tool_choice": "auto"}).json()["prompt_text"]
        for choice in ("required", NAMED):
            r = post(url, {**body, **extra, "tool_choice": choice})
            assert r.status_code == 200, r.text
            assert r.json()["prompt_text"] == auto
    continued = post(url, {**body, "continue_final_message": True, "tool_choice": "required"}).json()["prompt_text"]
    assert continued.endswith("<|im_start|>assistant\nLet me check")


# bounded values keep the random model's calls short; what makes them valid is the grammar
BOUNDED = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}, {"type": "function", "function": {"name": "get_time"}}]


def choice_stream(chunks: list[dict], index: int) -> list[dict]:
    return [{**c, "choices": [x for x in c["choices"] if x["index"] == index]} for c in chunks]


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_choice_always_answers_valid_calls(url, tool_choice):
    """Sampled at temperature 1 over several seeds, every answer is calls whose arguments follow their tool's
    parameters schema: a named function exactly one call of it (finish_reason "stop", as OpenAI's), "required" one
    call or more of the tools ("tool_calls"). The same seed streamed gives the same calls."""
    empty = {"type": "object", "additionalProperties": False}  # a tool without parameters takes {}
    schemas = {t["function"]["name"]: t["function"].get("parameters") or empty for t in BOUNDED}
    named = isinstance(tool_choice, dict)
    body = {"messages": [USER], "tools": BOUNDED, "tool_choice": tool_choice, "n": 4, "temperature": 1.0,
            "max_tokens": 400}
    answers = set()
    for seed in (0, 1):
        r = post(url, {**body, "seed": seed})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 4
        for choice in choices:
            message = choice["message"]
            assert message["content"] == "" and message["reasoning"] is None and message["tool_calls"]
            for call in message["tool_calls"]:
                assert ID.fullmatch(call["id"]) and call["type"] == "function"
                jsonschema_rs.validate(schemas[call["function"]["name"]], json.loads(call["function"]["arguments"]))
            if named:
                assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
            assert choice["finish_reason"] == ("stop" if named else "tool_calls")
            answers.add(json.dumps(without_ids(message)["tool_calls"]))
        chunks = streamed(url, {**body, "seed": seed})
        for choice in choices:
            stream = added_up(choice_stream(chunks, choice["index"]))
            assert without_ids(stream["message"]) == without_ids({**choice["message"], "content": None})
            assert stream["finish_reason"] == choice["finish_reason"]
    assert len(answers) > 2  # the samples differ: the calls are the grammar's doing, not one answer repeated


def test_reasoning_off_by_request_and_left_out(url, reference):
    body = {"messages": [USER], "max_tokens": 12, "temperature": 0}
    r = post(url, body).json()
    thinking = r["choices"][0]["message"]
    tok = reference.get_tokenizer()
    out = reference.generate({"prompt_token_ids": tok.apply_chat_template([USER], add_generation_prompt=True,
                                                                         tokenize=True, return_dict=False)},
                             SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=False),
                             use_tqdm=False)[0].outputs[0]
    parser = Qwen3ReasoningParser()
    reasoning, content = (a + b for a, b in zip(parser.feed(out.text), parser.finish()))
    assert (thinking["reasoning"], thinking["content"]) == (reasoning or None, content or None)
    vocab = tok.get_vocab()
    assert r["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": Qwen3ReasoningParser.reasoning_tokens(out.token_ids, vocab)}
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    r = post(url, {**body, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert r["choices"][0]["message"]["reasoning"] is None
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    # left out: no reasoning, and no logprobs, whose tokens would show it
    hidden = post(url, {**body, "include_reasoning": False, "logprobs": True}).json()["choices"][0]
    assert hidden["message"]["reasoning"] is None and hidden["message"]["content"] == thinking["content"]
    assert hidden["logprobs"] is None
    chunks = streamed(url, {**body, "include_reasoning": False, "logprobs": True})
    assert all("reasoning" not in c["choices"][0]["delta"] and c["choices"][0]["logprobs"] is None
               for c in chunks if c["choices"])
    usage = streamed(url, {**body, "stream_options": {"include_usage": True}})[-1]["usage"]
    assert usage["completion_tokens_details"] == {
        "reasoning_tokens": Qwen3ReasoningParser.reasoning_tokens(out.token_ids, vocab)}


# ----- the openai client -----
def test_openai_client_tool_conversation(client, url):
    first = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, max_tokens=8, temperature=0)
    assert first.id.startswith("chatcmpl-") and first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    final = client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, max_tokens=8,
                                           temperature=0, parallel_tool_calls=False)
    assert final.choices[0].message.role == "assistant" and final.choices[0].finish_reason in (
        "stop", "length", "tool_calls")
    prompt = httpx.post(f"{url}/tokenize", json={"messages": CONVERSATION, "tools": TOOLS}).json()["count"]
    assert final.usage.prompt_tokens == prompt
    # a named function: the answer is a call to it, streamed as OpenAI streams calls
    forced = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, tool_choice=NAMED,
                                            max_tokens=8, temperature=0)
    call = forced.choices[0].message.tool_calls[0]
    assert ID.fullmatch(call.id) and call.type == "function" and call.function.name == "get_weather"
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=MODEL, messages=[USER], tools=TOOLS, tool_choice=NAMED, max_tokens=8, temperature=0, stream=True)
              if c.choices]
    first_call = next(d.tool_calls[0] for d in deltas if d.tool_calls)
    assert first_call.index == 0 and ID.fullmatch(first_call.id) and first_call.function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or [])
    assert arguments == call.function.arguments


# ----- the formatting, on scripted answers -----
SCRIPTS = {
    "hermes": ('<think>The user wants the weather.</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {}}\n</tool_call>'),
    "qwen3_coder": ('<think>The user wants the weather.</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n'
                    '<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n'
                    '</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>'),
}
PARSERS = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser}


def scripted_outputs(tok, text: str, finish_reason: str) -> list[CompletionOutput]:
    """The cumulative outputs of a generation that wrote `text` token by token."""
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    return [CompletionOutput(0, tok.decode(ids[:k]), ids[:k], None, None,
                             finish_reason if k == len(ids) else None) for k in range(1, len(ids) + 1)]


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("request_fields", [{}, {"parallel_tool_calls": False}, {"include_reasoning": False}],
                         ids=["auto", "one-call", "no-reasoning"])
def test_scripted_answer_streamed_adds_up_to_the_message(engine, reference, parser, request_fields):
    tok = reference.get_tokenizer()
    serving = ServingChat(engine, None, [MODEL], MAX_LEN, tool_call_parser=parser, reasoning_parser="qwen3",
                          enable_auto_tool_choice=True)
    req = ChatCompletionRequest.model_validate({"messages": [USER], "tools": TOOLS, **request_fields})
    parsing = serving._parsing(req)
    outputs = scripted_outputs(tok, SCRIPTS[parser], "stop")
    fmt = Formatter(tok)
    out = RequestOutput("r", None, [1], None, [outputs[-1]], True)
    choice = fmt.chat_choice(req, out, outputs[-1], "", parsing=parsing)
    message = choice["message"]
    assert message["content"] == "\n\nChecking."  # what follows </think>, up to the whitespace before a call
    assert message["reasoning"] == (None if request_fields.get("include_reasoning") is False else
                                    "The user wants the weather.")
    calls = message["tool_calls"]
    want = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    if request_fields.get("parallel_tool_calls") is False:
        want = want[:1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
    assert all(ID.fullmatch(c["id"]) and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    assert choice["finish_reason"] == "tool_calls"
    state = fmt.new_stream_state()
    chunks = [{"choices": [d]} for o in outputs if (d := fmt.chat_delta(req, o, state, parsing=parsing)) is not None]
    assert len(chunks) > len(calls) + 2  # incremental: not one chunk at the end
    stream = added_up(chunks)
    assert without_ids(stream["message"]) == without_ids(message)
    assert stream["finish_reason"] == choice["finish_reason"]
    # a cut at max_tokens stays visible
    cut = scripted_outputs(tok, SCRIPTS[parser], "length")[-1]
    assert fmt.chat_choice(req, out, cut, "", parsing=parsing)["finish_reason"] == "length"


FORCED_SCRIPTS = {"required": '[{"name": "get_weather", "parameters": {"city": "Paris",\n "days": 2}}, '
                              '{"name": "get_time", "parameters": {}}]',
                  "named": '{"city": "Paris",\n "days": 2}'}


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_scripted_forced_answer_streamed_adds_up_to_the_message(engine, reference, parser, tool_choice):
    """A forced choice's answer is the JSON of its schema whatever the server's tool-call parser: the calls come
    from that JSON, with no content or reasoning; finish_reason "stop" for a named function, else "tool_calls"."""
    tok = reference.get_tokenizer()
    serving = ServingChat(engine, None, [MODEL], MAX_LEN, tool_call_parser=parser, reasoning_parser="qwen3",
                          enable_auto_tool_choice=True)
    req = ChatCompletionRequest.model_validate({"messages": [USER], "tools": TOOLS, "tool_choice": tool_choice})
    named = isinstance(tool_choice, dict)
    parsing = serving._parsing(req)
    outputs = scripted_outputs(tok, FORCED_SCRIPTS["named" if named else "required"], "stop")
    fmt = Formatter(tok)
    out = RequestOutput("r", None, [1], None, [outputs[-1]], True)
    choice = fmt.chat_choice(req, out, outputs[-1], "", parsing=parsing)
    message = choice["message"]
    assert message["content"] == "" and message["reasoning"] is None
    want = [("get_weather", {"city": "Paris", "days": 2})] + ([] if named else [("get_time", {})])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == want
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'  # json.dumps's form
    assert choice["finish_reason"] == ("stop" if named else "tool_calls")
    state = fmt.new_stream_state()
    chunks = [{"choices": [d]} for o in outputs if (d := fmt.chat_delta(req, o, state, parsing=parsing)) is not None]
    assert len(chunks) > len(want) + 2  # incremental: not one chunk at the end
    stream = added_up(chunks)
    assert without_ids(stream["message"]) == without_ids({**message, "content": None})
    assert stream["finish_reason"] == choice["finish_reason"]
    cut = scripted_outputs(tok, FORCED_SCRIPTS["named" if named else "required"], "length")[-1]
    assert fmt.chat_choice(req, out, cut, "", parsing=parsing)["finish_reason"] == "length"
