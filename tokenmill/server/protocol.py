"""Request models of the OpenAI-compatible API (pydantic), with vLLM's extras.

Unknown fields are ignored (as OpenAI and vLLM do). Values that parse but are
out of range raise :class:`APIError` (HTTP 400) naming the field in ``param``.
Responses are built as plain dicts in :mod:`tokenmill.server.serving_completion` and :mod:`tokenmill.server.serving_chat` (cheaper than
models on the streaming path); their shapes follow OpenAI's reference.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tokenmill.kv_transfer.params import validate_kv_transfer_params
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

# Most log-probabilities per token a request may ask for (vLLM's default limit).
MAX_LOGPROBS = 20
# Every stop string is checked against the new text of every generated token in the API process's
# event loop: a million of them (10 MB, inside the body limit) cost ~0.8 s per token and stall every
# other request. OpenAI allows 4 stop strings; vLLM sets no limit; these bounds keep the per-token
# cost under a millisecond.
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 65536


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON ``{"error": {message, type, param, code}}``.

    Args:
        message: what went wrong, for humans.
        status: HTTP status (400, 401, 404, 429, 500, 503).
        param: the offending request field, if any.
        headers: extra response headers (e.g. ``Retry-After`` on 429).
    """

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


class _Base(BaseModel):
    # allow_inf_nan=False: Python's JSON parser reads NaN and Infinity; every float field refuses them while
    # parsing with "Input should be a finite number" (inherited by the subclasses' own model_config)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# A token id: ``x-token-id`` marks it so the served OpenAPI schema gets ``maximum: vocab_size - 1``
# (tokenmill.server.app.openapi_with_vocab); the server checks the bound for every such field.
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True})]
StopString = Annotated[str, Field(min_length=1)]
LOGIT_BIAS_KEY = r"^[0-9]+$"


class ErrorBody(BaseModel):
    """The ``error`` object of every error response."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI-shaped error response (every 4xx/5xx)."""

    error: ErrorBody


