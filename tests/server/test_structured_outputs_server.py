"""End-to-end structured outputs and tool calling: a real server with the packaged SmolLM2 model, driven by
the official ``openai`` client (``parse`` with pydantic models included) and raw HTTP.

Every constrained output is checked with ``jsonschema`` (or ``re.fullmatch``); the model is small, so the
schemas bound their strings, numbers and arrays and requests are greedy with small ``max_tokens``. One
server per module, with ``--enable-auto-tool-choice --tool-call-parser hermes``; the 34 schema requests run
concurrently in one batch.
"""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.server_proc import ServerProc, start_server

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.slow

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server() -> ServerProc:
    sp = start_server("--max-model-len", "2048", "--kv-cache-memory", "256MiB", "--max-num-seqs", "40",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield sp
    sp.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def model(server: ServerProc) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _s(maxlen: int = 12) -> dict:
    return {"type": "string", "maxLength": maxlen}


def _i(lo: int = 0, hi: int = 99) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _obj(props: dict, required: list[str] | None = None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, **kw}


POINT = {"$defs": {"point": _obj({"x": _i(), "y": _i()}, additionalProperties=False)}}
SCHEMAS: dict[str, dict] = {
    "flat": _obj({"name": _s(20), "age": _i(0, 120)}),
    "nested_object": _obj({"person": _obj({"name": _s(), "address": _obj({"city": _s(),
                                                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    "three_levels": _obj({"a": _obj({"b": _obj({"c": _i()})})}),
    "array_bounds": _obj({"tags": {"type": "array", "items": _s(8), "minItems": 1, "maxItems": 3}}),
    "array_exact": _obj({"pair": {"type": "array", "items": _i(0, 9), "minItems": 2, "maxItems": 2}}),
    "array_of_objects": _obj({"lines": {"type": "array", "maxItems": 2, "minItems": 1,
                                        "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                                       "qty": _i(1, 9)})}}),
    "nested_arrays": _obj({"m": {"type": "array", "minItems": 1, "maxItems": 2,
                                 "items": {"type": "array", "items": _i(0, 9), "minItems": 1, "maxItems": 2}}}),
    "top_level_array": {"type": "array", "items": _i(0, 9), "minItems": 1, "maxItems": 3},
    "enum_string": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "enum_integer": _obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    "enum_mixed": _obj({"v": {"enum": [1, "two", None, True]}}),
    "enum_top_level": {"enum": ["yes", "no", "maybe"]},
    "enum_in_array": _obj({"days": {"type": "array", "maxItems": 3, "minItems": 1,
                                    "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}}}),
    "any_of": _obj({"value": {"anyOf": [_i(0, 100), _s(10)]}}),
    "one_of": _obj({"shape": {"oneOf": [_obj({"kind": {"const": "circle"}, "r": _i(1, 9)}, additionalProperties=False),
                                        _obj({"kind": {"const": "square"}, "side": _i(1, 9)},
                                             additionalProperties=False)]}}),
    "any_of_objects_or_null": _obj({"meta": {"anyOf": [_obj({"k": _s(6)}), {"type": "null"}]}}),
    "ref_defs": {**POINT, **_obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}})},
    "ref_in_array": {**POINT, **_obj({"pts": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1,
                                              "maxItems": 2}})},
    "definitions_legacy": {"definitions": {"n": _i(0, 9)}, **_obj({"n": {"$ref": "#/definitions/n"}})},
    "pattern": _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    # xgrammar ignores minLength/maxLength beside a pattern (docs/guide/structured_outputs.md): bounds in the pattern
    "pattern_with_bounds": _obj({"word": {"type": "string", "pattern": "^[a-z]{3,6}$"}}),
    "nullable_type_list": _obj({"middle": {"type": ["string", "null"], "maxLength": 10}}),
    "nullable_integer": _obj({"n": {"anyOf": [_i(), {"type": "null"}]}}),
    "no_additional_properties": _obj({"id": _i()}, additionalProperties=False),
    "no_additional_nested": _obj({"o": _obj({"a": {"type": "boolean"}}, additionalProperties=False)},
                                 additionalProperties=False),
    "const_string": _obj({"version": {"const": "1.0"}, "name": _s(8)}),
    "const_number_and_bool": _obj({"v": {"const": 3}, "ok": {"const": True}}),
    "boolean": _obj({"done": {"type": "boolean"}, "late": {"type": "boolean"}}),
    "optional_properties": _obj({"a": _i(), "b": _s(5), "c": {"type": "boolean"}}, required=["a"],
                                additionalProperties=False),
    "exclusive_bounds": _obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}),
    "number_bounds": _obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
    "prefix_items": {"type": "array", "prefixItems": [_s(8), _i(0, 9)], "items": False, "minItems": 2},
    "string_lengths": _obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "status_mix": _obj({"status": _obj({"type": {"const": "ok"}, "code": {"enum": [200, 201]}}),
                        "msg": {"type": ["string", "null"], "maxLength": 8}}),
}
# a few go through other spellings of the same constraint
VIA = {"ref_defs": "structured_outputs", "pattern": "guided_json", "top_level_array": "completions",
       "enum_top_level": "completions_structured_outputs", "boolean": "structured_outputs"}
COMPACT = {"nested_arrays", "array_of_objects", "three_levels", "no_additional_nested", "status_mix"}


def _request(url: str, model: str, name: str, schema: dict) -> dict:
    prompt = f"Give an example JSON value for this JSON schema:\n{json.dumps(schema)}"
    via = VIA.get(name, "response_format")
    extra = {"disable_any_whitespace": True} if name in COMPACT else {}
    if via.startswith("completions"):
        body = {"model": model, "prompt": prompt + "\nJSON:", "max_tokens": MAX_TOKENS, "temperature": 0}
        if via == "completions":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        else:
            body["structured_outputs"] = {"json": schema}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return {"text": c["text"], "finish_reason": c["finish_reason"]}
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    if via == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        if extra:
            body["structured_outputs"] = extra
    elif via == "structured_outputs":
        body["structured_outputs"] = {"json": schema, **extra}
    else:
        body[via] = schema
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"text": c["message"]["content"], "finish_reason": c["finish_reason"]}


@pytest.fixture(scope="module")
def schema_outputs(server: ServerProc, model: str) -> dict[str, dict]:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        futs = {name: pool.submit(_request, server.url, model, name, schema) for name, schema in SCHEMAS.items()}
        return {name: f.result() for name, f in futs.items()}


def test_at_least_30_schemas():
    assert len(SCHEMAS) >= 30


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_output_validates(name: str, schema_outputs: dict[str, dict]) -> None:
    out = schema_outputs[name]
    assert out["finish_reason"] == "stop", out          # a cut-off object is never reported as complete
    value = json.loads(out["text"])
    jsonschema.validate(value, SCHEMAS[name])
    if name in COMPACT:   # no optional whitespace: xgrammar's fixed separators ", " and ": " only
        assert out["text"] == json.dumps(value, ensure_ascii=False)


class Address(BaseModel):
    city: str = Field(max_length=12)
    country: Literal["FR", "DE", "IT"]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    address: Address
    nicknames: list[str] = Field(max_length=2)


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                                      response_format=Person, max_completion_tokens=MAX_TOKENS, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, Person) and msg.parsed.address.country in ("FR", "DE", "IT")
    jsonschema.validate(json.loads(msg.content), Person.model_json_schema())


def test_json_object_regex_choice_grammar(client: openai.OpenAI, model: str) -> None:
    msgs = [{"role": "user", "content": 'Reply with this JSON object: {"ok": true}'}]
    r = client.chat.completions.create(model=model, messages=msgs, response_format={"type": "json_object"},
                                       max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    regex = r"(\d{3})-[a-z]{2,5}( [A-Z]+)?"
    for kw in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        c = client.completions.create(model=model, prompt="An ID:", max_tokens=20, temperature=0, extra_body=kw)
        assert re.fullmatch(regex, c.choices[0].text), c.choices[0].text
    choices = ["positive", "negative", "neutral"]
    for n, seed in ((1, None), (3, 7)):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "I love it! Sentiment?"}],
                                           max_tokens=8, temperature=0 if n == 1 else 1.0, n=n, seed=seed,
                                           extra_body={"structured_outputs": {"choice": choices}})
        assert len(r.choices) == n and all(c.message.content in choices for c in r.choices)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    c = client.completions.create(model=model, prompt="Question: is the sky blue?", max_tokens=12, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    assert c.choices[0].text in ("The answer is yes.", "The answer is no.")
    # streamed constrained text joins to the same output
    stream = client.completions.create(model=model, prompt="An ID:", max_tokens=20, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, "".join(ch.choices[0].text for ch in stream))


def test_bad_constraints_are_400_and_the_engine_lives_on(server: ServerProc, model: str) -> None:
    url = server.url
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}}},
         "response_format.json_schema.schema"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "root ::= nothing_defined"}},
         "structured_outputs.grammar"),
        ("/v1/chat/completions", {"messages": msgs, "guided_json": "{not json"}, "guided_json"),
        ("/v1/chat/completions", {"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ("/v1/chat/completions", {"messages": msgs, "structured_outputs": {"regex": "a", "choice": ["a"]}},
         "structured_outputs"),
    ]
    for path, body, param in cases:
        r = httpx.post(url + path, json={"model": model, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"] or param == "tool_choice", err
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4,
                                                  "structured_outputs": {"choice": ["ok"]}}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    assert httpx.get(url + "/health").status_code == 200


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string",
                                                        "pattern": "^[A-Z][a-z]{1,13}/[A-Z][a-z]{1,13}$"}},
                       "required": ["tz"], "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed_calls(chunks) -> tuple[dict[int, dict], list]:
    """Assemble streamed tool calls as a client does, checking OpenAI's delta order."""
    calls: dict[int, dict] = {}
    finish = []
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            if tc.index not in calls:     # first: index, id, type and the name
                assert tc.id and tc.function.name and tc.type == "function", tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None, tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        if ch.choices[0].finish_reason:
            finish.append(ch.choices[0].finish_reason)
    return calls, finish


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, args in calls:
        jsonschema.validate(json.loads(args), PARAMS[name])


