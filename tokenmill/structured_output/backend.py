"""The backend interface of structured outputs: compile a constraint, then drive one matcher per request.

A backend (:class:`StructuredOutputBackend`) turns a request's
:class:`~tokenmill.sampling_params.StructuredOutputsParams` into a compiled
grammar for one tokenizer; each constrained request gets its own
:class:`GrammarMatcher` over it, a pushdown automaton over token ids (the
token-level constrained decoding of XGrammar, Dong et al., arXiv 2411.15100, §2-3:
a context-free grammar's byte-level automaton, with the vocabulary split into
context-independent tokens checked ahead of time and context-dependent ones
checked at run time against the stack).

Per step the engine asks each matcher for its **token bitmask**: ``ceil(V / 32)``
int32 words per row, bit ``t % 32`` of word ``t // 32`` set when token ``t`` may
come next. Sampled tokens are accepted into the matcher; draft tokens are
accepted tentatively to fill the rows that verify them and rolled back.

Errors: a constraint the backend cannot compile (bad schema, regex, grammar,
unsupported option) raises :class:`StructuredOutputError`, which the engine turns
into a failed request with HTTP status 400 and the server may raise directly.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled or is not supported: the client's fault (HTTP 400).

    Attributes:
        field: the ``structured_outputs`` field at fault (``json``, ``regex``, ``choice``, ``grammar``,
            ``json_object``, ``structural_tag``, ``whitespace_pattern``), or None.
        message: the whole message, naming the field and carrying the backend's own text.
        status_code: 400.
    """

    status_code = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class GrammarMatcher(abc.ABC):
    """One request's position in its grammar.

    Token ids are those of the model's vocabulary (``[0, vocab_size)``); the
    model's EOS ids are the grammar's stop tokens: they are allowed exactly when
    the output so far is a complete match, and accepting one terminates the matcher.
    """

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""

    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Advance by each token in turn, stopping at the first the grammar refuses.

        Returns:
            how many were accepted (``len(token_ids)`` when all were).
        """
        for i, t in enumerate(token_ids):
            if not self.accept_token(int(t)):
                return i
        return len(token_ids)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """The length of the longest prefix of ``token_ids`` the grammar allows from here; state unchanged."""
        n = self.accept_tokens(token_ids)
        if n:
            self.rollback(n)
        return n

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` (``[R, ceil(V / 32)]`` int32 tensor)."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted (nothing may follow)."""

    @abc.abstractmethod
    def forced_tokens(self, max_tokens: int) -> list[int]:
        """Tokens the grammar forces next (it allows exactly one continuation string), at most ``max_tokens``.

        They are a tokenization of that string, not necessarily the model's: the
        engine uses them as draft tokens the model verifies (never emitted unverified).
        Empty when nothing is forced. State unchanged.
        """

    def forced_string(self) -> bytes:
        """The bytes the grammar forces next (its only continuation up to the next choice); ``b""`` when
        nothing is forced or the backend cannot tell. State unchanged."""
        return b""

    def forced_tokens_for(self, text: bytes, max_tokens: int) -> list[int]:
        """:meth:`forced_tokens` for the string :meth:`forced_string` just returned (saves a second search)."""
        return self.forced_tokens(max_tokens)

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar (no token accepted)."""


class StructuredOutputBackend(abc.ABC):
    """Compiles constraints for one tokenizer and makes matchers over them.

    Implementations must be safe to call :meth:`compile` from several threads
    at once (the engine compiles on a thread pool).

    Attributes:
        name: the backend's name in ``--structured-outputs-config`` (``xgrammar``, ``guidance``).
        vocab_size: logits width the bitmasks cover.
    """

    name: str = ""
    vocab_size: int = 0

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile ``params``' constraint; returns an opaque compiled grammar.

        Raises:
            StructuredOutputError: the constraint is invalid or unsupported (names the field).
        """

    @abc.abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""

    @abc.abstractmethod
    def allocate_bitmask(self, num_rows: int) -> Any:
        """A ``[num_rows, ceil(vocab_size / 32)]`` int32 tensor for :meth:`GrammarMatcher.fill_bitmask`."""

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: Any, rows: Sequence[int]) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` for ``matchers[i]``, for every ``i`` (a backend may batch it)."""
        for m, r in zip(matchers, rows):
            m.fill_bitmask(bitmask, r)

    def token_bytes(self) -> Sequence[bytes] | None:
        """Each token id's bytes in the output (``b""`` for special tokens), or None when unknown (then
        forced drafts are never learned from what the model wrote)."""
        return None

    @abc.abstractmethod
    def apply_bitmask(self, logits: Any, bitmask: Any, rows: list[int]) -> None:
        """Set ``logits[rows[i], t]`` to ``-inf`` for every token ``t`` not allowed by ``bitmask[i]``, in place.

        Args:
            logits: ``[num_rows_total, V]`` float tensor.
            bitmask: ``[len(rows), ceil(V / 32)]`` int32 tensor.
            rows: the logits row of each bitmask row.
        """


def resolve_json_options(params: StructuredOutputsParams, config: Any) -> tuple[bool, bool]:
    """``(any_whitespace, disable_additional_properties)`` from the request and the server's config."""
    any_ws = not (params.disable_any_whitespace or getattr(config, "disable_any_whitespace", False))
    no_extra = params.disable_additional_properties or getattr(config, "disable_additional_properties", False)
    return any_ws, no_extra


def constraint_key(params: StructuredOutputsParams, config: Any = None) -> tuple:
    """A hashable key of everything that decides the compiled grammar (the compile cache's key).

    Two requests with equal keys share one compiled grammar (for one tokenizer).
    """
    import json

    kind = params.kind
    value = getattr(params, kind)
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)       # a schema as text and as an object share one entry
        except json.JSONDecodeError:
            pass                            # (compiling it reports the error)
    if isinstance(value, (dict, list)):
        value = json.dumps(value, sort_keys=True, separators=(",", ":"))
    any_ws, no_extra = resolve_json_options(params, config)
    return (kind, value, any_ws, no_extra, params.whitespace_pattern)


def disallow_additional_properties(schema: Any) -> Any:
    """A copy of a JSON schema where every object schema without ``additionalProperties`` gets ``false``
    (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [disallow_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: disallow_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
