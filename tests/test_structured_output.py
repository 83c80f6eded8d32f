"""Structured output (StructuredOutputsParams, response_format) on the tiny random model. Its free output is random
text, so every valid output below is the grammar's doing: JSON schemas (nested objects, required fields, enums,
arrays with min/max items, integer ranges), regex, choice, EBNF grammars, any JSON object and tool-call schemas, over
many seeds, each output checked against its constraint by an independent validator and finished by the grammar
("stop"). Constrained and free requests share batches without changing the free ones' tokens, with asynchronous
scheduling (deferred sampling) and through preemption; n > 1 gives each sequence its own matcher; the server
compiles grammars before the engine sees them and answers invalid ones with a 400 naming the field."""

import dataclasses
import json
import math
import re
from typing import Literal

import httpx
import jsonschema_rs
import openai
import pytest
import torch
from helpers import serve_on_loopback
from pydantic import BaseModel, Field

from qwen4exp import LLM, SamplingParams, StructuredOutputsParams
from qwen4exp.config import EngineConfig, load_model_config
from qwen4exp.engine.engine import LLMEngine
from qwen4exp.engine.request import StructuredOutputsError
from qwen4exp.engine.structured_output import StructuredOutputs, choice_grammar
from qwen4exp.entrypoints.async_engine import AsyncEngine
from qwen4exp.entrypoints.protocol import RequestError
from qwen4exp.entrypoints.server import build_app
from qwen4exp.entrypoints.tool_schema import tool_call_constraint
from qwen4exp.weights.random_checkpoint import make_random

SEEDS = range(6)  # per constraint kind; every output is checked, so these already test a thousand constrained tokens

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["a", "b"]},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
    "pos": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                             "ok": {"type": "boolean"}}, "required": ["x", "ok"]}},
    "required": ["id", "kind", "tags", "pos"]}
INTS = {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4}
REGEX = r"(0|[1-9][0-9]{0,2})\.[0-9]{2} (EUR|USD)"
CHOICES = ["red", "green", 'dark "gray"', "café\n"]
GRAMMAR = 'root ::= "[" num ("," " "? num){0,2} "]"\nnum ::= "-"? [1-9] [0-9]{0,2}'
GRAMMAR_AS_REGEX = r"\[-?[1-9][0-9]{0,2}(, ?-?[1-9][0-9]{0,2}){0,2}\]"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"]}}},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_random(str(tmp_path_factory.mktemp("tiny")), "tiny", dtype="float32", seed=3)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=256, num_pages=512, page_size=8,
               max_num_seqs=64, max_num_batched_tokens=1024)


def token_id(llm, text: str) -> int:
    (tid,) = llm.get_tokenizer().encode(text, add_special_tokens=False)
    return tid


def cases(llm) -> list[tuple[str, str, SamplingParams]]:
    """(kind, prompt, params) of the property batch: every constraint kind over SEEDS, sampled at temperature 1."""
    compact = dict(disable_any_whitespace=True)
    constraints = {
        "record": (StructuredOutputsParams(json=RECORD, **compact), {}),
        "ints": (StructuredOutputsParams(json=json.dumps(INTS)), {}),  # any whitespace, the schema as text
        "regex": (StructuredOutputsParams(regex=REGEX), {}),
        "choice": (StructuredOutputsParams(choice=CHOICES), {}),
        "grammar": (StructuredOutputsParams(grammar=GRAMMAR), {}),
        # any object: its strings have no bound, so a bias towards `"` keeps them short; the bias does not make
        # anything valid, the grammar does
        "json_object": (StructuredOutputsParams(json_object=True, **compact),
                        {"logit_bias": {token_id(llm, '"'): 5.0}}),
    }
    out = []
    for kind, (so, extra) in constraints.items():
        for seed in SEEDS:
            out.append((kind, f"{kind} {seed}:", SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                                                structured_outputs=so, **extra)))
    tools = dataclasses.replace(tool_call_constraint(TOOLS, "required", parallel_tool_calls=False), **compact)
    for seed in SEEDS[:3]:
        out.append(("tools", f"call {seed}", SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                                           structured_outputs=tools)))
    for seed in SEEDS[:1]:  # three sequences, one matcher each
        out.append(("record", f"n {seed}", SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=160,
                                                          structured_outputs=constraints["record"][0])))
    return out


