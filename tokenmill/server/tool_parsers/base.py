"""The tool-parser interface, the registry of parsers by vLLM's names, and the streaming differ.

A parser turns a model's text into ``(content, tool calls)``. It has one method, :meth:`ToolParser.parse`,
that works on the whole text generated so far and may be called with an unfinished text: it then
reports the content that is safe to show (text that may still turn out to be the start of a tool
call is held back) and every call whose name is complete, with the raw text of its arguments so far.
:class:`ToolCallStreamer` calls it after every delta and sends the differences as OpenAI's streamed
``delta.content`` / ``delta.tool_calls[i]`` entries; the non-streamed response calls it once with
``final=True``. Each parser's reported content and arguments only ever grow, so the pieces streamed
concatenate to the final values.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from tokenmill.server.tool_parsers.partial_json import Member, PartialJSONError, scan_object, skip_ws


@dataclass
class PartialCall:
    """A tool call found in the text so far.

    Attributes:
        name: the function's name (complete).
        arguments: the JSON text of its arguments so far (a prefix of the final text).
        done: the call's text is complete (``arguments`` parses).
    """

    name: str
    arguments: str
    done: bool = False


@dataclass
class ParseResult:
    """What a parser found.

    Attributes:
        content: the text for ``message.content`` (or, unfinished, the part safe to stream).
        calls: tool calls in order.
    """

    content: str
    calls: list[PartialCall] = field(default_factory=list)


def random_tool_call_id() -> str:
    """vLLM's tool-call id form: ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_tool_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other ``tool_call_id``."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


