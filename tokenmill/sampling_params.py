"""Per-request sampling and stopping parameters (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A decoding constraint (vLLM's ``structured_outputs`` request extra; same field names).

    Exactly one of the constraint fields is set. The server maps OpenAI's ``response_format`` and
    ``tools`` / ``tool_choice`` onto it; the engine compiles it with the configured backend (xgrammar).

    Attributes:
        json: a JSON schema (dict, or its JSON text) the output must validate against.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a grammar in a syntax the backend accepts (EBNF/GBNF for xgrammar).
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        structural_tag: a structural-tag specification (JSON text; xgrammar's ``structural_tag``): free
            text in which each trigger opens a constrained span.
        disable_any_whitespace: JSON without optional whitespace (vLLM's option of the same name).
        disable_additional_properties: treat JSON objects as ``additionalProperties: false`` unless the
            schema says otherwise (vLLM's option).
        whitespace_pattern: the regex optional JSON whitespace must match (backend permitting).
    Raises:
        ValueError: from :meth:`validate` when no constraint or more than one is set, or a field has the
            wrong type.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check that exactly one constraint is set; raise ``ValueError`` naming the field otherwise."""
        set_kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of " + ", ".join(_CONSTRAINT_KINDS)
                             + (f"; got {', '.join(set_kinds)}" if set_kinds else "; got none"))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string)")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value == ""):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """The constraint's kind: one of json, regex, choice, grammar, json_object, structural_tag."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        n: completions to generate for the prompt (each is a separate request
            in the engine sharing the prompt's cached blocks).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 or -1 disables (other negatives are rejected, as vLLM).
        min_p: drop tokens whose probability is below ``min_p`` × the top
            token's probability; 0 disables.
        repetition_penalty: CTRL-style penalty (Keskar et al. 2019, §4.1) on
            tokens seen in prompt or output: logits > 0 are divided by it,
            < 0 multiplied; 1 disables; allowed range [0.01, 100].
        presence_penalty: subtracted once from the logit of every token that
            appeared in the output (OpenAI semantics), in [-2, 2].
        frequency_penalty: subtracted per occurrence in the output, in [-2, 2].
        seed: per-request RNG seed; the sampled tokens then do not depend on
            what else is in the batch.
        max_tokens: maximum new tokens (None: up to the context limit).
        min_tokens: EOS, stop token ids and stop strings are ignored before
            this many new tokens.
        stop: strings that end the output when generated (excluded from the
            text unless ``include_stop_str_in_output``).
        stop_token_ids: token ids that end the output (kept in token ids).
        ignore_eos: keep generating past EOS.
        logprobs: return this many top log-probabilities per generated token
            (plus the sampled token's own); None for none.
        prompt_logprobs: also return, for every prompt token after the
            first, its log-probability given the tokens before it and this
            many top alternatives (vLLM's ``prompt_logprobs``); None for
            none. Such a request computes its whole prompt (no prefix-cache
            hits), since cached positions have no logits; they arrive with
            the first generated token, so ``max_tokens`` must be >= 1
            (ValueError otherwise; the server's ``echo`` with ``max_tokens:
            0`` samples one token and drops it).
        skip_special_tokens: drop special tokens from the text.
        logit_bias: token id -> value in [-100, 100] added to that token's
            logit before sampling (OpenAI's ``logit_bias``; the raw logprobs
            modes report the distribution before it).
        kv_transfer_params: prefill-decode disaggregation (vLLM's request extra, see
            :mod:`tokenmill.kv_transfer`): ``{"do_remote_decode": true}`` on a prefill server keeps the
            prompt's KV for a decode server; ``{"do_remote_prefill": true, "remote_engine_id",
            "remote_block_ids", "remote_host", "remote_port", "remote_request_id", ...}`` on a decode
            server loads it instead of computing the prompt. None: an ordinary request.
        structured_outputs: a decoding constraint (JSON schema, regex, choice, grammar, structural tag;
            see :class:`StructuredOutputsParams`); None: unconstrained.
    Raises:
        ValueError: from :meth:`validate` (called on construction) naming the
            offending field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    # P/D disaggregation (vLLM's request extra): do_remote_decode / do_remote_prefill and where the KV is
    kv_transfer_params: dict[str, Any] | None = None
    # Structured outputs (vLLM's ``structured_outputs`` request extra): the constraint decoding follows
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = 0
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Check ranges; raise ``ValueError`` naming the bad field."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.01 <= self.repetition_penalty <= 100):
            raise ValueError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        if not (-2 <= self.presence_penalty <= 2):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not (-2 <= self.frequency_penalty <= 2):
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.prompt_logprobs is not None and self.max_tokens == 0:
            raise ValueError("prompt_logprobs needs max_tokens >= 1 (they come with the first generated token)")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.logit_bias:
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or t < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
                if not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature < 1e-5
