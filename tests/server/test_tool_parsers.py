"""Tool-call parsers on crafted model text: whole outputs, and the same outputs streamed one character
(and one random-sized piece) at a time, whose deltas must concatenate to the non-streamed result."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.config import TOOL_CALL_PARSERS
from tokenmill.server.tool_parsers import (TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolCallStreamer,
                                           get_tool_parser, parse_final)
from tokenmill.server.tool_parsers.constrained import required_tools_schema
from tokenmill.server.tool_parsers.partial_json import PartialJSONError, held_back, scan_array, scan_object, scan_value

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2], "note": "a \"quoted\" }{ ]["}


def stream(parser, text: str, pieces: list[str] | None = None):
    """Feed ``text`` in pieces; return (content, calls as {index: [id, name, args]}) assembled as a client
    assembles OpenAI's deltas, and checks every entry's shape."""
    st = ToolCallStreamer(parser)
    pieces = pieces if pieces is not None else list(text)
    content = ""
    calls: dict[int, list[str]] = {}
    for k, p in enumerate(pieces):
        c, entries = st.feed(p, final=k == len(pieces) - 1)
        content += c
        for e in entries:
            i = e["index"]
            if i not in calls:
                # the first entry of a call: index, id, type and the name
                assert e["id"] and e["type"] == "function" and e["function"]["name"], e
                assert i == len(calls)
                calls[i] = [e["id"], e["function"]["name"], e["function"]["arguments"]]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}, e
                calls[i][2] += e["function"]["arguments"]
    return content, calls


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        out.append(text[i:i + k])
        i += k
    return out or [""]


def check_both_ways(parser, text: str, want_content: str | None, want: list[tuple[str, dict]]) -> None:
    content, calls = parse_final(parser, text)
    assert content == want_content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
    assert len({c["id"] for c in calls}) == len(calls)
    for pieces in (None, random_pieces(text, 1), random_pieces(text, 2), [text]):
        s_content, s_calls = stream(parser, text, pieces)
        assert s_content == (want_content or ""), pieces
        assert [(n, json.loads(a)) for _, n, a in s_calls.values()] == want, pieces
        # streamed arguments are the same text as the non-streamed ones
        assert [a for _, _, a in s_calls.values()] == [c["function"]["arguments"] for c in calls]


def test_registry_has_vllm_names():
    for name in ("hermes", "llama3_json", "mistral", "pythonic"):
        assert get_tool_parser(name).name in (name, "llama3_json")
    with pytest.raises(KeyError, match="known: hermes"):
        get_tool_parser("nope")
    assert set(TOOL_PARSERS) == set(TOOL_CALL_PARSERS)        # the flag's choices are the registry


def test_partial_json_scanner():
    text = '{"a": [1, {"b": "}"}], "c": "x\\"y", "d": 12'
    members, end = scan_object(text, 0)
    assert end is None and set(members) == {"a", "c", "d"}
    assert members["a"].raw(text) == '[1, {"b": "}"}]' and members["c"].value(text) == 'x"y'
    assert members["d"].end is None            # 12 may still grow
    members, end = scan_object(text + "}", 0)
    assert end == len(text) + 1 and members["d"].value(text + "}") == 12
    assert scan_value("123", 0) is None and scan_value("123", 0, final=True) == 3
    items, end = scan_array('[{"x": 1}, [2', 0)
    assert len(items) == 2 and items[0].end is not None and items[1].end is None and end is None
    with pytest.raises(PartialJSONError):
        scan_value('{"a": 1]', 0)
    with pytest.raises(PartialJSONError):
        scan_object('{"a" 1}', 0)
    assert held_back("abc<tool_", "<tool_call>") == 6 and held_back("abc", "<tool_call>") == 0


def test_hermes():
    p = get_tool_parser("hermes")()
    args = json.dumps(WEATHER)
    text = (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    check_both_ways(p, text, "Let me look.\n", [("get_weather", WEATHER), ("now", {})])
    # no call: all content, and a partial "<tool" is held back only until it cannot be a marker
    check_both_ways(p, "a < b <tool but no call", "a < b <tool but no call", [])
    # an unclosed block at EOS still counts; arguments given as a JSON string are decoded
    check_both_ways(p, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}', None, [("f", {"x": 1})])
    # malformed: everything is content (vLLM's rule)
    bad = '<tool_call>{"name": "f", "arguments": {"x": }</tool_call>'
    assert parse_final(p, bad) == (bad, [])
    truncated = '<tool_call>{"name": "f", "arguments": {"x": 1'
    assert parse_final(p, truncated) == (truncated, [])


def test_llama3_json():
    p = get_tool_parser("llama3_json")()
    assert not p.skip_special_tokens
    text = '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}; {"name": "now", "parameters": {}}'
    check_both_ways(p, text, None, [("get_weather", WEATHER), ("now", {})])
    check_both_ways(p, '  {"name": "f", "parameters": {"a": [1]}}', None, [("f", {"a": [1]})])
    check_both_ways(p, "Paris is sunny.", "Paris is sunny.", [])
    # JSON that is not a call is content
    assert parse_final(p, '{"answer": 42}') == ('{"answer": 42}', [])


def test_mistral_both_forms():
    p = get_tool_parser("mistral")()
    text = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}, {"name": "now", "arguments": {}}]'
    check_both_ways(p, text, "Sure. ", [("get_weather", WEATHER), ("now", {})])
    v11 = '[TOOL_CALLS]get_weather[ARGS]' + json.dumps(WEATHER) + '[TOOL_CALLS]now{}'
    check_both_ways(p, v11, None, [("get_weather", WEATHER), ("now", {})])
    ids = [c["id"] for c in parse_final(p, v11)[1]]
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    assert parse_final(p, "[TOOL_CALLS]oops") == ("[TOOL_CALLS]oops", [])


def test_pythonic():
    p = get_tool_parser("pythonic")()
    text = '[get_weather(city="Paris", unit=\'celsius\', days=[1, 2], note="a \\"quoted\\" }{ ]["), now()]'
    check_both_ways(p, text, None, [("get_weather", WEATHER), ("now", {})])
    check_both_ways(p, "<|python_start|>[f(x=True, y=None, z={'k': 1.5})]<|python_end|>", None,
                    [("f", {"x": True, "y": None, "z": {"k": 1.5}})])
    check_both_ways(p, "The answer is [not a call].", "The answer is [not a call].", [])
    assert parse_final(p, "[f(1, 2)]") == ("[f(1, 2)]", [])         # positional arguments: not a call
    assert parse_final(p, "[f(x=open('a'))]")[1] == []             # not a literal


def test_named_and_required_readers():
    named = NamedToolParser("get_weather")
    content, calls = parse_final(named, json.dumps(WEATHER))
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == WEATHER
    s_content, s_calls = stream(named, json.dumps(WEATHER))
    assert s_content == "" and json.loads(s_calls[0][2]) == WEATHER
    assert parse_final(named, '{"city": "Par') == ('{"city": "Par', [])     # cut by max_tokens: not a call
    req = RequiredToolParser()
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "now", "parameters": {}}], indent=2)
    check_both_ways(req, text, None, [("get_weather", WEATHER), ("now", {})])
    assert parse_final(req, '[{"name": "f", "parameters": {"a": 1}')[1] == []


def test_required_schema_hoists_defs_and_bounds_parallel_calls():
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
        "$defs": {"P": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "b"}}]
    schema = required_tools_schema(tools)
    assert schema["$defs"] == {"P": {"type": "integer"}} and schema["minItems"] == 1 and "maxItems" not in schema
    jsonschema.validate([{"name": "a", "parameters": {"p": 3}}, {"name": "b", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "a", "parameters": {"p": "x"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "c", "parameters": {}}], schema)
    assert required_tools_schema(tools, parallel_tool_calls=False)["maxItems"] == 1
    clash = tools + [{"type": "function", "function": {"name": "c", "parameters": {"$defs": {"P": {"type": "string"}}}}}]
    with pytest.raises(ValueError, match="P"):
        required_tools_schema(clash)


def test_at_most_one_call_without_parallel_tool_calls():
    p = get_tool_parser("hermes")()
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    assert [c["function"]["name"] for c in parse_final(p, text, max_calls=1)[1]] == ["a"]
    assert len(parse_final(p, text)[1]) == 2
    st = ToolCallStreamer(p, max_calls=1)
    entries = [e for ch in text for e in st.feed(ch)[1]] + st.feed("", True)[1]
    assert {e["index"] for e in entries} == {0} and st.tool_calls()[0]["function"]["name"] == "a"


def test_a_streamed_call_cut_by_max_tokens_is_not_repeated_as_content():
    st = ToolCallStreamer(NamedToolParser("f"))
    out = [st.feed(p) for p in ('{"a": ', '[1, 2')]
    assert out[0][1][0]["function"] == {"name": "f", "arguments": ""}
    assert st.feed("", final=True) == ("", [])        # unfinished at the end: nothing more is sent
    assert "".join(e["function"]["arguments"] for _, es in out for e in es) == '{"a": [1, 2'
