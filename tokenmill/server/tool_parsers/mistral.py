"""``mistral``: Mistral's ``[TOOL_CALLS]`` tool calls.

Two forms follow the ``[TOOL_CALLS]`` marker: a JSON array ``[{"name": ..., "arguments": {...}}, ...]``
(tokenizers before v11) or ``name{...}`` / ``name[ARGS]{...}`` pairs, each after its own marker
(v11 and later). Content is the text before the first marker. The marker is a special token, so the
request keeps special tokens in its text; tool-call ids are nine letters and digits, the only form
Mistral's chat templates accept.
"""

from __future__ import annotations

import json

from tokenmill.server.tool_parsers.base import (ParseResult, PartialCall, PartialJSONError, ToolParser,
                                                mistral_tool_call_id, register_tool_parser, scan_call_object,
                                                skip_ws)
from tokenmill.server.tool_parsers.partial_json import held_back, scan_array, scan_value


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Parser for ``[TOOL_CALLS]`` (see the module docstring)."""

    name = "mistral"
    skip_special_tokens = False
    BOT = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def new_id(self) -> str:
        return mistral_tool_call_id()

    def parse(self, text: str, final: bool) -> ParseResult:
        idx = text.find(self.BOT)
        if idx < 0:
            keep = 0 if final else held_back(text, self.BOT)
            return ParseResult(text[:len(text) - keep])
        content = text[:idx]
        calls: list[PartialCall] = []
        try:
            k = skip_ws(text, idx + len(self.BOT))
            if k >= len(text):
                if final:
                    raise PartialJSONError("nothing after [TOOL_CALLS]")
            elif text[k] == "[" and not text.startswith(self.ARGS, k):
                items, end = scan_array(text, k, final)
                for it in items:
                    call, cend = scan_call_object(text, it.start, final)
                    if call is None:
                        break
                    calls.append(call)
                    if cend is None:
                        break
                if final and end is None:
                    raise PartialJSONError("unfinished [TOOL_CALLS] array")
            else:
                self._name_args(text, k, final, calls)
        except ValueError:  # PartialJSONError or json.JSONDecodeError: malformed model text
            if final:
                return ParseResult(text)
            return ParseResult(content, calls)
        if final and (not calls or not all(c.done for c in calls)):
            return ParseResult(text)
        return ParseResult(content, calls)

    def _name_args(self, text: str, k: int, final: bool, calls: list[PartialCall]) -> None:
        """The v11 form from ``k``: ``name[ARGS]{...}`` or ``name{...}``, repeated after markers."""
        while k < len(text):
            brace = text.find("{", k)
            if brace < 0:
                if final:
                    raise PartialJSONError("tool call without arguments")
                return
            name = text[k:brace]
            if name.endswith(self.ARGS):
                name = name[:-len(self.ARGS)]
            name = name.strip()
            if not name or not all(ch.isalnum() or ch in "_-." for ch in name):
                raise PartialJSONError(f"bad function name {name!r}")
            end = scan_value(text, brace, final)
            if end is None:
                calls.append(PartialCall(name, text[brace:]))
                return
            args = text[brace:end]
            if not isinstance(json.loads(args), dict):
                raise PartialJSONError("arguments are not an object")
            calls.append(PartialCall(name, args, True))
            m = skip_ws(text, end)
            if text.startswith(self.BOT, m):
                k = skip_ws(text, m + len(self.BOT))
                continue
            rest = text[m:]
            if rest and (final or not self.BOT.startswith(rest)):
                raise PartialJSONError(f"unexpected text after a tool call: {rest[:20]!r}")
            return

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        body = ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {a or "{}"}}}' for n, a in calls)
        return f"{self.BOT}[{body}]"

    def instructions(self) -> str:
        return ('To call functions, reply with [TOOL_CALLS] followed by a JSON array of calls: '
                '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]')
