"""The llguidance backend (``--structured-outputs-config '{"backend": "guidance"}'``; vLLM's ``guidance``):
JSON schema, regex, choice and Lark/GBNF grammars through llguidance's ``LLMatcher`` (Microsoft's
Guidance team; an Earley parser over a lexer, computing the token mask lazily per step).

Needs the optional ``llguidance`` package (``pip install tokenmill[guidance]``). Structural tags are
xgrammar's format and are refused here (400). llguidance compiles lazily inside the matcher, so
"compiling" validates the grammar for the tokenizer and the cost moves to the first masks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import (
    GrammarMatcher, StructuredOutputBackend, StructuredOutputError, disallow_additional_properties,
    resolve_json_options,
)


def _grammar_text(llg: Any, params: StructuredOutputsParams, config: Any) -> str:
    """llguidance's grammar definition of ``params``' constraint.

    Raises:
        StructuredOutputError: a kind llguidance has no form for, or a schema that is not JSON.
    """
    kind = params.kind
    if params.whitespace_pattern is not None:
        raise StructuredOutputError("structured_outputs.whitespace_pattern is not supported by the guidance "
                                    "backend (use disable_any_whitespace)", "whitespace_pattern")
    if kind in ("json", "json_object"):
        any_ws, no_extra = resolve_json_options(params, config)
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"structured_outputs.json: not valid JSON ({e})", "json") from None
        if no_extra:
            schema = disallow_additional_properties(schema)
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": any_ws})
    if kind == "regex":
        return llg.grammar_from("regex", params.regex)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(params.choice))
    if kind == "grammar":
        return llg.grammar_from("grammar", params.grammar)
    raise StructuredOutputError(f"structured_outputs.{kind} is not supported by the guidance backend "
                                "(use the xgrammar backend)", kind)


class GuidanceMatcher(GrammarMatcher):
    """:class:`GrammarMatcher` over an ``llguidance.LLMatcher``.

    llguidance's matcher enters an error state on a refused token, so tokens are checked with
    ``validate_tokens`` (no state change) before they are consumed.
    """

    __slots__ = ("m", "llt")

    def __init__(self, matcher: Any, llg_torch: Any) -> None:
        self.m = matcher
        self.llt = llg_torch

    def accept_token(self, token_id: int) -> bool:
        return self.accept_tokens([token_id]) == 1

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        ids = [int(t) for t in token_ids]
        n = self.m.validate_tokens(ids) if ids else 0
        if n and not self.m.consume_tokens(ids[:n]):
            return 0
        return n

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return int(self.m.validate_tokens([int(t) for t in token_ids])) if token_ids else 0

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.llt.fill_next_token_bitmask(self.m, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())

    def forced_tokens(self, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or self.m.is_stopped():
            return []
        return list(self.m.compute_ff_tokens()[:max_tokens])

    def reset(self) -> None:
        self.m.reset()


class GuidanceBackend(StructuredOutputBackend):
    """Compiles (validates) with llguidance for one Hugging Face fast tokenizer.

    Args:
        tokenizer: the model's Hugging Face fast tokenizer.
        vocab_size: the model's logits width.
        stop_token_ids: the model's EOS ids.
        config: the server's :class:`~tokenmill.config.StructuredOutputsConfig`.

    Raises:
        ValueError: the ``llguidance`` package is not installed.
    """

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], config: Any = None) -> None:
        try:
            import llguidance
            import llguidance.hf
            import llguidance.torch
        except ImportError:
            raise ValueError("structured outputs backend 'guidance' needs the llguidance package "
                             "(pip install llguidance)") from None
        self.llg, self.llt = llguidance, llguidance.torch
        self.config = config
        self.vocab_size = int(vocab_size)
        eos = list(stop_token_ids)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=(eos[0] if len(eos) == 1 else eos) or None)

    def compile(self, params: StructuredOutputsParams) -> str:
        try:
            grammar = _grammar_text(self.llg, params, self.config)
            error = self.llg.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        except StructuredOutputError:
            raise
        except (ValueError, TypeError, RuntimeError) as e:
            error = str(e)
        if error:
            kind = params.kind
            raise StructuredOutputError(f"structured_outputs.{kind}: {str(error).strip()}", kind)
        return grammar

    def new_matcher(self, compiled: str) -> GuidanceMatcher:
        return GuidanceMatcher(self.llg.LLMatcher(self.ll_tokenizer, compiled), self.llt)

    def allocate_bitmask(self, num_rows: int) -> Any:
        return self.llt.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: Any, bitmask: Any, rows: list[int]) -> None:
        from tokenmill.structured_output.xgrammar_backend import apply_bitmask_torch

        apply_bitmask_torch(logits, bitmask, rows)


def validate_with_guidance(params: StructuredOutputsParams, tokenizer: Any, config: Any = None) -> None:
    """Validate ``params``' constraint with llguidance (for ``tokenizer`` when given).

    Raises:
        StructuredOutputError: invalid or unsupported (names the field, carries llguidance's message).
        ValueError: llguidance is not installed.
    """
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs backend 'guidance' needs the llguidance package") from None
    if tokenizer is not None:
        GuidanceBackend(tokenizer, len(tokenizer), [], config).compile(params)
        return
    grammar = _grammar_text(llguidance, params, config)
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise StructuredOutputError(f"structured_outputs.{params.kind}: {str(error).strip()}", params.kind)
