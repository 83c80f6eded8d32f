"""The tool-call parsers (hermes, qwen3_coder, and the reader of a forced tool choice's JSON) and the qwen3 reasoning
parser on model text: what they make of it, and that text streamed in pieces split anywhere (tags cut in the middle,
one character at a time) adds up to exactly what the whole text gives."""

import json
import re

import pytest

from qwen4exp.entrypoints.openai_format import ChatParsing
from qwen4exp.entrypoints.reasoning import Qwen3ReasoningParser
from qwen4exp.entrypoints.tool_parsers import (
    ForcedCallParser,
    HermesToolParser,
    Qwen3CoderToolParser,
    coerce,
    schema_types,
)

ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                     "hours": {"type": "array"}, "where": {"type": "object"},
                                     "note": {"type": ["string", "null"]}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "no_schema"}}]


def run(parser, pieces: list[str]) -> tuple[str, list[dict], list]:
    """Feed `pieces`, then finish: (content, calls, every call delta in order)."""
    content, calls, deltas = "", [], []
    for piece in [*pieces, None]:
        text, ds = parser.feed(piece) if piece is not None else parser.finish()
        content += text
        for d in ds:
            deltas.append(d)
            if d.id is not None:
                assert d.index == len(calls)
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
            else:
                assert d.name is None
                calls[d.index]["arguments"] += d.arguments
    return content, calls, deltas


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield [text[i:i + 3] for i in range(0, len(text), 3)]


def parse_everywhere(cls, text: str, tools=TOOLS) -> tuple[str, list[dict]]:
    """The whole text's result, checked against every way of streaming it (ids differ; the rest may not)."""
    content, calls, _ = run(cls(tools), [text])
    for pieces in splits(text):
        c, cs, _ = run(cls(tools), pieces)
        assert c == content, pieces
        assert [(x["name"], x["arguments"]) for x in cs] == [(x["name"], x["arguments"]) for x in calls], pieces
    return content, calls


def canonical(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


# ----- hermes -----
HERMES = ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris",  "days":3,'
          '"x":[1, 2.50, 1e2, -0, {"a":null}, true], "s":"caf\\u00e9 \\"q\\"\\n\\ud83d\\ude00"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "no_schema", "arguments": {}}\n</tool_call>')


def test_hermes_calls_content_and_canonical_arguments():
    content, calls = parse_everywhere(HermesToolParser, HERMES)
    assert content == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "no_schema"]
    args = {"city": "Paris", "days": 3, "x": [1, 2.5, 100.0, 0, {"a": None}, True], "s": 'café "q"\n😀'}
    assert json.loads(calls[0]["arguments"]) == args
    assert calls[0]["arguments"] == canonical(args)  # json.dumps's form, whatever spacing the model wrote
    assert calls[1]["arguments"] == "{}"
    assert all(ID.fullmatch(c["id"]) for c in calls) and calls[0]["id"] != calls[1]["id"]


