"""The constraint a chat completion generates under when its `tool_choice` forces a tool call, as vLLM builds it.

`tool_choice: "required"`: a JSON array of at least one call (at most one when `parallel_tool_calls` is false),
each call an object {"name": one of the function tools' names, "parameters": that tool's parameters}. The tools'
`$defs` move to the array's schema, where the `$ref`s of every tool can reach them. A named function
(`{"type": "function", "function": {"name": ...}}`): that function's parameters object alone. A tool without
parameters takes an empty object. `"none"`, `"auto"` or no tools: no constraint (the model may answer in text).
"""

from __future__ import annotations

import copy
from typing import Any

from ..engine.request import StructuredOutputsParams
from .protocol import RequestError


def tool_call_constraint(tools: list | None, tool_choice: Any,
                         parallel_tool_calls: bool | None = None) -> StructuredOutputsParams | None:
    """The StructuredOutputsParams (a JSON schema) of `tool_choice` over `tools` (OpenAI chat tools, as dicts or
    pydantic models), or None where the choice forces no call. Bad input raises RequestError naming `tools` or
    `tool_choice`."""
    tool_choice = _plain(tool_choice)
    if tool_choice in (None, "none", "auto") or tools is None:
        return None
    functions = _functions([_plain(t) for t in tools])
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError("tool_choice: a named tool choice is {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}", "tool_choice")
        if name not in functions:
            raise RequestError(f"tool_choice: tool {name!r} is not among the tools", "tool_choice")
        return StructuredOutputsParams(json=_parameters(functions[name]))
    if tool_choice != "required":
        raise RequestError(f"tool_choice: expected 'none', 'auto', 'required' or a named function, got "
                           f"{tool_choice!r}", "tool_choice")
    if not functions:
        raise RequestError("tool_choice: 'required' needs a call, but tools has no function tool", "tool_choice")
    calls, defs = [], {}
    for name, function in functions.items():
        parameters = _parameters(function)
        for def_name, schema in (parameters.pop("$defs", None) or {}).items():
            if defs.setdefault(def_name, schema) != schema:
                raise RequestError(f"tools: the definition {def_name!r} has different schemas in different tools",
                                   "tools")
        calls.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputsParams(json=schema)


def _plain(value):
    """A pydantic model as the dict of its JSON form; anything else as is."""
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


def _functions(tools: list) -> dict[str, dict]:
    """The function tools' `function` objects by name (other tool types cannot be called)."""
    out = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RequestError(f"tools: tool {i} is not an object", "tools")
        if tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools: tool {i} needs function.name", "tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise RequestError(f"tools: the parameters of tool {function['name']!r} must be a JSON schema object",
                               "tools")
        out[function["name"]] = function
    return out


def _parameters(function: dict) -> dict:
    """A copy of the function's parameters schema (an empty object schema where it has none)."""
    return copy.deepcopy(function.get("parameters")) or {"type": "object", "properties": {}}
