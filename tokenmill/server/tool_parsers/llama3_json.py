"""``llama3_json``: Llama 3.1/3.2's JSON tool calls, ``{"name": ..., "parameters": {...}}``.

The output is a tool call when it starts (after whitespace) with ``{`` or ``<|python_tag|>``; several
calls are separated by ``;``. Anything else, or a call that does not parse, is content (vLLM's rule).
``<|python_tag|>`` is a special token, so the request keeps special tokens in its text.
"""

from __future__ import annotations

import json

from tokenmill.server.tool_parsers.base import (ParseResult, PartialCall, PartialJSONError, ToolParser,
                                                register_tool_parser, scan_call_object, skip_ws)


@register_tool_parser("llama3_json", "llama4_json")
class Llama3JsonToolParser(ToolParser):
    """Parser for Llama 3's JSON tool calls (see the module docstring)."""

    name = "llama3_json"
    skip_special_tokens = False
    BOT = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParseResult:
        s = skip_ws(text, 0)
        head = text[s:]
        if head.startswith(self.BOT):
            k = s + len(self.BOT)
        elif head.startswith("{"):
            k = s
        elif not final and (head == "" or self.BOT.startswith(head)):
            return ParseResult("")
        else:
            return ParseResult(text)
        calls: list[PartialCall] = []
        try:
            while True:
                k = skip_ws(text, k)
                if k >= len(text):
                    break
                call, end = scan_call_object(text, k, final)
                if call is None:
                    break
                calls.append(call)
                if end is None:
                    break
                m = skip_ws(text, end)
                if m >= len(text):
                    break
                if text[m] != ";":
                    raise PartialJSONError(f"unexpected {text[m]!r} after a tool call")
                k = m + 1
        except ValueError:  # PartialJSONError or json.JSONDecodeError: malformed model text
            return ParseResult(text if final else "", [] if final else calls)
        if final and (not calls or not all(c.done for c in calls)):
            return ParseResult(text)
        return ParseResult("", calls)

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a or "{}"}}}' for n, a in calls)

    def instructions(self) -> str:
        return ('To call a function, reply with only a JSON object of the form {"name": <function-name>, '
                '"parameters": <args-json-object>}; separate several calls with "; ".')
