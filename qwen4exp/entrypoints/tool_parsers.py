"""Tool-call parsers: a chat choice's generated text -> content and function calls, as vLLM's --tool-call-parser.

`hermes`: each call is a JSON object in <tool_call> tags (Qwen2.5, Qwen3, Hermes); as in vLLM, the content is
the text before the first call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`qwen3_coder`: Qwen3-Coder's XML form (`<function=...>` without <tool_call> is taken too); each value is the text
between its tags less one leading and one trailing newline, converted to the type the tool's JSON schema gives the
parameter (a parameter the schema does not know stays a string):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parser is fed the text as it is generated, in pieces split anywhere (a tag may arrive over several tokens), and
returns what has become certain: content, and ToolCallDeltas (a call's first delta carries its id and name, the
following ones append to its arguments). The whole text at once goes the same way, so a streamed answer adds up to
the non-streamed one exactly. Arguments are JSON in json.dumps's form (", " and ": " separators, no ASCII escapes)
whatever spacing the model used, streamed as they arrive: a hermes call's JSON value by value (a string character
by character), a qwen3_coder string parameter character by character, any other parameter once it is complete. A
block that opens like a call but holds none (`<tool_call>` in prose, JSON that is not a call) stays content; a call
whose arguments break off after its name was sent ends with the arguments sent (an empty object when none were).
Whitespace next to a call is markup unless it separates content before the call from content after it (vLLM strips
the content of a call's answer), so content that is only whitespace is none.

ForcedCallParser reads the answer of a forced tool choice ("required" or a named function), which is generated
under a JSON schema rather than in the model's tool-call format (see tool_schema.py).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


def merge_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One delta per call, in the order the calls started."""
    merged: dict[int, ToolCallDelta] = {}
    for d in deltas:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = ToolCallDelta(d.index, d.id, d.name, d.arguments)
        else:
            m.arguments += d.arguments
    return list(merged.values())


def first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = -1, None
    for tag in tags:
        i = text.find(tag)
        if i != -1 and (best == -1 or i < best):
            best, found = i, tag
    return best, found


def partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that may grow into one of `tags`: held back until the next piece."""
    longest = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:k]):
                longest = k
                break
    return longest


class ToolParser:
    """The content scanning, whitespace rules and call numbering the parsers share. A subclass reads one call block
    (`_open_block`, then `_step` until the block ends) and reports through `_start_call`, `_args` and `_end_block`,
    or gives the block back as content with `_not_a_call`."""

    name = ""
    openers: tuple[str, ...] = ()
    content_after_calls = True

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []
                      if isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)}
        self._buf = ""  # text not yet read
        self._in_block = False
        self._calls = 0
        self._held_ws = ""  # content's trailing whitespace: sent when more content follows, dropped at the end
        self._content_sent = False
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest, at the end of the text: a partial tag is text, an unfinished block is content or its call."""
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self._content, self._deltas = [], []
        while True:
            if not self._in_block:
                pos, tag = first_tag(self._buf, self.openers)
                if tag is None:
                    keep = 0 if final else partial_tag(self._buf, self.openers)
                    self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._text(self._buf[:pos])
                self._buf = self._buf[pos + len(tag):]
                self._in_block = True
                self._opener = tag
                self._raw = ""  # the block's text after the opener, while it may still turn out to be content
                self._open_block(tag)
            elif not self._step(final):
                break
        if final:
            if not self._calls:
                self._content.append(self._held_ws)
            self._held_ws = ""
        return "".join(self._content), merge_deltas(self._deltas)

    # ----- what the blocks report -----
    def _text(self, text: str) -> None:
        if not text or (self._calls and not self.content_after_calls):
            return
        if self._calls and not self._content_sent:
            text = text.lstrip()
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._content.append(body)
            self._content_sent = True

    def _start_call(self, name: str) -> None:
        if not self._content_sent:
            self._held_ws = ""
        self._deltas.append(ToolCallDelta(self._calls, new_tool_call_id(), name))
        self._calls += 1

    def _args(self, text: str) -> None:
        if text:
            self._deltas.append(ToolCallDelta(self._calls - 1, arguments=text))

    def _end_block(self) -> bool:
        self._in_block = False
        return True

    def _not_a_call(self, rest: str) -> bool:
        """The block is text: its opener is content, the text after it is read again as content."""
        self._in_block = False
        self._text(self._opener)
        self._buf = rest
        return True

    # ----- one call block (subclasses) -----
    def _open_block(self, tag: str) -> None:
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        """Read the block on from self._buf; False when it needs more text (never when `final`)."""
        raise NotImplementedError