def check(kind: str, text: str) -> None:
    """Raises unless `text` satisfies the constraint `kind` (validators independent of xgrammar)."""
    if kind in ("record", "ints"):
        jsonschema_rs.validate(RECORD if kind == "record" else INTS, json.loads(text))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(GRAMMAR_AS_REGEX, text), text
    elif kind == "tools":
        calls = json.loads(text)
        jsonschema_rs.validate(tool_call_constraint(TOOLS, "required", False).json, calls)
        (call,) = calls
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
        jsonschema_rs.validate(schema, call["parameters"])
    else:
        raise AssertionError(kind)


@pytest.fixture(scope="module")
def property_run(llm):
    batch = cases(llm)
    outs = llm.generate([p for _, p, _ in batch], [sp for *_, sp in batch], use_tqdm=False)
    return batch, outs


# ----- the engine -----
def test_every_output_satisfies_its_constraint_and_ends_by_its_grammar(llm, property_run):
    batch, outs = property_run
    eos = set(llm.llm_engine.eos_token_ids)
    for (kind, prompt, params), out in zip(batch, outs):
        assert len(out.outputs) == params.n
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, prompt, c.text)
            assert c.token_ids[-1] in eos  # the grammar allowed a stop token only where it could end
            check(kind, c.text)
    texts = {kind: {c.text for (k, *_), o in zip(batch, outs) if k == kind for c in o.outputs}
             for kind, *_ in batch}
    assert all(len(t) > 1 for t in texts.values()), "the seeds must give different outputs"
    for (kind, prompt, params), out in zip(batch, outs):
        if params.n > 1:  # sibling sequences sample apart, each under its own matcher
            assert len({c.text for c in out.outputs}) > 1
    engine = llm.llm_engine
    assert engine.cache.all_free() and not engine.scheduler.running


def test_free_requests_are_untouched_by_constrained_ones_in_their_batch(llm, tiny_dir, monkeypatch):
    """Greedy free requests give the same tokens with and without constrained requests in their batches, in the
    synchronous engine and with asynchronous scheduling (where a constrained row waits for its previous id: its
    sampling is deferred until the step before is read); the constrained outputs are the same in both engines,
    and a batch without a constrained request fills no bitmask."""
    free = [(f"free prompt {i} " * (i + 1), SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
            for i in range(3)]
    constrained = [(f"constrained {i}", SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=so))
                   for i, so in enumerate([StructuredOutputsParams(grammar=GRAMMAR),
                                           StructuredOutputsParams(regex=REGEX),
                                           StructuredOutputsParams(choice=CHOICES)])]
    mixed = [free[0], constrained[0], free[1], constrained[1], constrained[2], free[2]]
    fills = []
    bitmask = StructuredOutputs.bitmask
    monkeypatch.setattr(StructuredOutputs, "bitmask", lambda self, *a: fills.append(len(a[0])) or bitmask(self, *a))

    def run(engine_llm, requests):
        outs = engine_llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]

    alone = run(llm, free)
    assert fills == []
    together = run(llm, mixed)
    assert fills and max(fills) <= 3
    assert [together[i] for i in (0, 2, 5)] == alone
    async_llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=256, num_pages=256, page_size=8,
                    max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=True)
    deferred = []
    launch = async_llm.llm_engine._launch
    monkeypatch.setattr(async_llm.llm_engine, "_launch",
                        lambda *a: (lambda step: deferred.append(step.to_sample is not None) or step)(launch(*a)))
    assert run(async_llm, mixed) == together
    assert sum(deferred) > 5, "decode steps of constrained rows must defer their sampling, not drain the pipeline"
    for (prompt, params), (ids, reason) in zip(mixed, together):
        if params.structured_outputs is not None:
            kind = params.structured_outputs.kind
            assert reason == "stop"
            check(kind, llm.get_tokenizer().decode(ids, skip_special_tokens=True))


