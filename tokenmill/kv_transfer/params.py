"""``kv_transfer_params``: the request extra that drives prefill-decode disaggregation (vLLM's keys).

A client (normally ``tokenmill router --pd-disaggregation``) sends

* to a prefill server (``kv_role`` ``kv_producer`` / ``kv_both``): ``{"do_remote_decode": true}``
  with ``max_tokens: 1``. The server computes the prompt, samples one token, keeps the prompt's KV
  blocks, and answers with ``kv_transfer_params`` saying where they are;
* to a decode server (``kv_consumer`` / ``kv_both``): those returned params, i.e. ``{"do_remote_prefill":
  true, "remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id",
  "remote_num_tokens", "remote_block_size"}``. The decode server loads the blocks instead of computing
  the prompt.

This module is torch-free: the API server validates the extra with :func:`validate_kv_transfer_params`.
"""

from __future__ import annotations

from typing import Any

_BOOL_KEYS = ("do_remote_decode", "do_remote_prefill")
_INT_KEYS = ("remote_port", "remote_num_tokens", "remote_block_size", "tp_size")
_STR_KEYS = ("remote_engine_id", "remote_host", "remote_request_id", "kv_connector", "remote_shm_path")
MAX_REMOTE_BLOCKS = 1 << 20


def validate_kv_transfer_params(params: Any) -> dict[str, Any] | None:
    """Check the request extra's types; return a clean copy (None stays None).

    Unknown keys are kept (a newer peer may send more); known keys must have the right type.

    Raises:
        ValueError: not an object, a known key of the wrong type, both ``do_remote_decode`` and
            ``do_remote_prefill`` set, or ``do_remote_prefill`` without ``remote_block_ids`` /
            ``remote_engine_id`` / ``remote_request_id``. The message names the key.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object")
    out = dict(params)
    for k in _BOOL_KEYS:
        if k in out and out[k] is not None and not isinstance(out[k], bool):
            raise ValueError(f"kv_transfer_params.{k} must be a boolean, got {out[k]!r}")
    for k in _INT_KEYS:
        v = out.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"kv_transfer_params.{k} must be a non-negative integer, got {v!r}")
    for k in _STR_KEYS:
        v = out.get(k)
        if v is not None and not isinstance(v, str):
            raise ValueError(f"kv_transfer_params.{k} must be a string, got {v!r}")
    ids = out.get("remote_block_ids")
    if ids is not None:
        if (not isinstance(ids, list) or len(ids) > MAX_REMOTE_BLOCKS
                or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in ids)):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list of non-negative integers")
    if out.get("do_remote_decode") and out.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
    if out.get("do_remote_prefill"):
        missing = [k for k in ("remote_block_ids", "remote_engine_id", "remote_request_id") if out.get(k) is None]
        if missing:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)}")
    return out


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """The request asks this (prefill) server to keep its KV for a decode server."""
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    """The request asks this (decode) server to load its prompt's KV from a prefill server."""
    return bool(params and params.get("do_remote_prefill") and params.get("remote_block_ids"))