# ----- hermes: JSON in <tool_call> tags -----
class _JsonError(ValueError):
    pass


class _NotACall(Exception):
    pass


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class _JsonTokens:
    """Reads one JSON value a character at a time, checks its grammar, and splits it into tokens: ("open", "{"),
    ("close", "}"), (":",), (",",), ("str_start",), ("str", decoded text), ("str_end",), ("scalar", json.dumps's
    text of a number or literal). A string's text comes as it arrives."""

    def __init__(self):
        self.stack: list[str] = []
        # value | first_value (after "[") | key | first_key (after "{") | colon | next ("," or a closer) | done
        self.want = "value"
        self.scalar = ""
        self.in_string = False
        self.is_key = False
        self.escape: str | None = None  # "" after a backslash, "u..." inside a \\u escape
        self.high = ""  # a \\u high surrogate waiting for its low half

    @property
    def done(self) -> bool:
        return self.want == "done"

    def push(self, ch: str, out: list) -> None:
        if self.in_string:
            return self._string(ch, out)
        if self.scalar:
            if self.scalar[0] in "tfn":
                if ch.isalpha():
                    self.scalar += ch
                    if not any(lit.startswith(self.scalar) for lit in _LITERALS):
                        raise _JsonError(ch)
                    return
            elif ch in "0123456789+-.eE":
                self.scalar += ch
                return
            self._end_scalar(out)
        if ch in " \t\n\r":
            return
        want = self.want
        if want in ("value", "first_value"):
            if ch == "]" and want == "first_value":
                return self._close(ch, out)
            if ch in "{[":
                self.stack.append(ch)
                out.append(("open", ch))
                self.want = "first_key" if ch == "{" else "first_value"
            elif ch == '"':
                self._start_string(False, out)
            elif ch in "-0123456789tfn":
                self.scalar = ch
            else:
                raise _JsonError(ch)
        elif want in ("key", "first_key"):
            if ch == '"':
                self._start_string(True, out)
            elif ch == "}" and want == "first_key":
                self._close(ch, out)
            else:
                raise _JsonError(ch)
        elif want == "colon" and ch == ":":
            out.append((":",))
            self.want = "value"
        elif want == "next" and ch == ",":
            out.append((",",))
            self.want = "key" if self.stack[-1] == "{" else "value"
        elif want == "next" and ch == ("}" if self.stack[-1] == "{" else "]"):
            self._close(ch, out)
        else:
            raise _JsonError(ch)

    def _value_done(self) -> None:
        self.want = "next" if self.stack else "done"

    def _close(self, ch: str, out: list) -> None:
        self.stack.pop()
        out.append(("close", ch))
        self._value_done()

    def _end_scalar(self, out: list) -> None:
        text, self.scalar = self.scalar, ""
        if text in _LITERALS:
            out.append(("scalar", text))
        elif _NUMBER.fullmatch(text):
            out.append(("scalar", json.dumps(json.loads(text))))
        else:
            raise _JsonError(text)
        self._value_done()

    def _start_string(self, is_key: bool, out: list) -> None:
        self.in_string, self.is_key = True, is_key
        out.append(("str_start",))

    def _string(self, ch: str, out: list) -> None:
        if self.escape is None:
            if ch == '"':
                if self.high:
                    self.high = ""
                    self._append("\ufffd", out)
                self.in_string = False
                out.append(("str_end",))
                if self.is_key:
                    self.want = "colon"
                else:
                    self._value_done()
            elif ch == "\\":
                self.escape = ""
            elif ch < " ":
                raise _JsonError(ch)
            else:
                self._char(ch, out)
        elif self.escape == "":
            if ch == "u":
                self.escape = "u"
            elif ch in _ESCAPES:
                self.escape = None
                self._char(_ESCAPES[ch], out)
            else:
                raise _JsonError(ch)
        else:
            if ch not in _HEX:
                raise _JsonError(ch)
            self.escape += ch
            if len(self.escape) == 5:
                code, self.escape = int(self.escape[1:], 16), None
                self._char(chr(code), out)

    def _char(self, c: str, out: list) -> None:
        # a surrogate pair written as two \u escapes is one character; a lone half cannot be sent as UTF-8
        if self.high:
            high, self.high = self.high, ""
            if "\udc00" <= c <= "\udfff":
                c = chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(c) - 0xDC00))
            else:
                self._append("\ufffd", out)
        if "\ud800" <= c <= "\udbff":
            self.high = c
            return
        if "\udc00" <= c <= "\udfff":
            c = "\ufffd"
        self._append(c, out)

    @staticmethod
    def _append(c: str, out: list) -> None:
        if out and out[-1][0] == "str":
            out[-1] = ("str", out[-1][1] + c)
        else:
            out.append(("str", c))