# The bounded tool choices' grammars (a named call; "required" with parallel_tool_calls false, maxItems 1) accept
# no output longer than this many bytes, so no more tokens (a token is at least one byte): at most 20 optional
# whitespace characters in each place (max_whitespace) and 18 places (2 in the array, 8 in a two-key object
# with 8 in its two-key "parameters"; fewer for get_time), the longest compact call
# '[{"name":"get_weather","parameters":{"city":"","unit":"fahrenheit"}}]' (69 bytes) and a 12-character city
# at most 12 bytes a character (an escaped surrogate pair). get_time's is shorter (tz <= 28 bytes, 14 places).
# The whitespace places and the cap were checked on xgrammar 0.2.9 (20 spaces accepted in each place, 21 refused).
BOUNDED_MAX_TOKENS = 18 * 20 + 69 + 12 * 12


def _tool_kw(model: str, tc, parallel: bool, max_tokens: int) -> dict:
    return dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tc, max_tokens=max_tokens, temperature=0,
                parallel_tool_calls=parallel)


def _array_items(text: str) -> list:
    """The complete items at the start of a (possibly cut) JSON array's text."""
    dec, items = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\n\r,":
            i += 1
        try:
            item, i = dec.raw_decode(text, i)
        except ValueError:
            return items
        items.append(item)


