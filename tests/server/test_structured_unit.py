"""Structured outputs and tools on the server side, without an engine: request -> constraint mapping,
the backend's early 400s, tool-choice checks, and chat-template rendering of tools and tool turns."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jinja2
import pytest

from tokenmill.config import EngineConfig
from tokenmill.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from tokenmill.server.serving_chat import OpenAIServingChat
from tokenmill.server.structured import check_constraint, constraint_for
from tokenmill.server.tool_parsers import NamedToolParser, RequiredToolParser
from tokenmill.tokenizer import template_accepts_tools

MSGS = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]
PLAIN = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
WITH_TOOLS = ("{% if tools %}TOOLS={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
              "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
              "{% for c in m.get('tool_calls') or [] %}CALL {{ c['id'] }} {{ c['function']['name'] }} "
              "{{ c['function']['arguments'] | tojson }}{% endfor %}"
              "{% if m.get('tool_call_id') %} FOR {{ m['tool_call_id'] }}{% endif %}\n{% endfor %}")


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=kw.pop("messages", MSGS), **kw)


class JinjaTokenizer:
    """Renders chat templates the way transformers does (extra kwargs such as tools reach the template)."""

    eos_token = "<eos>"

    def apply_chat_template(self, messages, chat_template=None, add_generation_prompt=True,
                            continue_final_message=False, tokenize=False, **kw):
        env = jinja2.Environment()
        env.filters["tojson"] = lambda v: json.dumps(v)
        return env.from_string(chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     **kw)


def serving(template: str, **server_kw) -> OpenAIServingChat:
    config = EngineConfig.from_kwargs(**server_kw)
    state = SimpleNamespace(config=config, tokenizer=JinjaTokenizer(), chat_template=template)
    return OpenAIServingChat(state)   # type: ignore[arg-type]


def test_response_format_and_extras_map_onto_structured_outputs():
    assert constraint_for(chat()) is None
    assert constraint_for(chat(response_format={"type": "text"})) is None
    c = constraint_for(chat(response_format={"type": "json_object"}))
    assert c.params.json_object is True and c.param == "response_format"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = constraint_for(chat(response_format={"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    assert json.loads(c.params.json) == schema and c.param == "response_format.json_schema.schema"
    c = constraint_for(CompletionRequest(prompt="p", structured_outputs={"regex": "[ab]+",
                                                                         "disable_any_whitespace": True}))
    assert c.params.regex == "[ab]+" and c.params.disable_any_whitespace and c.param == "structured_outputs.regex"
    c = constraint_for(CompletionRequest(prompt="p", structured_outputs={"structural_tag": {"type": "structural_tag",
                                                                                            "format": {}}}))
    assert json.loads(c.params.structural_tag) == {"type": "structural_tag", "format": {}}
    for field, kind, value in (("guided_json", "json", schema), ("guided_regex", "regex", "a|b"),
                               ("guided_choice", "choice", ["x", "y"]), ("guided_grammar", "grammar", 'root ::= "a"')):
        c = constraint_for(chat(**{field: value}))
        got = getattr(c.params, kind)
        assert (json.loads(got) if kind == "json" else got) == value and c.param == field
    # options apply to the response_format's constraint
    c = constraint_for(chat(response_format={"type": "json_object"},
                            structured_outputs={"disable_additional_properties": True}))
    assert c.params.json_object and c.params.disable_additional_properties
    assert json.loads(constraint_for(chat(guided_json=True)).params.json) == {}     # the schema true: any JSON
    st = constraint_for(chat(response_format={"type": "structural_tag", "format": {"type": "const_string",
                                                                                   "value": "hi"}}))
    assert json.loads(st.params.structural_tag)["format"]["value"] == "hi"


DEEP: dict = {"type": "integer"}
for _ in range(300):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


@pytest.mark.parametrize("kw,param", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format.json_schema.schema"),
    ({"guided_json": DEEP}, "guided_json"),
])
def test_bad_constraint_requests_are_400_naming_the_field(kw, param):
    with pytest.raises(APIError) as e:
        constraint_for(chat(**kw))
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("kw,param,needle", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
    ({"guided_regex": "(a"}, "guided_regex", "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar", "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": "x"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters", "tools[0].function.parameters"),
])
def test_backend_rejections_name_the_field(kw, param, needle):
    pytest.importorskip("xgrammar")
    c = constraint_for(chat(**kw))
    with pytest.raises(APIError) as e:
        asyncio.run(check_constraint(c, EngineConfig().model))
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value.message


def test_good_constraints_pass_the_check():
    pytest.importorskip("xgrammar")
    for kw in ({"structured_outputs": {"regex": r"\d{3}-[a-z]+"}}, {"structured_outputs": {"choice": ["yes", "no"]}},
               {"response_format": {"type": "json_object"}}, {"tools": TOOLS, "tool_choice": "required"},
               {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}):
        asyncio.run(check_constraint(constraint_for(chat(**kw)), EngineConfig().model))


def test_tool_choice_checks_and_constraints():
    for kw, param in (({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
                       "tool_choice"),
                      ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": "auto"}, "tool_choice"),
                      ({"tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
                      ({"tools": TOOLS + TOOLS[:1]}, "tools")):
        with pytest.raises(APIError) as e:
            chat(**kw).check()
        assert e.value.param == param and e.value.status == 400, kw
    named = constraint_for(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                response_format={"type": "json_object"}))   # the tool choice wins (vLLM)
    assert json.loads(named.params.json) == TOOLS[0]["function"]["parameters"]
    assert named.param == "tools[0].function.parameters"
    req = constraint_for(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(req.params.json)
    assert schema["maxItems"] == 1 and len(req.checks) == 2
    assert [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]] == [["get_weather"], ["now"]]
    assert constraint_for(chat(tools=TOOLS, tool_choice="none")) is None
    assert constraint_for(chat(tools=TOOLS, tool_choice="auto")) is None
    assert chat(tools=TOOLS).effective_tool_choice == "auto" and chat().effective_tool_choice == "none"


def test_tool_reader_by_choice_and_auto_needs_the_flags():
    s = serving(PLAIN)
    assert s.tool_reader(chat()) is None and s.tool_reader(chat(tools=TOOLS, tool_choice="none")) is None
    assert isinstance(s.tool_reader(chat(tools=TOOLS, tool_choice="required")), RequiredToolParser)
    named = s.tool_reader(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}))
    assert isinstance(named, NamedToolParser) and named.function_name == "now"
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as e:
        s.tool_reader(chat(tools=TOOLS))
    assert e.value.param == "tool_choice"
    auto = serving(PLAIN, enable_auto_tool_choice=True, tool_call_parser="mistral")
    assert auto.tool_reader(chat(tools=TOOLS)).name == "mistral"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        EngineConfig.from_kwargs(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        EngineConfig.from_kwargs(tool_call_parser="nope")


HISTORY = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]


def _render(s: OpenAIServingChat, req: ChatCompletionRequest) -> str:
    tools, fmt, instructions = s.tool_prompt(req)
    return s.render_chat(req.messages, True, False, None, None, tools, fmt, instructions)


def test_template_with_tools_gets_them_and_the_tool_turns():
    assert template_accepts_tools(WITH_TOOLS) and not template_accepts_tools(PLAIN)
    s = serving(WITH_TOOLS)
    out = _render(s, chat(messages=HISTORY, tools=TOOLS, tool_choice="required"))
    assert out.startswith("TOOLS=get_weather,now\n")
    assert 'CALL call_1 get_weather {"city": "Paris"}' in out      # arguments reach the template as an object
    assert "<tool>{\"temp_c\": 21} FOR call_1" in out
    assert "You may call" not in out


def test_template_without_tools_gets_a_system_message_and_text_turns():
    s = serving(PLAIN, enable_auto_tool_choice=True, tool_call_parser="hermes")
    out = _render(s, chat(messages=HISTORY, tools=TOOLS))
    system = out.split("\n<user>")[0]
    assert system.startswith("<system>Be brief.\n\nYou may call")        # appended to the existing system message
    assert '"name": "get_weather"' in system and "<tool_call>" in system
    assert '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    assert '<user><tool_response>\n{"temp_c": 21}\n</tool_response>' in out
    # no system message: one goes in front; the format follows the configured parser
    s = serving(PLAIN, enable_auto_tool_choice=True, tool_call_parser="pythonic")
    out = _render(s, chat(messages=HISTORY[1:], tools=TOOLS))
    assert out.startswith("<system>You may call") and "Python list of calls" in out
    assert "<assistant>[get_weather(city='Paris')]" in out
    # named choice: the instructions say which function; tool_choice none with the exclude flag: no tools at all
    out = _render(serving(PLAIN), chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}))
    assert "Call the function now" in out
    out = _render(serving(PLAIN, exclude_tools_when_tool_choice_none=True), chat(tools=TOOLS, tool_choice="none"))
    assert "You may call" not in out
    assert "You may call" in _render(serving(PLAIN), chat(tools=TOOLS, tool_choice="none"))


def test_auto_with_hermes_follows_a_structural_tag_of_the_tools():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    s = serving(PLAIN, enable_auto_tool_choice=True, tool_call_parser="hermes")
    req = chat(tools=TOOLS)
    c = constraint_for(req, s.tool_reader(req))
    assert c.param == "tools" and len(c.checks) == 2
    tag = json.loads(c.params.structural_tag)
    assert tag["triggers"] == ["<tool_call>"] and [st["begin"] for st in tag["structures"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ', '<tool_call>\n{"name": "now", "arguments": ']
    asyncio.run(check_constraint(c, EngineConfig().model))
    grammar = xgr.Grammar.from_structural_tag([xgr.StructuralTagItem(**st) for st in tag["structures"]],
                                              tag["triggers"])
    ok = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(grammar, ok) and accepts(grammar, "no call at all")
    assert not accepts(grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>')
    assert not accepts(grammar, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    # the parser reads what the tag lets through
    assert parse_final_names(s.tool_reader(req), ok) == ["get_weather"]
    # an explicit constraint wins; other parsers have no tag
    assert constraint_for(chat(tools=TOOLS, guided_regex="a"), s.tool_reader(req)).params.regex == "a"
    m = serving(PLAIN, enable_auto_tool_choice=True, tool_call_parser="mistral")
    assert constraint_for(req, m.tool_reader(req)) is None
    # llguidance compiles no structural tags: auto stays unconstrained there
    from tokenmill.server.structured import structural_tags_supported

    assert structural_tags_supported(EngineConfig().model)
    assert not structural_tags_supported(EngineConfig.from_kwargs(
        structured_outputs_config='{"backend": "guidance"}').model)


def parse_final_names(parser, text: str) -> list[str]:
    from tokenmill.server.tool_parsers import parse_final

    return [c["function"]["name"] for c in parse_final(parser, text)[1]]


def test_slow_constraint_checks_leave_the_default_executor_to_tokenization(monkeypatch):
    """A constraint that takes long to check (``structured_outputs.regex: "a{1000000}"``: about a minute in
    xgrammar) runs in a thread that a timed-out wait cannot stop. The checks get their own bounded pool, so a
    burst of them cannot take every thread of the event loop's default executor, where the server tokenizes
    prompts (``asyncio.to_thread``): before, 8 such requests on a 2-core machine (6 default threads) left every
    other request waiting for its tokenization."""
    import threading

    import tokenmill.server.structured as structured

    release = threading.Event()
    started: list[int] = []

    def blocked(params, config):
        started.append(1)
        release.wait(60)

    monkeypatch.setattr(structured, "_validator", lambda so_config: blocked)
    c = constraint_for(CompletionRequest(prompt="x", structured_outputs={"regex": "a"}))

    async def main():
        checks = [asyncio.create_task(check_constraint(c, EngineConfig().model)) for _ in range(40)]
        await asyncio.sleep(0.2)
        try:   # a tokenization-like call on the default executor still runs while every check is blocked
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "tokenized"), 10) == "tokenized"
            assert 1 <= len(started) <= structured.CHECK_THREADS
        finally:
            release.set()
        await asyncio.gather(*checks)

    asyncio.run(main())