class StreamOptions(_Base):
    """``stream_options``: ``include_usage`` adds a final usage chunk; ``continuous_usage_stats``
    (vLLM) adds the running usage to every chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# OpenAI's service_tier values, plus "batch": the batch lane (also selected by OpenAI's "flex").
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "batch")
BATCH_SERVICE_TIERS = ("batch", "flex")


class JSONSchemaFormat(_Base):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted; the output always
    follows the schema)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=256, description="The schema's name (a-z, A-Z, 0-9, _ and -).")
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema",
                                                      description="The JSON Schema the output must validate against.")
    strict: bool | None = None


class ResponseFormat(_Base):
    """``response_format``: ``text`` (unconstrained), ``json_object`` (any JSON object), ``json_schema``
    (a schema), or vLLM's ``structural_tag`` (its other fields are passed to the backend as they are)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(_Base):
    """vLLM's ``structured_outputs`` request extra: exactly one constraint, plus JSON options."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json", description="A JSON Schema (object or its text).")
    regex: str | None = Field(None, description="A regular expression the whole output must match.")
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, description="An EBNF (GBNF) grammar.")
    json_object: bool | None = Field(None, description="Any JSON object.")
    structural_tag: str | dict[str, Any] | None = Field(None, description="xgrammar's structural tag (object or text).")
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class _SamplingFields(_Base):
    """Sampling fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: str | None = Field(None, description="The served model name (optional; another name is a 404).")
    n: int = Field(1, ge=1, le=128, description="Choices per prompt.")
    temperature: float | None = Field(None, ge=0, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    stop: StopString | list[StopString] | None = Field(
        None, description=f"At most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters in all.")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    user: str | None = None
    logit_bias: dict[Annotated[str, Field(pattern=LOGIT_BIAS_KEY)], Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="Token id (a decimal string, < vocab size) -> bias added to its logit.")
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="Must not exceed max_tokens.")
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(0, description="Non-zero only with --scheduling-policy priority (lower runs sooner).")
    cache_salt: str | None = Field(None, min_length=1)
    request_id: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Not with stream: true.")
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="Prefill-decode disaggregation (vLLM's extra): {do_remote_decode: true} asks a prefill "
                          "server (--kv-transfer-config kv_producer) to keep the prompt's KV; the params it returns "
                          "({do_remote_prefill: true, remote_engine_id, remote_block_ids, remote_host, remote_port, "
                          "remote_request_id, ...}) make a decode server (kv_consumer) load it instead of computing "
                          "the prompt.")
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM's decoding constraint: exactly one of json, regex, choice, grammar, json_object, "
                          "structural_tag.")
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's output format: text, json_object, json_schema (vLLM: structural_tag).")
    # vLLM's older spellings of structured_outputs.*
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "batch"] | None = Field(
        None, description="OpenAI's processing tier. 'batch' (tokenmill) or 'flex' (OpenAI's slower tier): the "
                          "batch lane, never refused with 429, served with the capacity interactive requests leave.")

    @property
    def is_batch(self) -> bool:
        """True for the batch lane (``service_tier`` ``"batch"`` or ``"flex"``)."""
        return self.service_tier in BATCH_SERVICE_TIERS

    def token_id_fields(self) -> list[tuple[str, list[int]]]:
        """Every field of the request that carries token ids, as ``(param, ids)``."""
        out: list[tuple[str, list[int]]] = []
        if self.stop_token_ids:
            out.append(("stop_token_ids", list(self.stop_token_ids)))
        if self.logit_bias:
            out.append(("logit_bias", [int(k) for k in self.logit_bias]))
        return out

    def _check_common(self) -> None:
        if self.logit_bias:
            for k in self.logit_bias:
                if not k.isdigit():
                    raise APIError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
        if self.n < 1:
            raise APIError(f"n must be >= 1, got {self.n}", param="n")
        if self.n > 128:
            raise APIError(f"n must be <= 128, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if self.cache_salt is not None and self.cache_salt == "":
            raise APIError("cache_salt must be a non-empty string", param="cache_salt")
        if isinstance(self.stop, list):
            if len(self.stop) > MAX_STOP_STRINGS:
                raise APIError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                               param="stop")
            if sum(len(x) for x in self.stop) > MAX_STOP_CHARS:
                raise APIError(f"stop strings may total at most {MAX_STOP_CHARS} characters", param="stop")
        elif isinstance(self.stop, str) and len(self.stop) > MAX_STOP_CHARS:
            raise APIError(f"stop strings may total at most {MAX_STOP_CHARS} characters", param="stop")
        if self.kv_transfer_params is not None:
            try:
                self.kv_transfer_params = validate_kv_transfer_params(self.kv_transfer_params)
            except ValueError as e:
                raise APIError(str(e), param="kv_transfer_params") from None
            if self.n != 1 and (self.kv_transfer_params.get("do_remote_decode")
                                or self.kv_transfer_params.get("do_remote_prefill")):
                raise APIError("kv_transfer_params needs n = 1", param="kv_transfer_params")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise APIError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
                               param="prompt_logprobs")
            if self.stream:   # as vLLM: they would all arrive before the first token anyway
                raise APIError("prompt_logprobs is not available when stream is true", param="prompt_logprobs")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        """Build :class:`SamplingParams`.

        Args:
            structured_outputs: the decoding constraint (:mod:`tokenmill.server.structured`), None: none.
            skip_special_tokens: overrides the request's (a tool parser that needs special tokens).

        Raises:
            APIError: 400 naming the field SamplingParams rejected.
        """
        self._check_common()
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
                kv_transfer_params=self.kv_transfer_params,
                structured_outputs=structured_outputs,
            )
        except ValueError as e:
            msg = str(e)
            raise APIError(msg, param=msg.split(" ", 1)[0] if msg else None) from None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids, or a list
    of token-id lists; each prompt yields ``n`` choices (indices
    ``prompt_index * n + i``).
    """

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] \
        | Annotated[list[TokenId], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)] = Field(
            description="Text, texts, token ids or lists of token ids (each yields n choices).")

    @field_validator("prompt", mode="before")
    @classmethod
    def _negative_token_ids(cls, v: Any) -> Any:
        # Without this a negative id fails every union branch and pydantic reports "should be a valid string".
        if isinstance(v, list):
            for item in v:
                ids = item if isinstance(item, list) else [item]
                for t in ids:
                    if isinstance(t, int) and not isinstance(t, bool) and t < 0:
                        raise ValueError(f"token id {t} is out of range (token ids are >= 0)")
        return v
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: true; prompt + max_tokens <= max_model_len.")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: None = Field(None, description="Not supported (only null).")
    best_of: int | None = Field(None, ge=1, le=128, description="Must equal n.")
    add_special_tokens: bool = True

    def token_id_fields(self) -> list[tuple[str, list[int]]]:
        out = super().token_id_fields()
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], str):
            for item in (p if isinstance(p[0], list) else [p]):
                out.append(("prompt", list(item)))  # type: ignore[arg-type]
        return out

    def check(self) -> None:
        """Validate fields that pydantic cannot (raises :class:`APIError`)."""
        self._check_common()
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of other than n is not supported", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            # max_tokens=0 only makes sense with echo (the prompt back, nothing generated)
            raise APIError(f"max_tokens must be >= 1 (>= 0 with echo), got {self.max_tokens}", param="max_tokens")
        p = self.prompt
        if isinstance(p, str):
            return
        if len(p) == 0 or any(isinstance(x, list) and len(x) == 0 for x in p):
            raise APIError("prompt must not be empty", param="prompt")

    @property
    def effective_prompt_logprobs(self) -> int | None:
        """Top entries per prompt token the engine computes: ``prompt_logprobs``, or with ``echo``
        the ``logprobs`` setting (as vLLM, so echoed prompt tokens carry their logprobs)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def echo_without_generation(self) -> bool:
        """``echo`` with ``max_tokens`` 0: only the prompt comes back. When prompt logprobs are
        wanted the engine still runs the prompt and samples one token, which is not returned."""
        return self.echo and self.max_tokens == 0