def _json_text(token: tuple) -> str:
    kind = token[0]
    if kind in ("open", "close", "scalar"):
        return token[1]
    if kind == ":":
        return ": "
    if kind == ",":
        return ", "
    if kind == "str":
        return json.dumps(token[1], ensure_ascii=False)[1:-1]
    return '"'


class HermesToolParser(ToolParser):
    name = "hermes"
    openers = ("<tool_call>",)
    content_after_calls = False
    CLOSER = "</tool_call>"
    # the call's object up to its arguments, in the order the chat templates write it: the call is sent from here
    _HEADER = (("open", "{"), ("str", "name"), (":",), ("str", None), (",",), ("str", "arguments"), (":",))

    def _open_block(self, tag: str) -> None:
        self._json = _JsonTokens()
        # header: matching _HEADER; whole: another key order, decided when the object ends; args: streaming the
        # arguments; tail: the rest of the object; close: the closing tag
        self._phase = "header"
        self._matched = 0
        self._string = ""
        self._call_name = ""
        self._depth = 0
        self._committed = False
        self._args_started = False

    def _step(self, final: bool) -> bool:
        if self._phase != "close":
            buf, n = self._buf, 0
            try:
                while n < len(buf) and self._phase != "close":
                    ch = buf[n]
                    tokens: list = []
                    try:
                        self._json.push(ch, tokens)
                    except _JsonError:
                        if not self._committed:
                            raise _NotACall from None
                        self._buf = buf[n:]
                        return self._end_call()
                    self._raw += ch
                    n += 1
                    for t in tokens:
                        self._token(t)
                    if self._json.done:
                        self._object_done()
            except _NotACall:
                return self._not_a_call(self._raw + buf[n:])
            self._buf = buf[n:]
            if self._phase != "close":
                if not final:
                    return False
                return self._end_call() if self._committed else self._not_a_call(self._raw)
        stripped = self._buf.lstrip()
        if stripped.startswith(self.CLOSER):
            self._buf = stripped[len(self.CLOSER):]
            return self._end_block()
        if not final and self.CLOSER.startswith(stripped):
            return False
        self._buf = stripped
        return self._end_block()

    def _end_call(self) -> bool:
        """The call ends before its object did: arguments that never started are an empty object."""
        if self._phase == "args" and not self._args_started:
            self._args("{}")
        return self._end_block()

    def _token(self, t: tuple) -> None:
        if self._phase == "args":
            self._args_started = True
            self._args(_json_text(t))
            if t[0] == "open":
                self._depth += 1
            elif t[0] == "close":
                self._depth -= 1
            if self._depth == 0 and t[0] in ("close", "str_end", "scalar"):
                self._phase = "tail"
            return
        if self._phase != "header":
            return
        kind = t[0]
        want = self._HEADER[self._matched]
        if self._matched == 0 and t != want:
            raise _NotACall  # not an object: never a call
        if kind == "str_start":
            self._string = ""
            return
        if kind == "str":
            self._string += t[1]
            return
        if want[0] == "str":
            ok = kind == "str_end" and (self._string == want[1] if want[1] else bool(self._string))
            if ok and want[1] is None:
                self._call_name = self._string
        else:
            ok = t == want
        if not ok:
            self._phase = "whole"
            return
        self._matched += 1
        if self._matched == len(self._HEADER):
            self._committed = True
            self._start_call(self._call_name)
            self._phase = "args"

    def _object_done(self) -> None:
        if self._phase == "whole" or self._phase == "header":
            try:
                call = json.loads(self._raw)
            except ValueError:
                raise _NotACall from None
            if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
                    and "arguments" in call):
                raise _NotACall
            self._committed = True
            self._start_call(call["name"])
            self._args(json.dumps(call["arguments"], ensure_ascii=False))
        self._phase = "close"