def test_tool_choice_named_and_required_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    # Both choices' grammars close the output (BOUNDED_MAX_TOKENS), so greedy decoding must end in a call.
    # "required" with parallel_tool_calls true has no bound: test_required_parallel_calls_closed_or_cut
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tc, parallel in ((named, True), ("required", False)):
        kw = _tool_kw(model, tc, parallel, BOUNDED_MAX_TOKENS)
        r = client.chat.completions.create(**kw)
        ch = r.choices[0]
        # OpenAI answers a forced named function with "stop" (vLLM too), auto and required calls "tool_calls"
        want_finish = "stop" if tc is named else "tool_calls"
        assert ch.finish_reason == want_finish, ch
        calls = ch.message.tool_calls
        assert calls and all(c.id and c.type == "function" for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        if not parallel:
            assert len(calls) == 1
        if tc is named:
            assert [c.function.name for c in calls] == ["get_weather"] and ch.message.content is None
        _check_calls([(c.function.name, c.function.arguments) for c in calls])
        streamed, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
        assert finish == [want_finish]
        _check_calls([(c["name"], c["arguments"]) for c in streamed.values()])
        # greedy: the stream carries the same calls (ids are fresh per response)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == \
               [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        # the same request cut by max_tokens halfway (greedy: a prefix of the same tokens, so it is unfinished):
        # "length", no tool calls, the raw text as content; streamed, what was sent stays and the end says "length"
        half = r.usage.completion_tokens // 2
        cut = client.chat.completions.create(**{**kw, "max_tokens": half})
        cc = cut.choices[0]
        assert cc.finish_reason == "length" and cut.usage.completion_tokens == half, cc
        assert cc.message.tool_calls is None and cc.message.content
        full_args = calls[0].function.arguments
        if tc is named:
            assert full_args.startswith(cc.message.content.lstrip())
        else:
            assert cc.message.content.lstrip().startswith("[") and _array_items(cc.message.content) == []
        s_calls, s_finish = _streamed_calls(client.chat.completions.create(**{**kw, "max_tokens": half}, stream=True))
        assert s_finish == ["length"] and len(s_calls) <= 1
        for c in s_calls.values():
            assert c["name"] == calls[0].function.name
            assert full_args.startswith(c["arguments"]) and c["arguments"] in cc.message.content


def test_required_parallel_calls_closed_or_cut(client: openai.OpenAI, model: str) -> None:
    # parallel_tool_calls true: an array of calls with no maxItems (vLLM's schema), so how many calls the model
    # writes is its own choice. Greedy SmolLM2-135M wrote two get_weather calls and closed the array on the EPYC
    # (bfloat16 and float32) but repeated them until max_tokens in float32 with AVX2 kernels (emulated) and on the
    # CI Xeon. Either way the response must have the right shape, streamed and not.
    kw = _tool_kw(model, "required", True, BOUNDED_MAX_TOKENS)   # room for the first call, whatever it is
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    streamed, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == [ch.finish_reason] and ch.finish_reason in ("tool_calls", "length"), ch
    if ch.finish_reason == "tool_calls":
        calls = ch.message.tool_calls
        assert calls and len({c.id for c in calls}) == len(calls) and ch.message.content is None
        _check_calls([(c.function.name, c.function.arguments) for c in calls])
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == \
               [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        return
    # cut by max_tokens: no tool calls, the raw text is the content, and every call it completed is valid
    assert ch.message.tool_calls is None and r.usage.completion_tokens == BOUNDED_MAX_TOKENS
    done = _array_items(ch.message.content)
    assert done, ch.message.content
    for item in done:
        _check_calls([(item["name"], json.dumps(item["parameters"]))])
    # streamed: the completed calls were sent whole, then at most the unfinished one's beginning
    got = list(streamed.values())
    assert [(c["name"], json.loads(c["arguments"])) for c in got[:len(done)]] == \
           [(it["name"], it["parameters"]) for it in done]
    assert len(got) <= len(done) + 1
    for c in got[len(done):]:
        assert c["arguments"] in ch.message.content


def test_openai_parse_with_a_strict_pydantic_tool(client: openai.OpenAI, model: str) -> None:
    class GetWeather(BaseModel):
        city: str = Field(max_length=12)
        unit: Literal["celsius", "fahrenheit"]

    r = client.chat.completions.parse(model=model, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                                      tool_choice="required", parallel_tool_calls=False,
                                      max_completion_tokens=BOUNDED_MAX_TOKENS, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_auto_tool_choice_live_and_second_turn(client: openai.OpenAI, model: str) -> None:
    # the model writes free text, parsed by the hermes parser; streamed and not must agree
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=48, temperature=0)
    r = client.chat.completions.create(**kw)
    calls, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    msg = r.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == \
           [(c["name"], c["arguments"]) for c in calls.values()]
    assert finish == [r.choices[0].finish_reason]
    # auto with the hermes format forced by a grammar: the parser must find exactly that call
    forced = ('root ::= "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" city '
              '"\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>"\ncity ::= [A-Z] [a-z] [a-z]? [a-z]? [a-z]?')
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=64, temperature=0,
              extra_body={"structured_outputs": {"grammar": forced}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])
    calls, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert finish == ["tool_calls"] and [(c["name"], c["arguments"]) for c in calls.values()] == \
           [(call.function.name, call.function.arguments)]
    # second turn: the assistant's tool call and the tool's result render through the template
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})}]
    r2 = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                        max_tokens=24, temperature=0)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    r3 = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=24, temperature=0,
                                        response_format={"type": "json_schema", "json_schema": {
                                            "name": "answer", "schema": _obj({"temp_c": _i(-50, 60)})}})
    assert r3.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r3.choices[0].message.content), _obj({"temp_c": _i(-50, 60)}))


def test_auto_hermes_call_follows_the_tools_schema(client: openai.OpenAI, model: str) -> None:
    # the model copies a call with a wrong argument name; under tool_choice auto the hermes structural tag
    # lets the text run free until <tool_call> and then holds the call to get_weather's schema
    copy = [{"role": "user", "content": 'Repeat exactly this text: <tool_call>\n{"name": "get_weather", '
                                        '"arguments": {"town": "Paris"}}\n</tool_call>'}]
    free = client.chat.completions.create(model=model, messages=copy, tools=TOOLS, tool_choice="none",
                                          max_tokens=60, temperature=0)
    assert '"town"' in free.choices[0].message.content       # what the model writes unconstrained
    r = client.chat.completions.create(model=model, messages=copy, tools=TOOLS, max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])


def test_openai_stream_helper_assembles_tool_calls(client: openai.OpenAI, model: str) -> None:
    # the client's own delta accumulator (ChatCompletionStreamState) rebuilds the same message
    kw = _tool_kw(model, "required", False, BOUNDED_MAX_TOKENS)
    with client.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    ref = client.chat.completions.create(**kw)
    got, want = final.choices[0].message.tool_calls, ref.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in got] == [(c.function.name, c.function.arguments)
                                                                      for c in want]