def test_grammar_and_token_bans_apply_together(llm, tiny_dir):
    """A row under a grammar also keeps its allowed_token_ids and bad words: every token follows both. The outputs
    are the same with asynchronous scheduling (deferred sampling; a multi-token bad word turns the overlap off), and
    no sampler state outlives its request."""
    tok = llm.get_tokenizer()
    a, b, c, d = (token_id(llm, ch) for ch in "abcd")
    eos = llm.llm_engine.eos_token_ids
    so = StructuredOutputsParams(regex="[a-e]{6}")
    sampled = dict(n=2, temperature=1.0, seed=4, max_tokens=20, structured_outputs=so)
    requests = [("allowed", SamplingParams(allowed_token_ids=[a, c, *eos], **sampled)),
                ("one-token words", SamplingParams(bad_words=["b", "d"], **sampled)),
                ("a word of two tokens", SamplingParams(bad_words_token_ids=[[c, a]], **sampled))]

    def run(engine_llm):
        outs = engine_llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
        sampler = engine_llm.llm_engine.sampler
        assert not sampler.request_generators and not sampler.masks
        return [[(o.token_ids, o.finish_reason) for o in out.outputs] for out in outs]

    sync = run(llm)
    async_llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=256, num_pages=256, page_size=8,
                    max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=True)
    assert run(async_llm) == sync
    allowed, words, pair = sync
    for outs in sync:
        for ids, reason in outs:
            assert reason == "stop" and re.fullmatch("[a-e]{6}", tok.decode(ids, skip_special_tokens=True)), ids
    assert all(set(ids) <= {a, c, *eos} for ids, _ in allowed)
    assert all(b not in ids and d not in ids for ids, _ in words)
    assert all(not any(ids[i:i + 2] == [c, a] for i in range(len(ids))) for ids, _ in pair)


def test_preemption_keeps_each_matcher_on_its_sequence(tiny_dir, llm, property_run):
    """A cache too small for the batch preempts and recomputes constrained sequences (asynchronous scheduling: some
    are preempted with a token in flight); their outputs equal the unpreempted run's."""
    batch, outs = property_run
    picked = [(b, o) for b, o in zip(batch, outs) if b[0] in ("record", "ints") and b[2].n == 1]
    picked = picked[:2] + picked[-2:]
    small = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=96, num_pages=14, page_size=8,
                max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=True)
    again = small.generate([p for (_, p, _), _ in picked],
                           [dataclasses.replace(sp, max_tokens=80) for (*_, sp), _ in picked], use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    for ((kind, prompt, _), before), after in zip(picked, again):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids, prompt
    assert small.llm_engine.cache.all_free()


def test_logprobs_are_those_of_the_masked_logits(llm):
    """As in vLLM, the grammar mask applies before the sampler: a constrained row's logprobs are normalised over
    the ids its grammar allows (here every allowed id is in the top 20), and a forbidden id has logprob -inf."""
    so = StructuredOutputsParams(choice=["red", "green", "blue"])
    (out,) = llm.generate(["pick:"], SamplingParams(temperature=1.0, seed=5, logprobs=20, structured_outputs=so,
                                                   max_tokens=20), use_tqdm=False)
    c = out.outputs[0]
    assert c.text in ("red", "green", "blue") and c.finish_reason == "stop"
    tok = llm.get_tokenizer()
    for position, entry in enumerate(c.logprobs):
        allowed = [t for t, lp in entry.items() if lp.logprob > -math.inf]
        assert math.isclose(sum(math.exp(entry[t].logprob) for t in allowed), 1.0, rel_tol=1e-4)
        assert len(allowed) < len(entry)  # the top 20 reach forbidden ids, at -inf
        if position < len(c.logprobs) - 1:  # the last is the stop id, the only one allowed there
            so_far = tok.decode(c.token_ids[:position], skip_special_tokens=True)
            for t in allowed:
                text = so_far + tok.decode([t])
                assert any(choice.startswith(text) for choice in ("red", "green", "blue")), text
        else:
            assert set(allowed) <= set(llm.llm_engine.eos_token_ids)
    (free,) = llm.generate(["pick:"], SamplingParams(temperature=1.0, seed=5, logprobs=20, max_tokens=1),
                           use_tqdm=False)
    assert all(lp.logprob > -math.inf for lp in free.outputs[0].logprobs[0].values())


def test_a_grammar_that_allows_nothing_ends_its_sequence_with_error(llm):
    """min_tokens bans the stop ids where the grammar may only stop: the row allows no id, so its sample cannot
    follow the grammar, and the sequence ends (as in vLLM) with finish_reason "error"; the engine goes on."""
    so = StructuredOutputsParams(choice=["ab"])
    bad, good = llm.generate(["x", "y"], [SamplingParams(min_tokens=8, max_tokens=20, structured_outputs=so),
                                         SamplingParams(max_tokens=20, structured_outputs=so)], use_tqdm=False)
    assert good.outputs[0].text == "ab" and good.outputs[0].finish_reason == "stop"
    ids = bad.outputs[0].token_ids
    assert bad.outputs[0].finish_reason == "error"
    # the grammar's ids, then the one sampled where it allowed nothing
    assert llm.get_tokenizer().decode(ids[:-1]) == "ab" and ids[-1] not in llm.llm_engine.eos_token_ids
    assert llm.llm_engine.cache.all_free()


def test_abort_frees_the_matchers(llm):
    engine = llm.llm_engine
    so = StructuredOutputsParams(json=RECORD, disable_any_whitespace=True)
    engine.add_request("a", "abort me", SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=100,
                                                      structured_outputs=so))
    children = list(engine.output_processor.parents["a"].children)
    assert all(r.grammar is not None for r in children) and children[0].grammar is not children[1].grammar
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    assert all(r.grammar is None for r in children)
    assert not engine.has_unfinished_requests() and engine.cache.all_free()