class ToolParser(ABC):
    """Base class of the tool-call parsers (one per model family's output format).

    Class attributes:
        name: vLLM's ``--tool-call-parser`` name.
        skip_special_tokens: False when the format's markers are special tokens that detokenization
            would otherwise drop (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``).
    """

    name: ClassVar[str] = ""
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParseResult:
        """Split ``text`` into content and tool calls.

        Args:
            text: everything the model generated so far.
            final: the text is complete. When it is, a tool-call section that does not parse makes the
                whole text content (vLLM's behaviour); when it is not, undecided text is held back.

        Raises:
            Nothing: malformed text is content.
        """

    def new_id(self) -> str:
        """A fresh tool-call id in the form the family's templates accept."""
        return random_tool_call_id()

    def structural_tag(self) -> dict[str, Any] | None:
        """For ``tool_choice: "auto"``: a structural tag (xgrammar's ``structures`` + ``triggers`` form) that
        leaves text free until the format's start marker and then constrains the call to one of the tools'
        parameter schemas; None when the format has no unambiguous marker."""
        return None

    # -- the text the system-message fallback and the re-rendered history use -------------------
    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        """The text this format uses for ``calls`` (``(name, arguments JSON)``), for an assistant turn
        rendered by a template without tool support."""
        return "".join(f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a or "{}"}}}\n</tool_call>'
                       for n, a in calls)

    def instructions(self) -> str:
        """How the model should write a call, for the system-message fallback."""
        return ("To call a function, reply with one <tool_call></tool_call> block per call, each holding a JSON "
                'object with the function\'s name and its arguments:\n<tool_call>\n{"name": <function-name>, '
                '"arguments": <args-json-object>}\n</tool_call>')


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(*names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: register a parser under vLLM's ``--tool-call-parser`` names."""

    def deco(cls: type[ToolParser]) -> type[ToolParser]:
        for n in names:
            TOOL_PARSERS[n] = cls
        return cls

    return deco


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``.

    Raises:
        KeyError: no such parser (the message lists the known names).
    """
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


def json_call(text: str, obj: tuple[dict[str, Member], int | None], final: bool,
              args_keys: tuple[str, ...] = ("arguments", "parameters")) -> PartialCall | None:
    """The call in a scanned ``{"name": ..., "arguments": {...}}`` object, or None while the name is unfinished.

    ``arguments`` given as a JSON string holding JSON (some models do this) is decoded once complete.

    Raises:
        PartialJSONError: the object has no string ``name``, or (finished) its arguments are not an object.
    """
    members, end = obj
    nm = members.get("name")
    if nm is None or nm.end is None:
        if end is not None:
            raise PartialJSONError("tool call without a name")
        return None
    name = nm.value(text)
    if not isinstance(name, str) or not name:
        raise PartialJSONError("tool call name is not a string")
    am = next((members[k] for k in args_keys if k in members), None)
    if am is None:
        if end is not None:                  # a call without arguments: {} (OpenAI always sends a JSON text)
            return PartialCall(name, "{}", True)
        return PartialCall(name, "")
    raw = am.raw(text)
    if raw.startswith('"'):                  # arguments as a JSON string: only whole
        if am.end is None:
            return PartialCall(name, "")
        inner = am.value(text)
        try:
            json.loads(inner)
        except (TypeError, json.JSONDecodeError):
            raise PartialJSONError("arguments string is not JSON") from None
        return PartialCall(name, inner, end is not None)
    if am.end is not None:
        if not isinstance(am.value(text), dict):
            raise PartialJSONError("arguments are not an object")
    elif raw and raw[0] != "{":
        raise PartialJSONError("arguments are not an object")
    return PartialCall(name, raw, end is not None)


def scan_call_object(text: str, i: int, final: bool) -> tuple[PartialCall | None, int | None]:
    """Scan one ``{"name", "arguments"}`` object at ``text[i]``: ``(call or None, end or None)``.

    Raises:
        PartialJSONError: malformed.
    """
    obj = scan_object(text, i, final)
    return json_call(text, obj, final), obj[1]


class ToolCallStreamer:
    """Streams one choice's tool calls as OpenAI's deltas.

    Feed it every text delta; it returns the new ``content`` (may be empty) and the new
    ``delta.tool_calls`` entries: a call's first entry has ``index``, ``id``, ``type`` and
    ``function.name`` with ``arguments: ""`` (as OpenAI's), the next ones ``index`` and an argument
    fragment (the first may follow the header in the same delta).

    Args:
        parser: the choice's parser (parsers keep no state, this class does: one per choice).
        max_calls: report at most this many calls (1 for ``parallel_tool_calls: false``); None: all.
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content_sent = 0
        self.calls: list[list[Any]] = []       # per call: [id, name, arguments sent]
        self.last: ParseResult | None = None

    @property
    def called(self) -> bool:
        """At least one tool call was streamed."""
        return bool(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Add ``delta`` and return ``(content delta, tool_calls delta entries)``."""
        self.text += delta
        res = self.parser.parse(self.text, final)
        self.last = res
        content = ""
        if self.calls and not res.calls:
            # the finished text no longer parses (max_tokens cut a call): what was streamed stays, the
            # raw text is not sent again as content; finish_reason says "length"
            return "", []
        if len(res.content) > self.content_sent:
            content = res.content[self.content_sent:]
            self.content_sent = len(res.content)
        entries: list[dict[str, Any]] = []
        for i, call in enumerate(res.calls[:self.max_calls]):
            if i == len(self.calls):      # OpenAI's header: id, type and name, with empty arguments
                cid = self.parser.new_id()
                self.calls.append([cid, call.name, ""])
                entries.append({"index": i, "id": cid, "type": "function",
                                "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[i][2]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                entries.append({"index": i, "function": {"arguments": call.arguments[len(sent):]}})
                self.calls[i][2] = call.arguments
        return content, entries

    def tool_calls(self) -> list[dict[str, Any]]:
        """The finished calls as ``message.tool_calls`` (ids as streamed)."""
        return [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, name, args in self.calls]


def parse_final(parser: ToolParser, text: str, max_calls: int | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished text as ``(message.content, message.tool_calls)`` for the non-streamed response.

    Content is None when the text held tool calls and nothing else but whitespace; calls get fresh ids;
    at most ``max_calls`` calls are kept (None: all).
    """
    res = parser.parse(text, True)
    calls = [{"id": parser.new_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in res.calls if c.done][:max_calls]
    content: str | None = res.content
    if calls and not (content or "").strip():
        content = None
    return content, calls


__all__ = ["ParseResult", "PartialCall", "PartialJSONError", "ToolCallStreamer", "ToolParser", "TOOL_PARSERS",
           "get_tool_parser", "json_call", "mistral_tool_call_id", "parse_final", "random_tool_call_id",
           "register_tool_parser", "scan_call_object", "skip_ws"]
