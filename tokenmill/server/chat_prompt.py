"""A chat request's prompt text: the chat template applied to its messages and tools.

Shared by the server (:meth:`tokenmill.server.serving.OpenAIServing.render_chat`, ``/tokenize``) and the
``kv_aware`` router (:class:`tokenmill.router.prompt.PromptTokenizer`), which must hash the very tokens the
backend will cache: a request with ``tools`` renders them into its prompt (a long, shared prefix in agent
traffic), so the router renders them exactly as the server does, through these functions.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.server.protocol import APIError, ChatCompletionRequest, ChatMessage, NamedToolChoice
from tokenmill.server.tool_parsers.base import ToolParser, get_tool_parser
from tokenmill.server.tool_parsers.hermes import HermesToolParser
from tokenmill.tokenizer import template_accepts_tools


def render_chat_text(tokenizer: Any, template: str | None, messages: list[ChatMessage],
                     add_generation_prompt: bool, continue_final_message: bool,
                     chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
                     tool_format: ToolParser | None = None, tool_instructions: str | None = None) -> str:
    """The prompt text of a conversation under ``template`` (Jinja, Hugging Face's ``apply_chat_template``).

    A template that reads ``tools`` gets them (and earlier turns' ``tool_calls`` / ``tool_call_id``)
    as Hugging Face's ``apply_chat_template`` passes them. Any other template gets the tools described
    in a system message (appended to the first system message, or a new one in front), earlier
    tool calls written into the assistant's text in ``tool_format``'s syntax (Hermes'
    ``<tool_call>`` blocks by default), and tool results as user turns in ``<tool_response>`` blocks.

    Args:
        tokenizer: a Hugging Face tokenizer (``apply_chat_template``).
        template: the request's or the model's chat template (None: the model has none).
        tools: the request's ``tools`` as dicts (None: the template sees none).
        tool_format: the syntax of calls in the fallback (the configured ``--tool-call-parser``).
        tool_instructions: how to call, for the fallback's system message (default: the format's).

    Raises:
        APIError: 400 when there is no template or it fails on these messages.
    """
    if not template:
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    native = template_accepts_tools(template)
    fmt = tool_format or HermesToolParser()
    msgs = [chat_message_dict(m, native, fmt) for m in messages]
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        if native:
            kwargs.setdefault("tools", tools)
        else:
            add_system_text(msgs, tools_system_text(tools, tool_instructions or fmt.instructions()))
    try:
        out = tokenizer.apply_chat_template(
            msgs, chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **kwargs)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2 errors, bad kwargs
        raise APIError(f"chat template could not be applied: {type(e).__name__}: {e}",
                       param="messages") from None
    return out if isinstance(out, str) else str(out)


def tool_prompt(body: ChatCompletionRequest, tool_call_parser: str | None,
                exclude_tools_when_tool_choice_none: bool = False
                ) -> tuple[list[dict[str, Any]] | None, ToolParser | None, str | None]:
    """``(tools the template sees, the call syntax, the fallback's instructions)`` of a chat request, under the
    server's ``--tool-call-parser`` and ``--exclude-tools-when-tool-choice-none``.

    Raises:
        KeyError: an unknown parser name (the server's config validates it first).
    """
    if not body.tools:
        return None, None, None
    tc = body.effective_tool_choice
    if tc == "none" and exclude_tools_when_tool_choice_none:
        return None, None, None
    fmt = get_tool_parser(tool_call_parser)() if tool_call_parser else None
    instructions = None
    if isinstance(tc, NamedToolChoice):
        instructions = (f"Call the function {tc.function.name}: reply with only its arguments, as a JSON "
                        "object that follows its parameters' schema.")
    elif tc == "required":
        instructions = ('Reply with only a JSON array of one or more calls, each {"name": <function-name>, '
                        '"parameters": <args-json-object>}.')
    return [t.model_dump(exclude_none=True) for t in body.tools], fmt, instructions


def _arguments_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def chat_message_dict(m: ChatMessage, native: bool, fmt: ToolParser) -> dict[str, Any]:
    """One request message as the dict a chat template renders.

    ``native`` (the template reads ``tools``): ``tool_calls`` with their arguments parsed into objects
    (templates write them with ``tojson``) and ``tool_call_id`` are passed on. Otherwise the calls are
    appended to the content in ``fmt``'s syntax, and a ``tool`` (or legacy ``function``) message becomes a
    user message holding ``<tool_response>`` ... ``</tool_response>``.
    """
    d: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_calls:
        if native:
            calls = []
            for tc in m.tool_calls:
                args: Any = tc.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                call: dict[str, Any] = {"type": "function", "function": {"name": tc.function.name, "arguments": args}}
                if tc.id is not None:
                    call["id"] = tc.id
                calls.append(call)
            d["tool_calls"] = calls
        else:
            text = fmt.format_calls([(tc.function.name, _arguments_text(tc.function.arguments))
                                     for tc in m.tool_calls])
            d["content"] = f"{d['content']}\n{text}" if d["content"] else text
    if m.role in ("tool", "function"):
        if native:
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        else:
            d = {"role": "user", "content": f"<tool_response>\n{d['content']}\n</tool_response>"}
    return d


def tools_system_text(tools: list[dict[str, Any]], instructions: str) -> str:
    """The system-message description of ``tools`` for a template without tool support."""
    lines = ["You may call one or more functions to answer. The available functions, as JSON Schema "
             "definitions:"]
    for t in tools:
        lines.append(json.dumps(t.get("function", t), ensure_ascii=False))
    lines.append("")
    lines.append(instructions)
    return "\n".join(lines)


def add_system_text(msgs: list[dict[str, Any]], text: str) -> None:
    """Append ``text`` to the first system (or developer) message, or put a system message in front."""
    if msgs and msgs[0]["role"] in ("system", "developer"):
        msgs[0]["content"] = f"{msgs[0]['content']}\n\n{text}" if msgs[0]["content"] else text
    else:
        msgs.insert(0, {"role": "system", "content": text})
