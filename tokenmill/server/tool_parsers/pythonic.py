"""``pythonic``: tool calls as a Python list of calls, ``[get_weather(city="Paris"), now()]``.

The format of Llama 3.2 / Llama 4 and ToolACE-style models (Llama 4 may wrap the list in
``<|python_start|>`` ... ``<|python_end|>``). The output is a tool call when it starts (after whitespace)
with ``[``; every element must be a call with keyword arguments whose values are Python literals,
which become the call's JSON arguments (``ast.literal_eval``). Anything else is content. Streamed, a
call's name is sent once its ``(`` arrives and its arguments once the call's ``)`` closes it.
"""

from __future__ import annotations

import ast
import json
import re

from tokenmill.server.tool_parsers.base import ParseResult, PartialCall, ToolParser, register_tool_parser, skip_ws

_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\(")
_OPEN = {"(": ")", "[": "]", "{": "}"}


class _Malformed(ValueError):
    pass


def _call_to_json(src: str) -> tuple[str, str]:
    """``name(k=v, ...)`` → ``(name, JSON arguments)``.

    Raises:
        _Malformed: not a call, positional arguments, or a value that is not a literal.
    """
    try:
        node = ast.parse(src.strip(), mode="eval").body
    except SyntaxError as e:
        raise _Malformed(str(e)) from None
    if not isinstance(node, ast.Call) or node.args:
        raise _Malformed("not a call with keyword arguments")
    func = node.func
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise _Malformed("not a function name")
    parts.append(func.id)
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise _Malformed("**kwargs")
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            if isinstance(kw.value, ast.Name) and kw.value.id in ("true", "false", "null"):
                args[kw.arg] = {"true": True, "false": False, "null": None}[kw.value.id]
            else:
                raise _Malformed(f"argument {kw.arg} is not a literal") from None
    return ".".join(reversed(parts)), json.dumps(args, ensure_ascii=False)


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """Parser for a Python list of calls (see the module docstring)."""

    name = "pythonic"
    skip_special_tokens = False
    START = "<|python_start|>"
    END = "<|python_end|>"

    def parse(self, text: str, final: bool) -> ParseResult:
        s = skip_ws(text, 0)
        head = text[s:]
        if head.startswith(self.START):
            s = skip_ws(text, s + len(self.START))
            head = text[s:]
        elif not final and head and self.START.startswith(head):
            return ParseResult("")
        if not head.startswith("["):
            if not final and head == "":
                return ParseResult("")
            return ParseResult(text)
        try:
            calls, closed, end = self._elements(text, s + 1, final)
        except _Malformed:
            return ParseResult(text if final else "", [])
        if final:
            rest = text[end:].strip() if end is not None else ""
            if rest.startswith(self.END):
                rest = rest[len(self.END):].strip()
            if not closed or not calls or rest:
                return ParseResult(text)
        return ParseResult("", calls)

    def _elements(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], bool, int | None]:
        """Calls of the list whose ``[`` is just before ``i``: (calls, list closed, index after ``]``)."""
        calls: list[PartialCall] = []
        n = len(text)
        start = i
        stack: list[str] = []
        quote: str | None = None
        j = i
        while j < n:
            ch = text[j]
            if quote is not None:
                if ch == "\\":
                    j += 2
                    continue
                if text.startswith(quote, j):
                    j += len(quote)
                    quote = None
                    continue
                j += 1
                continue
            if ch in "'\"":
                quote = ch * 3 if text.startswith(ch * 3, j) else ch
                j += len(quote)
                continue
            if ch in _OPEN:
                stack.append(_OPEN[ch])
            elif ch in ")]}":
                if not stack:
                    if ch != "]":
                        raise _Malformed(f"unbalanced {ch!r}")
                    if text[start:j].strip():      # "[f(), ]": Python's trailing comma is allowed
                        calls.append(self._complete(text[start:j]))
                    return calls, True, j + 1
                if stack.pop() != ch:
                    raise _Malformed(f"unbalanced {ch!r}")
            elif ch == "," and not stack:
                calls.append(self._complete(text[start:j]))
                start = j + 1
            j += 1
        tail = text[start:]
        m = _NAME.match(tail)
        if m:
            calls.append(PartialCall(m.group(1), ""))
        elif tail.strip() and not re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_.]*\s*", tail):
            raise _Malformed("not a call")
        return calls, False, None

    @staticmethod
    def _complete(src: str) -> PartialCall:
        name, args = _call_to_json(src)
        return PartialCall(name, args, True)

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        out = []
        for n, a in calls:
            args = json.loads(a or "{}")
            out.append(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")")
        return "[" + ", ".join(out) + "]"

    def instructions(self) -> str:
        return ("To call functions, reply with only a Python list of calls with keyword arguments, e.g. "
                '[func_name1(param1="value1", param2=2), func_name2(param=True)]')