# ----- forced calls: the JSON of tool_call_constraint's schema -----
class ForcedCallParser:
    """The answer to tool_choice "required" or a named function, generated under tool_call_constraint's JSON schema
    (tool_schema.py) and read as vLLM reads it: for a named `function` the answer is its arguments object, for
    "required" an array of {"name": ..., "parameters": ...}, one call each. It has no content. Fed like a ToolParser,
    it sends a call once its arguments start (a named call with the answer's first value) and the arguments in
    json.dumps's form as they arrive. A call cut off by max_tokens keeps the arguments sent; an array element cut
    before its parameters started is no call; text that breaks the JSON (a grammar that ended its sequence with an
    error) ends the reading."""

    def __init__(self, function: str | None = None):
        self.function = function
        self._json = _JsonTokens()
        self._broken = False
        self._calls = 0
        self._deltas: list[ToolCallDelta] = []
        self._depth = 0  # containers open before the current token
        # the "required" array's element being read: its member's key (None between members), name, parameters
        self._key: str | None = None
        self._text = ""  # the key, or the name, read so far
        self._name: str | None = None
        self._params: str | None = None  # the parameters' text while the name is still unknown
        self._started = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._deltas = []
        for ch in text:
            if self._broken:
                break
            tokens: list = []
            try:
                self._json.push(ch, tokens)
            except _JsonError:
                self._broken = True
            for t in tokens:
                self._token(t)
        return "", merge_deltas(self._deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []

    def _token(self, t: tuple) -> None:
        kind = t[0]
        if self.function is not None:
            if not self._calls:
                self._start(self.function)
            self._args(_json_text(t))
            return
        depth = self._depth
        self._depth += 1 if kind == "open" else -1 if kind == "close" else 0
        if depth == 1 and kind == "open":  # an element
            self._key, self._text, self._name, self._params, self._started = None, "", None, None, False
        if depth < 2:  # the array's brackets and commas
            return
        if self._key is None:  # between the element's members: a key, or the element's end
            if kind == "str_start":
                self._text = ""
            elif kind == "str":
                self._text += t[1]
            elif kind == ":":
                self._key, self._text = self._text, ""
            elif kind == "close" and not self._started and self._name is not None and self._params is not None:
                self._start(self._name)
                self._args(self._params)
            return
        if self._key == "name" and kind == "str":
            self._text += t[1]
        elif self._key == "parameters":
            if self._name is None:
                self._params = (self._params or "") + _json_text(t)
            else:
                if not self._started:
                    self._start(self._name)
                self._args(_json_text(t))
        if self._depth == 2 and kind in ("close", "str_end", "scalar"):  # the member's value is complete
            if self._key == "name" and kind == "str_end":
                self._name = self._text
            self._key = None

    def _start(self, name: str) -> None:
        self._deltas.append(ToolCallDelta(self._calls, new_tool_call_id(), name))
        self._calls += 1
        self._started = True

    def _args(self, text: str) -> None:
        if text:
            self._deltas.append(ToolCallDelta(self._calls - 1, arguments=text))


# ----- qwen3_coder: XML parameters, typed by the tool's schema -----
_TYPE_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
                 "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
                 "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
                 "float": "number", "float32": "number", "float64": "number", "double": "number",
                 "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array"}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows: its `type`s, its enum values' types, those of anyOf/oneOf/allOf; "string"
    when it says none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    declared = schema.get("type")
    for t in declared if isinstance(declared, list) else [declared]:
        if isinstance(t, str):
            t = t.strip().lower()
            types.add(_TYPE_ALIASES.get(t, t))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            types.add("null" if value is None else next((n for cls, n in _ENUM_TYPES if isinstance(value, cls)),
                                                         "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                types |= schema_types(sub)
    return types or {"string"}


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except ValueError:
        return False


def coerce(value: str, types: set[str]) -> Any:
    """A parameter's text as the first of its schema's types (null, integer, number, boolean, object, array,
    string) it reads as; else as JSON if it is JSON, else the text."""
    for t in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if t not in types:
            continue
        if t == "string":
            return value
        if t == "null" and value.lower() == "null":
            return None
        if t in ("integer", "number"):
            try:
                return int(value)
            except ValueError:
                pass
        if t == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number
        if t == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if t in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


def _trim_newlines(value: str) -> str:
    return value.removeprefix("\n").removesuffix("\n")


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    openers = ("<tool_call>", "<function=")
    FUNCTION, PARAMETER = "<function=", "<parameter="
    END_PARAMETER, END_FUNCTION, END_CALL = "</parameter>", "</function>", "</tool_call>"
    MAX_NAME_CHARS = 256
    # what ends a parameter's value; all but </parameter> end it unclosed and are read on by the call
    _VALUE_ENDS = (END_PARAMETER, PARAMETER, END_FUNCTION, END_CALL, "<tool_call>", FUNCTION)
    _CALL_TAGS = (PARAMETER, END_FUNCTION, END_CALL, "<tool_call>", FUNCTION)

    def _open_block(self, tag: str) -> None:
        # function: before <function=; name; params: between parameters; param: a parameter's name; value;
        # after: after </function>
        self._phase = "function" if tag == "<tool_call>" else "name"
        self._name = ""
        self._committed = False
        self._keys: set[str] = set()
        self._n_params = 0

    def _step(self, final: bool) -> bool:
        phase = self._phase
        if phase == "function":
            stripped = self._buf.lstrip()
            if stripped.startswith(self.FUNCTION):
                self._raw += self._buf[: len(self._buf) - len(stripped)] + self.FUNCTION
                self._buf = stripped[len(self.FUNCTION):]
                self._phase = "name"
                return True
            if not final and self.FUNCTION.startswith(stripped):
                return False
            return self._not_a_call(self._raw + self._buf)
        if phase in ("name", "param"):
            return self._read_name(final)
        if phase == "params":
            pos, tag = first_tag(self._buf, self._CALL_TAGS)
            if tag is None:  # text between parameters is not part of the call
                self._buf = self._buf[len(self._buf) - partial_tag(self._buf, self._CALL_TAGS):]
                if not final:
                    return False
                return self._close_call(end=True)
            if tag == self.PARAMETER:
                self._buf = self._buf[pos + len(tag):]
                self._name = ""
                self._phase = "param"
                return True
            if tag == self.END_FUNCTION:
                self._buf = self._buf[pos + len(tag):]
                return self._close_call(end=False)
            if tag == self.END_CALL:
                self._buf = self._buf[pos + len(tag):]
            else:  # the next call starts without this one's closing tags
                self._buf = self._buf[pos:]
            return self._close_call(end=True)
        if phase == "value":
            pos, tag = first_tag(self._buf, self._VALUE_ENDS)
            if tag is None:
                keep = 0 if final else partial_tag(self._buf, self._VALUE_ENDS)
                self._value_text(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                if not final:
                    return False
                self._end_param()
                return self._close_call(end=True)
            self._value_text(self._buf[:pos])
            self._buf = self._buf[pos + len(tag):] if tag == self.END_PARAMETER else self._buf[pos:]
            self._end_param()
            self._phase = "params"
            return True
        # after </function>: its </tool_call>, if the model wrote one
        stripped = self._buf.lstrip()
        if stripped.startswith(self.END_CALL):
            self._buf = stripped[len(self.END_CALL):]
            return self._end_block()
        if not final and self.END_CALL.startswith(stripped):
            return False
        self._buf = stripped
        return self._end_block()

    def _read_name(self, final: bool) -> bool:
        """A function's or a parameter's name, up to ">"; a name that runs into a tag or a line end is none."""
        end = self._buf.find(">")
        part = self._buf if end == -1 else self._buf[:end]
        bad = "<" in part or "\n" in part or len(self._name) + len(part) > self.MAX_NAME_CHARS
        if not bad and end == -1 and not final:
            self._name += part
            self._raw += part
            self._buf = ""
            return False
        name = (self._name + part).strip()
        if bad or end == -1 or not name:
            if self._phase == "name":
                return self._not_a_call(self._raw + self._buf)
            self._phase = "params"  # a broken parameter tag inside a call: skipped
            return True
        self._raw += part + ">"
        self._buf = self._buf[end + 1:]
        if self._phase == "name":
            self._call_name = name
            self._committed = True
            self._start_call(name)
            self._phase = "params"
        else:
            self._start_param(name)
            self._phase = "value"
        return True

    def _param_types(self, key: str) -> set[str] | None:
        """The types of a parameter the tool's schema describes; None for one it does not (its value stays text)."""
        params = (self.tools.get(self._call_name) or {}).get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if not isinstance(props, dict) or not isinstance(props.get(key), dict):
            return None
        return schema_types(props[key])

    def _key_text(self, key: str) -> str:
        sep = ", " if self._n_params else "{"
        self._n_params += 1
        return f"{sep}{json.dumps(key, ensure_ascii=False)}: "

    def _start_param(self, key: str) -> None:
        # a repeated parameter keeps its first value: the first one may already be sent
        self._skip = key in self._keys
        self._keys.add(key)
        self._key, self._types = key, self._param_types(key)
        self._streamed = not self._skip and (self._types is None or self._types == {"string"})
        self._value, self._value_started, self._held_nl = "", False, ""
        if self._streamed:
            self._args(self._key_text(key) + '"')

    def _value_text(self, text: str) -> None:
        if self._skip or not text:
            return
        if not self._streamed:
            self._value += text
            return
        if not self._value_started:  # the newline after the opening tag is markup
            self._value_started = True
            text = text.removeprefix("\n")
        text = self._held_nl + text  # ... and so is the one before the closing tag: held until more text follows
        self._held_nl = "\n" if text.endswith("\n") else ""
        text = text[: len(text) - len(self._held_nl)]
        if text:
            self._args(json.dumps(text, ensure_ascii=False)[1:-1])

    def _end_param(self) -> None:
        if self._skip:
            return
        if self._streamed:
            self._args('"')
            return
        value = coerce(_trim_newlines(self._value), self._types)
        self._args(self._key_text(self._key) + json.dumps(value, ensure_ascii=False))

    def _close_call(self, end: bool) -> bool:
        self._args("}" if self._n_params else "{}")
        if end:
            return self._end_block()
        self._phase = "after"
        return True


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Qwen3CoderToolParser)}