def test_hermes_streams_arguments_as_they_arrive():
    parser = HermesToolParser(TOOLS)
    content, deltas = parser.feed('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert content == "Hi" and len(deltas) == 1
    assert (deltas[0].name, deltas[0].arguments) == ("get_weather", '{"city": "Par')
    assert ID.fullmatch(deltas[0].id)
    content, deltas = parser.feed('is"}}</tool_call>')
    assert content == "" and [(d.id, d.arguments) for d in deltas] == [(None, 'is"}')]


def test_hermes_other_key_order_is_a_call_once_the_object_ends():
    content, calls = parse_everywhere(HermesToolParser,
                                      '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>')
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Oslo"}'


@pytest.mark.parametrize("text", [
    "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>.",
    '<tool_call>{"a": 1}</tool_call> is JSON but no call',
    '<tool_call>{"name": "get_weather"}</tool_call> has no arguments',
    '<tool_call>["get_weather"]</tool_call>',
    '<tool_call>{"name": "get_weather", "argu',  # cut off before the call was certain
])
def test_hermes_text_that_is_no_call_stays_content(text):
    assert parse_everywhere(HermesToolParser, text) == (text, [])


def test_hermes_call_cut_short_keeps_what_was_sent():
    content, calls = parse_everywhere(HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Par')
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Par'
    content, calls = parse_everywhere(HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": oops}} Then')
    assert content == "" and calls[0]["arguments"] == '{"a": '
    # arguments that never started are an empty object
    for text in ('<tool_call>{"name": "f", "arguments": ', '<tool_call>{"name": "f", "arguments": oops}'):
        assert parse_everywhere(HermesToolParser, text)[1][0]["arguments"] == "{}"


def test_hermes_content_is_the_text_before_the_first_call():
    content, calls = parse_everywhere(
        HermesToolParser, 'A\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\nB <tool_call>nope')
    assert content == "A" and [c["name"] for c in calls] == ["f"]


def test_hermes_whitespace_only_content_is_none():
    content, calls = parse_everywhere(HermesToolParser, '\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert content == "" and len(calls) == 1
    assert parse_everywhere(HermesToolParser, "plain answer\n")[0] == "plain answer\n"


# ----- forced calls: the JSON of tool_call_constraint's schema -----
def test_forced_required_answer_is_an_array_of_calls():
    text = ('[\n {"name": "get_weather", "parameters": {"city":"São \\"Paulo\\"" ,\n"days": 3, '
            '"where": {"lat": [1.5e0, null]}}},{"name":"no_schema","parameters":{}}\n]')
    content, calls = parse_everywhere(lambda _: ForcedCallParser(), text)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", canonical({"city": 'São "Paulo"', "days": 3, "where": {"lat": [1.5, None]}})),
        ("no_schema", "{}")]
    assert all(ID.fullmatch(c["id"]) for c in calls) and calls[0]["id"] != calls[1]["id"]
    # the parameters before the name: the call is sent when its element ends
    _, calls = parse_everywhere(lambda _: ForcedCallParser(), '[{"parameters": {"k": [1, 2]}, "name": "f"}]')
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"k": [1, 2]}')]


def test_forced_named_answer_is_the_arguments():
    content, calls = parse_everywhere(lambda _: ForcedCallParser("get_weather"), '{ "city" :"Rome","days":2 }')
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", canonical({"city": "Rome", "days": 2}))]
    assert parse_everywhere(lambda _: ForcedCallParser("f"), " \n") == ("", [])  # nothing generated: no call


def test_forced_answers_cut_or_broken():
    """max_tokens cuts a call: it keeps the arguments sent; an element cut before its parameters is no call. Text
    that breaks the JSON ends the reading."""
    _, calls = parse_everywhere(lambda _: ForcedCallParser("f"), '{"city": "Ro')
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"city": "Ro')]
    _, calls = parse_everywhere(lambda _: ForcedCallParser(), '[{"name": "f", "parameters": {"a": [true, ')
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"a": [true, ')]
    _, calls = parse_everywhere(lambda _: ForcedCallParser(), '[{"name": "f", "parameters": {}}, {"name": "g", "para')
    assert [c["name"] for c in calls] == ["f"]
    _, calls = parse_everywhere(lambda _: ForcedCallParser(), '[{"name": "f", "parameters": {}}]<tool_call>{"x"')
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", "{}")]
    assert parse_everywhere(lambda _: ForcedCallParser(), 'not json [{"name": "f", "parameters": {}}]') == ("", [])


# ----- qwen3_coder -----
CODER = ('Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão "Paulo"\n\n</parameter>\n'
         '<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=ratio>\n0.5\n'
         '</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=where>\n{"lat": 1.5}\n</parameter>\n'
         '<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n'
         'Done.\n<function=no_schema>\n<parameter=n>\n7\n</parameter>\n</function>')


def test_qwen3_coder_arguments_follow_the_schema_types():
    content, calls = parse_everywhere(Qwen3CoderToolParser, CODER)
    assert content == "Sure.\n\nDone."
    assert [c["name"] for c in calls] == ["get_weather", "no_schema"]
    args = {"city": 'São "Paulo"\n', "days": 3, "metric": True, "ratio": 0.5, "hours": [1, 2], "where": {"lat": 1.5},
            "note": None, "extra": "42"}  # a parameter the schema does not know stays text
    assert calls[0]["arguments"] == canonical(args)
    assert calls[1]["arguments"] == '{"n": "7"}'  # no schema: text


def test_qwen3_coder_streams_string_values_as_they_arrive():
    parser = Qwen3CoderToolParser(TOOLS)
    _, deltas = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert [(d.name, d.arguments) for d in deltas] == [("get_weather", '{"city": "Par')]
    _, deltas = parser.feed("is\n</parameter>\n<parameter=days>\n1")  # an integer is sent once it is complete
    assert "".join(d.arguments for d in deltas) == 'is"'
    _, deltas = parser.feed("2\n</parameter>\n</function>\n</tool_call>")
    assert "".join(d.arguments for d in deltas) == ', "days": 12}'


@pytest.mark.parametrize("text", ["<tool_call>\nnot a function</tool_call>", "<function=bad name\n> x",
                                  "a <tool_call></tool_call> b"])
def test_qwen3_coder_text_that_is_no_call_stays_content(text):
    content, calls = parse_everywhere(Qwen3CoderToolParser, text)
    assert calls == [] and content == text


def test_qwen3_coder_unclosed_call_ends_with_the_text():
    content, calls = parse_everywhere(Qwen3CoderToolParser,
                                      "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome")
    assert content == "" and calls[0]["arguments"] == '{"city": "Rome"}'


def test_schema_types_and_coercion():
    assert schema_types({"type": ["integer", "null"]}) == {"integer", "null"}
    assert schema_types({"enum": [1, "a", None, True]}) == {"integer", "string", "null", "boolean"}
    assert schema_types({"anyOf": [{"type": "int"}, {"type": "bool"}]}) == {"integer", "boolean"}
    assert schema_types({}) == {"string"}
    assert coerce("5", {"integer"}) == 5 and coerce("5.0", {"number"}) == 5 and coerce("2.5", {"number"}) == 2.5
    assert coerce("abc", {"integer"}) == "abc" and coerce("1", {"boolean"}) is True
    assert coerce("null", {"string", "null"}) is None and coerce("[1]", {"array"}) == [1]
    assert coerce("inf", {"number"}) == "inf"  # not a JSON number: stays text


# ----- qwen3 reasoning -----
def split_reasoning(text: str, in_reasoning: bool = True) -> tuple[str, str]:
    results = set()
    for pieces in splits(text):
        parser = Qwen3ReasoningParser(in_reasoning)
        reasoning = content = ""
        for piece in pieces:
            r, c = parser.feed(piece)
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        results.add((reasoning + r, content + c))
    assert len(results) == 1, results
    return results.pop()


@pytest.mark.parametrize("text,expected", [
    ("<think>\nplan\n</think>\n\nAnswer", ("\nplan\n", "\n\nAnswer")),
    ("plan (the prompt opened it)</think>Answer", ("plan (the prompt opened it)", "Answer")),
    ("still thinking <thi", ("still thinking <thi", "")),  # no </think>: all reasoning
    ("plan<tool_call>{}</tool_call>", ("plan", "<tool_call>{}</tool_call>")),  # a call ends the reasoning
    ("<think>a</think>b</think>c", ("a", "b</think>c")),
])
def test_qwen3_reasoning_split(text, expected):
    assert split_reasoning(text) == expected


def test_qwen3_reasoning_off_is_all_content():
    assert split_reasoning("<think>x</think>y", in_reasoning=False) == ("", "<think>x</think>y")
    assert not Qwen3ReasoningParser.thinking({"enable_thinking": False}) and Qwen3ReasoningParser.thinking(None)


def test_qwen3_answer_starts_in_reasoning_unless_the_prompt_closed_it():
    vocab = {"<think>": 10, "</think>": 11, "<|im_start|>": 1, "<|im_end|>": 2}
    opens = Qwen3ReasoningParser.starts_in_reasoning
    assert opens([1, 5, 2, 1, 6], vocab)  # "<|im_start|>assistant\n"
    assert opens([1, 6, 10, 7], vocab)  # ... "<think>\n"
    assert not opens([1, 6, 10, 7, 11, 7], vocab)  # ... "<think>\n\n</think>\n\n": thinking off
    assert opens([1, 6, 10, 11, 2, 1, 6], vocab)  # a closed block of an earlier turn does not count


def test_qwen3_reasoning_tokens_are_those_before_its_end():
    vocab = {"<think>": 10, "</think>": 11, "<tool_call>": 12}
    count = Qwen3ReasoningParser.reasoning_tokens
    assert count([10, 5, 6, 11, 7, 8], vocab) == 2
    assert count([5, 6, 12, 7], vocab) == 2  # a call ends it
    assert count([10, 5, 6], vocab) == 2  # never closed: all of it


# ----- both: a choice's parser -----
def test_choice_parser_reasoning_then_calls_from_the_content_only():
    parsing = ChatParsing(reasoning=Qwen3ReasoningParser, tool_parser=HermesToolParser, tools=TOOLS)
    text = ('<think>I could write <tool_call>{"name": "no"}</tool_call> here... no.</think>\n\nOK.\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>')
    whole = parsing.new_parser()
    reasoning, content, _ = whole.feed(text, final=True)
    # the first <tool_call> ends the reasoning (Qwen3's rule): the rest is content for the tool parser
    assert reasoning == "I could write "
    assert content == '<tool_call>{"name": "no"}</tool_call> here... no.</think>\n\nOK.'
    assert [c["function"]["name"] for c in whole.tool_calls()] == ["get_weather"]
    text = "<think>weather?</think>\n\nOK.\n" + text[text.index("<tool_call>\n{"):]
    for pieces in splits(text):
        parser, got = parsing.new_parser(), ["", ""]
        for i, piece in enumerate(pieces):
            r, c, _ = parser.feed(piece, final=i == len(pieces) - 1)
            got[0] += r
            got[1] += c
        assert got == ["weather?", "\n\nOK."]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.tool_calls()] == [
            ("get_weather", '{"city": "Lima"}')]