@pytest.mark.parametrize("kw,field", [
    (dict(json={"type": "objekt"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar='root ::= "a" | '), "structured_outputs.grammar"),
    (dict(grammar='start ::= "a"'), "structured_outputs.grammar"),
])
def test_invalid_constraints_are_refused_at_admission_naming_the_field(llm, kw, field):
    engine = llm.llm_engine
    with pytest.raises(StructuredOutputsError) as e:
        engine.add_request("bad", "x", SamplingParams(structured_outputs=StructuredOutputsParams(**kw)))
    assert e.value.field == field and str(e.value).startswith(field + ": ")
    assert "/project/" not in str(e.value)  # xgrammar's source location is not the user's business
    assert not engine.has_unfinished_requests() and "bad" not in engine.output_processor.parents


@pytest.mark.parametrize("kw,field", [
    (dict(), "structured_outputs"),
    (dict(json={"type": "object"}, regex="a"), "structured_outputs"),
    (dict(json=3), "structured_outputs.json"),
    (dict(json={"a": {1, 2}}), "structured_outputs.json"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", 1]), "structured_outputs.choice"),
    (dict(grammar=" "), "structured_outputs.grammar"),
    (dict(json_object=False), "structured_outputs.json_object"),
    (dict(regex="a", disable_any_whitespace=1), "structured_outputs.disable_any_whitespace"),
])
def test_params_validation_names_the_field(kw, field):
    with pytest.raises(StructuredOutputsError) as e:
        StructuredOutputsParams(**kw)
    assert e.value.field == field
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_mask_sets_exactly_the_forbidden_ids_padding_and_special_tokens_included(llm):
    """The bitmask over a model vocabulary padded past the tokenizer's (600 > 512 ids) masks what xgrammar's own
    kernel masks; padded ids and special tokens are never allowed, stop ids only at the end; rows outside the
    constrained ones are untouched."""
    import xgrammar as xgr

    tok = llm.get_tokenizer()
    so = StructuredOutputs(tok, 600, 4, "cpu", [511])
    m_string = so.matcher(so.compile(StructuredOutputsParams(json={"type": "string"})), [])
    m_end = so.matcher(so.compile(StructuredOutputsParams(choice=["ab"])), [])
    assert m_string.accept_string('"') and m_end.accept_string("ab")
    logits = torch.randn(4, 600)
    for rows, batch in (([1, 3], 4), ([0, 1], 2)):  # two rows of four constrained; every row of a batch of two
        mask = so.bitmask(rows, [m_string, m_end], batch)
        ours = logits[:batch].clone()
        mask.apply(ours)
        full = torch.full((batch, mask.bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = mask.bitmask
        want = logits[:batch].clone()
        xgr.apply_token_bitmask_inplace(want, full, indices=rows)
        assert torch.equal(ours, want)
        untouched = [r for r in range(batch) if r not in rows]
        assert torch.equal(ours[untouched], logits[untouched])
    in_string, at_end = ({i for i in range(600) if ours[r, i] > -math.inf} for r in rows)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert in_string and max(in_string) < 512 and not in_string & special
    assert at_end == {511}  # "ab" is complete: only the stop id
    assert choice_grammar(['a"b', "é\n"]) == 'root ::= "a\\"b" | "é\\n"'


def test_engine_without_tokenizer_refuses_constraints(tiny_dir):
    engine = LLMEngine(None, EngineConfig(dtype="float32", device="cpu", max_model_len=64, num_pages=16,
                                          load_format="dummy"), model_config=load_model_config(tiny_dir))
    assert engine.tokenizer is None
    with pytest.raises(StructuredOutputsError, match="tokenizer"):
        engine.add_request("x", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))


# ----- tool calls -----
def test_tool_call_constraint_follows_vllm():
    required = tool_call_constraint(TOOLS, "required").json
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    names = [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["add"]]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == TOOLS[1]["function"]["parameters"]
    assert tool_call_constraint(TOOLS, "required", parallel_tool_calls=False).json["maxItems"] == 1
    named = tool_call_constraint(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.json == TOOLS[1]["function"]["parameters"]
    for choice in ("none", "auto", None):
        assert tool_call_constraint(TOOLS, choice) is None
    assert tool_call_constraint(None, "required") is None
    # no parameters: an empty object; $defs move to the array, where every tool's $ref reaches them
    defs = {"City": {"enum": ["Paris"]}}
    tools = [{"type": "function", "function": {"name": "ping"}},
             {"type": "function", "function": {"name": "go", "parameters": {
                 "type": "object", "properties": {"to": {"$ref": "#/$defs/City"}}, "$defs": defs}}}]
    schema = tool_call_constraint(tools, "required").json
    assert schema["$defs"] == defs and "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "$defs" in tools[1]["function"]["parameters"]  # the request's tools are left as they were
    jsonschema_rs.validate(schema, [{"name": "go", "parameters": {"to": "Paris"}}, {"name": "ping", "parameters": {}}])
    assert not jsonschema_rs.is_valid(schema, [{"name": "go", "parameters": {"to": "Rome"}}])
    assert not jsonschema_rs.is_valid(schema, [])


@pytest.mark.parametrize("tools,choice,param", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    ([{"type": "web_search"}], "required", "tool_choice"),
    ([{"type": "function", "function": {}}], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$defs": {"A": {"type": "integer"}}}}},
      {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"A": {"type": "string"}}}}}],
     "required", "tools"),
])
def test_tool_call_constraint_errors_name_the_field(tools, choice, param):
    with pytest.raises(RequestError) as e:
        tool_call_constraint(tools, choice)
    assert e.value.param == param


