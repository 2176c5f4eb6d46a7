"""Structured outputs: decoding constrained to a JSON schema, regex, choice, grammar or structural tag.

Layout (docs/guide/structured_outputs_engine.md):

* :mod:`.backend` — the backend interface (compile → matcher: accept tokens, fill bitmask, rollback,
  is_terminated, forced tokens) and :class:`StructuredOutputError` (HTTP 400).
* :mod:`.xgrammar_backend` — xgrammar behind it (default); :mod:`.guidance_backend` — llguidance (optional).
* :mod:`.manager` — the engine core's side: compile cache + thread pool, per-request matchers, the
  per-step bitmask filled while the forward runs, forced tokens as free drafts, metrics.

The server may pre-validate a request synchronously with :func:`validate_structured_outputs`; the
engine validates again when it compiles (an invalid constraint there fails the request with 400).
"""

from __future__ import annotations

import functools
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputError

__all__ = ["StructuredOutputError", "validate_structured_outputs"]


def validate_structured_outputs(params: StructuredOutputsParams, tokenizer: Any = None, config: Any = None) -> None:
    """Check that the backend accepts ``params``' constraint; raise :class:`StructuredOutputError` if not.

    Without ``tokenizer`` the constraint is parsed only (schema, regex and grammar syntax; milliseconds);
    with one it is compiled for that tokenizer as the engine would (the compiled grammar is not kept).
    Imports the backend library (xgrammar, and with it torch) on first use.

    Args:
        params: the request's ``structured_outputs`` (already :meth:`StructuredOutputsParams.validate`-d).
        tokenizer: optional Hugging Face tokenizer of the served model.
        config: the server's :class:`~tokenmill.config.StructuredOutputsConfig` (backend, whitespace and
            additional-properties defaults); None: the defaults.

    Raises:
        StructuredOutputError: the constraint is invalid or unsupported; ``.field`` names the
            ``structured_outputs`` field, the message carries the backend's own text (HTTP 400).
    """
    if getattr(config, "backend", "xgrammar") == "guidance":
        from tokenmill.structured_output.guidance_backend import validate_with_guidance

        validate_with_guidance(params, tokenizer, config)
        return
    if tokenizer is None:
        from tokenmill.structured_output.xgrammar_backend import validate_with_xgrammar

        validate_with_xgrammar(params, config)
        return
    _backend_for(tokenizer, config).compile(params)


@functools.lru_cache(maxsize=4)
def _backend_for(tokenizer: Any, config: Any) -> Any:
    """One xgrammar backend per (tokenizer, config): building its vocabulary table takes ~0.2 s."""
    from tokenmill.structured_output.xgrammar_backend import XgrammarBackend

    return XgrammarBackend(tokenizer, len(tokenizer), [], config)
