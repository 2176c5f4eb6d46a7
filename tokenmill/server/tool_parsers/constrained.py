"""Reading the output of ``tool_choice: "required"`` and named tool choices, and the schemas that force it.

As vLLM does, a named choice constrains the output to the function's parameter schema (the output *is*
the arguments), and ``"required"`` to a JSON array of ``{"name": <one of the tools>, "parameters":
<that tool's schema>}`` objects (at least one; exactly one when ``parallel_tool_calls`` is false).
:func:`named_tool_schema` and :func:`required_tools_schema` build those schemas;
:class:`NamedToolParser` and :class:`RequiredToolParser` read the output back into tool calls, streamed
or not, with the same interface as the free-text parsers.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.server.tool_parsers.base import ParseResult, PartialCall, ToolParser, json_call, skip_ws
from tokenmill.server.tool_parsers.partial_json import scan_array, scan_object, scan_value

# JSON schema of a function without ``parameters`` (OpenAI: an empty parameter list).
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's ``function.parameters`` schema (an empty object schema when absent)."""
    params = (tool.get("function") or {}).get("parameters")
    return params if isinstance(params, dict) and params else dict(EMPTY_PARAMETERS)


def named_tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The schema a named ``tool_choice`` constrains the output to: the function's parameters."""
    return tool_parameters(tool)


def required_tools_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """The schema of ``tool_choice: "required"``: an array of ``{"name", "parameters"}`` calls.

    ``$defs`` of the tools' parameter schemas are moved to the array schema's root, where their
    ``#/$defs/...`` references point (vLLM does the same).

    Raises:
        ValueError: two tools define the same ``$defs`` name differently.
    """
    defs: dict[str, Any] = {}
    variants = []
    for t in tools:
        fn = t.get("function") or {}
        params = dict(tool_parameters(t))
        for key in ("$defs", "definitions"):
            for name, d in (params.pop(key, None) or {}).items():
                if name in defs and defs[name] != d:
                    raise ValueError(f"tools define ${key[1:] if key == '$defs' else key} {name!r} differently")
                defs[name] = d
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [fn.get("name")]}, "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolParser(ToolParser):
    """The output is the named function's arguments: one call, its name known before any text."""

    name = "named"

    def __init__(self, function_name: str, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParseResult:
        args = text.lstrip()
        done = False
        if final:
            try:
                done = isinstance(json.loads(args), dict)
            except ValueError:
                done = False
            if not done:          # truncated (finish_reason "length") or not an object: not a tool call
                return ParseResult(text)
        return ParseResult("", [PartialCall(self.function_name, args, done)])


class RequiredToolParser(ToolParser):
    """The output is a JSON array of ``{"name", "parameters"}`` objects (:func:`required_tools_schema`)."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParseResult(text if final else "")
        calls: list[PartialCall] = []
        try:
            items, end = scan_array(text, i, final)
            for it in items:
                obj = scan_object(text, it.start, final)
                call = json_call(text, obj, final, args_keys=("parameters", "arguments"))
                if call is None:
                    break
                calls.append(call)
                if obj[1] is None:
                    break
        except ValueError:  # PartialJSONError or json.JSONDecodeError
            return ParseResult(text if final else "", [] if final else calls)
        if final and (end is None or not calls or not all(c.done for c in calls)):
            return ParseResult(text)
        return ParseResult("", calls)


__all__ = ["EMPTY_PARAMETERS", "NamedToolParser", "RequiredToolParser", "named_tool_schema", "required_tools_schema",
           "scan_value", "tool_parameters"]