# ----- the server -----
@pytest.fixture(scope="module")
def server(tiny_dir):
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=8,
                                              max_num_batched_tokens=256, num_pages=256, page_size=8))
    async_engine = AsyncEngine(engine).start()
    app = build_app(async_engine, "tiny", max_model_len=256)
    with serve_on_loopback(app) as url:
        yield url, engine
    async_engine.shutdown()


class Reading(BaseModel):
    unit: Literal["C", "F"]
    value: int = Field(ge=-40, le=40)
    ok: bool


def test_openai_parse_returns_the_pydantic_object(server):
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "Report a reading."}], response_format=Reading,
            temperature=1.0, seed=seed, max_completion_tokens=160)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Reading)
        assert choice.message.parsed == Reading.model_validate_json(choice.message.content)
    assert engine.cache.all_free()


def test_structured_outputs_field_and_json_object_on_both_routes(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={
        "prompt": "Price:", "max_tokens": 40, "temperature": 1.0, "seed": 1, "n": 2,
        "structured_outputs": {"regex": REGEX}}, timeout=120)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert re.fullmatch(REGEX, c["text"]) and c["finish_reason"] == "stop"
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Pick a color"}], "max_tokens": 40, "temperature": 1.0,
        "structured_outputs": {"choice": CHOICES, "whitespace_pattern": r"[ ]?",
                               "disable_additional_properties": True}}, timeout=120)
    assert r.status_code == 200, r.text  # the two options vLLM's xgrammar backend leaves alone are accepted
    assert r.json()["choices"][0]["message"]["content"] in CHOICES
    r = httpx.post(f"{url}/v1/completions", json={
        "prompt": [3, 4, 5], "max_tokens": 160, "temperature": 1.0, "seed": 2, "logit_bias": {"1": 0},
        "response_format": {"type": "json_schema", "json_schema": {"name": "ints", "schema": INTS}}}, timeout=120)
    assert r.status_code == 200, r.text
    jsonschema_rs.validate(INTS, json.loads(r.json()["choices"][0]["text"]))
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "{"}], "max_tokens": 40, "response_format": {"type": "text"},
        "temperature": 0.0}, timeout=120)
    assert r.status_code == 200, r.text  # "text": no constraint