class ContentPart(_Base):
    """A part of a multi-part message; only ``{"type": "text", "text": ...}`` is supported."""

    type: Literal["text"]
    text: str | None = None


class FunctionCallParam(_Base):
    name: str
    arguments: str | dict[str, Any] = Field("{}", description="JSON text (an object is accepted too).")


class ToolCallParam(_Base):
    """An assistant message's earlier tool call (``messages[i].tool_calls[j]``)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(_Base):
    """One chat message. ``content`` may be a string or a list of text parts.

    ``role`` is one of OpenAI's (:data:`CHAT_ROLES`); ``content`` may be null only for ``assistant``
    (OpenAI allows it there, with tool calls). Anything else is refused with 400 naming
    ``messages[i].role`` / ``messages[i].content``.
    """

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="An assistant turn's tool calls.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")

    @field_validator("content")
    @classmethod
    def _content_required(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"content is required for a {role!r} message")
        return v

    def text(self) -> str:
        """The content as one string (text parts joined by newlines).

        Raises:
            APIError: a non-text part.
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text":
                raise APIError(f"content part type {part.type!r} is not supported (only 'text')",
                               param="messages")
            out.append(part.text or "")
        return "\n".join(out)


class FunctionDefinition(_Base):
    """``tools[i].function``: a function the model may call."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: bool | None = None


class ToolParam(_Base):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Base):
    name: str = Field(min_length=1)


class NamedToolChoice(_Base):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Default: the rest of the context.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Takes precedence over max_tokens.")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Above 0 only with logprobs: true.")
    add_generation_prompt: bool = Field(True, description="Not together with continue_final_message.")
    continue_final_message: bool = Field(False, description="Needs the last message from the assistant.")
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=1024, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without.")
    parallel_tool_calls: bool | None = Field(True, description="False: at most one call per turn.")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice``, defaulting to ``auto`` when tools are given and ``none`` otherwise (OpenAI)."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def check(self) -> None:
        """Validate fields that pydantic cannot (raises :class:`APIError`)."""
        self._check_common()
        tc = self.tool_choice
        if tc == "auto" and not self.tools:
            raise APIError('tool_choice "auto" needs tools', param="tool_choice")
        if isinstance(tc, NamedToolChoice) or tc == "required":
            if not self.tools:
                raise APIError(f"tool_choice {'required' if tc == 'required' else 'for a named function'} "
                               "needs tools", param="tool_choice")
            if isinstance(tc, NamedToolChoice) and tc.function.name not in {t.function.name for t in self.tools}:
                raise APIError(f"tool_choice names the function {tc.function.name!r}, which is not in tools "
                               f"({', '.join(t.function.name for t in self.tools)})", param="tool_choice")
        if self.tools:
            names = [t.function.name for t in self.tools]
            dup = next((n for n in names if names.count(n) > 1), None)
            if dup is not None:
                raise APIError(f"tools define the function {dup!r} twice", param="tools")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                               param="top_logprobs")
            if not self.logprobs and self.top_logprobs > 0:
                raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError("add_generation_prompt and continue_final_message cannot both be true",
                           param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError("continue_final_message needs the last message to be from the assistant",
                           param="continue_final_message")
        mt = self.requested_max_tokens
        if mt is not None and mt < 1:
            param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise APIError(f"{param} must be >= 1, got {mt}", param=param)

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens`` (None: up to the context limit)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top-N alternatives per token for the sampler (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Base):
    """``POST /tokenize``: either ``prompt`` or chat ``messages`` (rendered with the chat template)."""

    # exactly one of the two, as the schema states
    model_config = ConfigDict(extra="ignore", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}, "not": {"required": ["messages"]}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}, "not": {"required": ["prompt"]}}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[ToolParam] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")


class LoadLoRAAdapterRequest(_Base):
    """``POST /v1/load_lora_adapter`` (vLLM's body): serve the PEFT adapter folder ``lora_path`` as model
    ``lora_name`` (needs ``--enable-lora --allow-runtime-lora-updating``)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Base):
    """``POST /v1/unload_lora_adapter`` (vLLM's body): stop serving ``lora_name``; its requests in flight
    finish with it. ``lora_int_id`` is accepted (vLLM sends it) and must match when given."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class KVTransferReleaseRequest(_Base):
    """``POST /kv_transfer/release``: free the KV a prefill server keeps for a decode server that will not
    come (sent by ``tokenmill router --pd-disaggregation`` when the decode leg fails).

    ``kv_transfer_params`` is the object the prefill server returned; ``remote_request_id`` (required)
    and ``remote_engine_id`` name the hold.
    """

    kv_transfer_params: dict[str, Any]

    def target(self) -> tuple[str, str | None]:
        """``(remote_request_id, remote_engine_id)``.

        Raises:
            APIError: 400 when ``remote_request_id`` is missing or a key has the wrong type.
        """
        try:
            p = validate_kv_transfer_params(self.kv_transfer_params) or {}
        except ValueError as e:
            raise APIError(str(e), param="kv_transfer_params") from None
        rid = p.get("remote_request_id")
        if not rid:
            raise APIError("kv_transfer_params.remote_request_id is required",
                           param="kv_transfer_params.remote_request_id")
        return rid, p.get("remote_engine_id")


class DetokenizeRequest(_Base):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


_TYPE_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}


def error_param_from_loc(loc: tuple | list) -> str | None:
    """Turn a pydantic error location (``("body", "messages", 0, "role")``) into ``messages[0].role``.

    Union branch names that pydantic inserts (``str``, ``list[int]``, ...) are dropped.
    """
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and (p in _TYPE_BRANCHES or "[" in p or p.startswith(("function-", "constrained-"))):
            continue
        else:
            out += ("." if out else "") + str(p)
    return out or None


__all__ = ["APIError", "ErrorResponse", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart",
           "DetokenizeRequest", "FunctionDefinition", "JSONSchemaFormat", "NamedToolChoice", "ResponseFormat",
           "StreamOptions", "StructuredOutputsRequest", "TokenizeRequest", "ToolCallParam", "ToolParam",
           "MAX_LOGPROBS", "error_param_from_loc"]
