"""A scanner for the beginning of a JSON text, for tool calls that are still being generated.

Streaming a tool call means reporting its name as soon as that string is complete and its arguments
as they grow, long before the whole JSON parses. :func:`scan_value` finds where a JSON value that
starts at a position ends (or that it has not ended yet); :func:`scan_object` lists the members of a
possibly unfinished object with the raw text span of each value, :func:`scan_array` the elements of a
possibly unfinished array. The raw text of an unfinished value is always a prefix of its final text,
so the pieces reported while streaming concatenate to the finished value (RFC 8259's grammar; no
other source).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_SCALAR_CHARS = set("0123456789+-.eEtrufalsn")


class PartialJSONError(ValueError):
    """The text cannot be the beginning of a JSON value of the expected shape."""


def skip_ws(text: str, i: int) -> int:
    """Index of the first non-whitespace character at or after ``i`` (``len(text)`` if none)."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def scan_value(text: str, i: int, final: bool = False) -> int | None:
    """Where the JSON value starting at ``text[i]`` ends.

    Args:
        text: the text generated so far.
        i: index of the value's first character (not whitespace).
        final: the text is complete (a number at its very end is then finished).

    Returns:
        the index just past the value, or None when the text ends before the value does.

    Raises:
        PartialJSONError: ``text[i]`` cannot start a JSON value, or brackets do not match.
    """
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < n:
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        stack = [c]
        j = i + 1
        while j < n:
            ch = text[j]
            if ch == '"':
                end = scan_value(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                stack.append(ch)
            elif ch in "}]":
                if not stack or {"}": "{", "]": "["}[ch] != stack[-1]:
                    raise PartialJSONError(f"unbalanced {ch!r} at {j}")
                stack.pop()
                if not stack:
                    return j + 1
            j += 1
        return None
    if c in _SCALAR_CHARS:
        j = i
        while j < n and text[j] in _SCALAR_CHARS:
            j += 1
        if j == n and not final:
            return None        # more digits (or letters of true/false/null) may follow
        return j
    raise PartialJSONError(f"unexpected {c!r} at {i}")


@dataclass
class Member:
    """One member of a scanned object (or one element of a scanned array).

    Attributes:
        start: index of the value's first character in the scanned text.
        end: index just past the value, or None while it is unfinished.
    """

    start: int
    end: int | None

    def raw(self, text: str) -> str:
        """The value's text so far (a prefix of its final text)."""
        return text[self.start:self.end if self.end is not None else len(text)]

    def value(self, text: str):
        """The parsed value.

        Raises:
            PartialJSONError: unfinished, or not valid JSON.
        """
        if self.end is None:
            raise PartialJSONError("value is unfinished")
        try:
            return json.loads(text[self.start:self.end])
        except json.JSONDecodeError as e:
            raise PartialJSONError(str(e)) from None


def scan_object(text: str, i: int, final: bool = False) -> tuple[dict[str, Member], int | None]:
    """The members of the (possibly unfinished) JSON object starting at ``text[i] == "{"``.

    Returns:
        ``({key: Member}, end)``: members whose key is complete (a member whose value has not started
        yet is left out), and the index just past the closing ``}`` or None while unfinished.

    Raises:
        PartialJSONError: not an object, or malformed so far.
    """
    if i >= len(text) or text[i] != "{":
        raise PartialJSONError(f"expected '{{' at {i}")
    members: dict[str, Member] = {}
    j = skip_ws(text, i + 1)
    n = len(text)
    if j < n and text[j] == "}":
        return members, j + 1
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return members, None
        if text[j] != '"':
            raise PartialJSONError(f"expected a key at {j}")
        kend = scan_value(text, j)
        if kend is None:
            return members, None
        key = json.loads(text[j:kend])
        j = skip_ws(text, kend)
        if j >= n:
            return members, None
        if text[j] != ":":
            raise PartialJSONError(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= n:
            return members, None
        vend = scan_value(text, j, final)
        members[key] = Member(j, vend)
        if vend is None:
            return members, None
        j = skip_ws(text, vend)
        if j >= n:
            return members, None
        if text[j] == "}":
            return members, j + 1
        if text[j] != ",":
            raise PartialJSONError(f"expected ',' or '}}' at {j}")
        j += 1


def scan_array(text: str, i: int, final: bool = False) -> tuple[list[Member], int | None]:
    """The elements of the (possibly unfinished) JSON array starting at ``text[i] == "["``.

    Returns:
        ``([Member], end)``: elements that have started, and the index just past ``]`` or None.

    Raises:
        PartialJSONError: not an array, or malformed so far.
    """
    if i >= len(text) or text[i] != "[":
        raise PartialJSONError(f"expected '[' at {i}")
    items: list[Member] = []
    n = len(text)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "]":
        return items, j + 1
    while True:
        j = skip_ws(text, j)
        if j >= n:
            return items, None
        vend = scan_value(text, j, final)
        items.append(Member(j, vend))
        if vend is None:
            return items, None
        j = skip_ws(text, vend)
        if j >= n:
            return items, None
        if text[j] == "]":
            return items, j + 1
        if text[j] != ",":
            raise PartialJSONError(f"expected ',' or ']' at {j}")
        j += 1


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``.

    Streamed content keeps that many trailing characters back: they may be the start of a tool-call
    marker (``<tool_`` before ``call>`` arrives).
    """
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