@pytest.mark.parametrize("route,body,param", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"json": {"type": 7}}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("completions", {"structured_outputs": {}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "response_format"),
    ("completions", {"structured_outputs": {"structural_tag": '{"type": "structural_tag"}'}},
     "structured_outputs.structural_tag"),
    ("chat", {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}, "response_format"),
])
def test_invalid_constraints_get_a_400_naming_the_field(server, route, body, param):
    url, engine = server
    base = ({"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"})
    r = httpx.post(f"{url}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                   json={**base, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "/project/" not in err["message"], err
    assert not engine.has_unfinished_requests()


def test_grammar_compile_past_the_time_limit_is_a_400_and_stalls_nothing(tiny_dir, monkeypatch):
    """A grammar whose compilation outlives the limit (here the limit is made tiny) is answered with a 400 while
    the engine goes on serving."""
    engine = LLMEngine(tiny_dir, EngineConfig(dtype="float32", device="cpu", max_model_len=64, num_pages=32))
    async_engine = AsyncEngine(engine).start()
    from fastapi.testclient import TestClient

    with TestClient(build_app(async_engine, "tiny", renderer_timeout=1e-4)) as client:
        big = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{2,9}"}
                                                for i in range(300)}}
        r = client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2,
                                                 "structured_outputs": {"json": big}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
        assert "time limit" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2})
        assert r.status_code == 200, r.text
    async_engine.shutdown()


# ----- the benchmark -----
def test_throughput_bench_runs_a_structured_share_at_full_length(llm):
    from qwen4exp.bench.offline import throughput

    result = throughput(llm.llm_engine, 4, 8, 6, structured_fraction=0.5)
    # the bench grammar has no end: constrained requests generate as many tokens as free ones
    assert result["num_structured"] == 2 and result["total_output_tokens"] == 4 * 6
    with pytest.raises(ValueError, match="structured_fraction"):
        throughput(llm.llm_engine, 4, 8, 6, structured_fraction=1.5)
    from qwen4exp.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "throughput", "--model", "M", "--structured-fraction", "0.25"])
    assert args.structured_fraction == 0.25
    assert build_parser().parse_args(["bench", "throughput", "--model", "M"]).structured_fraction == 0.0
