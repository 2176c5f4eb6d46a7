"""``hermes``: the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format (Hermes 2 Pro, Qwen 2.5/3).

Content is the text before the first ``<tool_call>``; each block holds one JSON object. A block left
open at the end of the output still counts when its object is complete (models stop on EOS right after
the object). Text after the last block is dropped, as vLLM's parser does. With ``tool_choice: "auto"``
decoding follows :meth:`HermesToolParser.structural_tag`: free text until ``<tool_call>``, then one of the
tools' calls with arguments valid against its schema.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.server.tool_parsers.base import (ParseResult, PartialCall, PartialJSONError, ToolParser,
                                                register_tool_parser, scan_call_object, skip_ws)
from tokenmill.server.tool_parsers.constrained import tool_parameters
from tokenmill.server.tool_parsers.partial_json import held_back


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Parser for ``<tool_call>`` blocks (see the module docstring)."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"

    def structural_tag(self) -> dict[str, Any] | None:
        if not self.tools:
            return None
        structures = [{"begin": f'{self.START}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
                       "schema": tool_parameters(t), "end": f"}}\n{self.END}"} for t in self.tools]
        return {"type": "structural_tag", "structures": structures, "triggers": [self.START]}

    def parse(self, text: str, final: bool) -> ParseResult:
        idx = text.find(self.START)
        if idx < 0:
            keep = 0 if final else held_back(text, self.START)
            return ParseResult(text[:len(text) - keep])
        content = text[:idx]
        calls: list[PartialCall] = []
        pos = idx
        try:
            while True:
                j = text.find(self.START, pos)
                if j < 0:
                    rest = text[pos:].strip()
                    if rest and final and not calls:
                        raise PartialJSONError("no tool call in the block")
                    break
                k = skip_ws(text, j + len(self.START))
                if k >= len(text):
                    if final:
                        raise PartialJSONError("empty tool call block")
                    break
                call, end = scan_call_object(text, k, final)
                if call is None:
                    if final:
                        raise PartialJSONError("unfinished tool call")
                    break
                calls.append(call)
                if end is None:
                    if final:
                        raise PartialJSONError("unfinished tool call")
                    break
                m = skip_ws(text, end)
                rest = text[m:]
                if rest.startswith(self.END):
                    pos = m + len(self.END)
                    continue
                if rest == "" or (not final and self.END.startswith(rest)):
                    break
                raise PartialJSONError(f"unexpected text after a tool call: {rest[:20]!r}")
        except ValueError:  # PartialJSONError or json.JSONDecodeError: malformed model text
            if final:
                return ParseResult(text)
            return ParseResult(content, calls)
        return ParseResult(content, calls)
