"""From a request's ``response_format``, ``structured_outputs``, ``guided_*`` and tool choice to the engine's
decoding constraint (:class:`~tokenmill.sampling_params.StructuredOutputsParams`), checked before admission.

Where the constraint comes from, as vLLM decides it:

1. ``tool_choice`` ``"required"`` or a named function (chat, with ``tools``): the tools' parameter schemas
   (:mod:`tokenmill.server.tool_parsers.constrained`); this wins over a ``response_format``.
2. otherwise exactly one of vLLM's ``structured_outputs`` extra, its older ``guided_json`` /
   ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields, or OpenAI's ``response_format``
   (``json_object``, ``json_schema``, vLLM's ``structural_tag``; ``text`` is no constraint). Two of them
   at once is a 400.

``structured_outputs``' JSON options (``disable_any_whitespace``, ``disable_additional_properties``,
``whitespace_pattern``) apply to whichever constraint results. :func:`check_constraint` compiles the
constraint's grammar without a tokenizer (the backend's syntax and schema checks) so a bad schema,
regex or grammar is a 400 naming the request field that carried it, with the backend's message,
before the request reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice
from tokenmill.server.tool_parsers.constrained import named_tool_schema, required_tools_schema, tool_parameters
from tokenmill.structured_output import validate_structured_outputs
from tokenmill.structured_output.backend import StructuredOutputError

# A grammar that takes longer than this to check in the API process is refused (the engine compiles
# it again, with its own --structured-outputs-config compile_timeout_s).
CHECK_TIMEOUT_S = 20.0
# Threads that check constraints: their own pool, not the event loop's default executor (where prompts are
# tokenized): a check that times out keeps running in its thread (xgrammar cannot be interrupted; a regex such
# as "a{1000000}" takes about a minute), so a burst of slow ones would otherwise hold every default thread and
# stall every request's tokenization. Checks beyond these wait in the pool's queue (within CHECK_TIMEOUT_S).
CHECK_THREADS = 2
_check_pool: ThreadPoolExecutor | None = None


def _check_executor() -> ThreadPoolExecutor:
    global _check_pool
    if _check_pool is None:
        _check_pool = ThreadPoolExecutor(max_workers=CHECK_THREADS, thread_name_prefix="constraint-check")
    return _check_pool


@dataclass
class Constraint:
    """A request's decoding constraint and where it came from.

    Attributes:
        params: what the engine decodes under.
        param: the request field that carried it (errors name it), e.g. ``response_format``.
        checks: ``(param, params)`` pairs to check one by one before ``params`` itself (each tool's
            parameter schema, so an error names the tool).
    """

    params: StructuredOutputsParams
    param: str
    checks: list[tuple[str, StructuredOutputsParams]]


# Deepest nesting of a JSON schema a request may send: deeper ones are refused with 400 (Python's
# recursion limit would otherwise turn them into a 500 on the way to the engine).
MAX_SCHEMA_DEPTH = 64


def _depth(v: Any, limit: int) -> int:
    """Nesting depth of a JSON value, stopping once past ``limit``."""
    stack = [(v, 1)]
    deepest = 0
    while stack:
        x, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(x, dict):
            stack.extend((y, d + 1) for y in x.values())
        elif isinstance(x, list):
            stack.extend((y, d + 1) for y in x)
    return deepest


def _schema_text(param: str, schema: Any) -> str:
    """A JSON schema as the JSON text the engine receives (``true`` is the schema ``{}``).

    Raises:
        APIError: 400 for the schema ``false`` (nothing matches) or nesting past :data:`MAX_SCHEMA_DEPTH`.
    """
    if isinstance(schema, str):
        return schema
    if schema is True:
        schema = {}
    if schema is False:
        raise APIError(f"{param}: the schema false matches nothing", param=param)
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise APIError(f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
    return json.dumps(schema, ensure_ascii=False)


def _params(param: str, **kw: Any) -> StructuredOutputsParams:
    if "json" in kw:
        kw["json"] = _schema_text(param, kw["json"])
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        msg = str(e)
        raise APIError(msg if msg.startswith(param) else f"{param}: {msg}", param=param) from None


def _explicit(body: Any) -> list[tuple[str, dict[str, Any]]]:
    """The constraint fields the request sets: ``[(param, StructuredOutputsParams kwargs)]``."""
    found: list[tuple[str, dict[str, Any]]] = []
    so = body.structured_outputs
    if so is not None:
        kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                 "json_object": so.json_object or None, "structural_tag": so.structural_tag}
        given = {k: v for k, v in kinds.items() if v is not None}
        if len(given) > 1:
            raise APIError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
                           f"structural_tag; got {', '.join(given)}", param="structured_outputs")
        for k, v in given.items():
            if k == "structural_tag" and isinstance(v, dict):
                v = json.dumps(v)
            found.append((f"structured_outputs.{k}", {k: v}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        v = getattr(body, name, None)
        if v is not None:
            found.append((name, {kind: v}))
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError("response_format.json_schema.schema is required with type json_schema",
                               param="response_format.json_schema")
            found.append(("response_format.json_schema.schema", {"json": rf.json_schema.json_schema}))
        else:   # structural_tag: vLLM passes the whole object (type included) to the backend
            found.append(("response_format", {"structural_tag": json.dumps(rf.model_dump(exclude_none=True))}))
    return found


def _options(body: Any) -> dict[str, Any]:
    so = body.structured_outputs
    opts: dict[str, Any] = {}
    if so is not None:
        opts = {"disable_any_whitespace": so.disable_any_whitespace,
                "disable_additional_properties": so.disable_additional_properties,
                "whitespace_pattern": so.whitespace_pattern}
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        opts["whitespace_pattern"] = body.guided_whitespace_pattern
    return opts


def _tool_checks(tools: list[dict[str, Any]], opts: dict[str, Any]) -> list[tuple[str, StructuredOutputsParams]]:
    """Each tool's parameter schema as its own check, so an error names ``tools[i].function.parameters``."""
    return [(f"tools[{i}].function.parameters", _params(f"tools[{i}].function.parameters",
                                                        json=tool_parameters(t), **opts))
            for i, t in enumerate(tools)]


def constraint_for(body: Any, auto_parser: Any = None) -> Constraint | None:
    """The request's decoding constraint, or None when it has none.

    Args:
        body: a :class:`~tokenmill.server.protocol.ChatCompletionRequest` or
            :class:`~tokenmill.server.protocol.CompletionRequest`.
        auto_parser: for ``tool_choice: "auto"``, the ``--tool-call-parser``; when the request has no
            other constraint and the parser offers a structural tag (``hermes``), decoding follows it:
            free text until the call marker, then a call valid against one tool's parameter schema.

    Raises:
        APIError: 400 naming the field: two constraint sources, a ``json_schema`` without ``schema``,
            ``structured_outputs`` with options but no constraint, or a malformed constraint.
    """
    opts = _options(body)
    if isinstance(body, ChatCompletionRequest) and body.tools:
        tc = body.effective_tool_choice
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        checks = _tool_checks(tools, opts)
        if isinstance(tc, NamedToolChoice):
            i = next(i for i, t in enumerate(tools) if t["function"]["name"] == tc.function.name)
            return Constraint(_params("tool_choice", json=named_tool_schema(tools[i]), **opts),
                              f"tools[{i}].function.parameters", [])
        if tc == "required":
            try:
                schema = required_tools_schema(tools, body.parallel_tool_calls is not False)
            except ValueError as e:
                raise APIError(str(e), param="tools") from None
            return Constraint(_params("tool_choice", json=schema, **opts), "tools", checks)
    found = _explicit(body)
    if not found and auto_parser is not None:
        tag = auto_parser.structural_tag()
        if tag is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools]
            return Constraint(_params("tools", structural_tag=json.dumps(tag), **opts), "tools",
                              _tool_checks(tools, opts))
    if len(found) > 1:
        raise APIError(f"give one decoding constraint, not {' and '.join(p for p, _ in found)}",
                       param=found[1][0].split(".")[0])
    if not found:
        so = body.structured_outputs
        if so is not None and (so.disable_any_whitespace or so.disable_additional_properties
                               or so.whitespace_pattern):
            raise APIError("structured_outputs needs one of json, regex, choice, grammar, json_object, "
                           "structural_tag", param="structured_outputs")
        return None
    param, kw = found[0]
    return Constraint(_params(param, **kw, **opts), param, [])


def _validator(so_config: Any):
    """The configured backend's tokenizer-free check (xgrammar or llguidance, chosen by the engine side)."""
    return lambda params, config: validate_structured_outputs(params, None, config)


def structural_tags_supported(model_config: Any) -> bool:
    """True when the configured backend compiles structural tags (xgrammar; llguidance refuses them)."""
    return getattr(getattr(model_config, "structured_outputs", None), "backend", "xgrammar") == "xgrammar"


def _rename(message: str, kind: str, param: str) -> str:
    """The backend's ``structured_outputs.<kind>: msg`` message, with the request's own field name."""
    prefix = f"structured_outputs.{kind}:"
    if message.startswith(prefix):
        return f"{param}:{message[len(prefix):]}"
    return f"{param}: {message}"


async def check_constraint(constraint: Constraint, model_config: Any) -> None:
    """Check the constraint's syntax with the configured backend, off the event loop, in a pool of
    :data:`CHECK_THREADS` threads of its own (not the default executor, which tokenizes prompts).

    Args:
        constraint: from :func:`constraint_for`.
        model_config: the engine's :class:`~tokenmill.config.ModelConfig` (its ``structured_outputs``).

    Raises:
        APIError: 400 naming the field that carried the bad constraint, with the backend's message;
            also when the check takes longer than :data:`CHECK_TIMEOUT_S`.
    """
    so_config = getattr(model_config, "structured_outputs", None)
    validate = _validator(so_config)

    for param, params in [*constraint.checks, (constraint.param, constraint.params)]:
        try:
            check = asyncio.get_running_loop().run_in_executor(_check_executor(), validate, params, so_config)
            await asyncio.wait_for(check, CHECK_TIMEOUT_S)
        except StructuredOutputError as e:
            field = e.field or params.kind
            if field == "whitespace_pattern":
                raise APIError(_rename(e.message, field, "structured_outputs.whitespace_pattern"),
                               param="structured_outputs.whitespace_pattern") from None
            raise APIError(_rename(e.message, field, param), param=param) from None
        except asyncio.TimeoutError:
            raise APIError(f"{param}: the constraint took longer than {CHECK_TIMEOUT_S:.0f} s to check",
                           param=param) from None


__all__ = ["Constraint", "check_constraint", "constraint_for", "structural_tags_supported"]
