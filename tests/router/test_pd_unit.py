"""``tokenmill router --pd-disaggregation``: flags and the prefill request (no servers)."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.router.app import Router, RouterConfig
from tokenmill.router.backends import BackendSpec
from tokenmill.router.cli import add_router_parser, config_from_args
from tokenmill.router.pd import prefill_body


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_router_parser(parser.add_subparsers())
    return parser.parse_args(["router", *argv])


def test_flags():
    cfg = config_from_args(_args("--pd-disaggregation", "--prefill", "http://a:1", "--prefill", "http://b:2",
                                 "--decode", "http://c:3"))
    assert cfg.pd_disaggregation and [b.url for b in cfg.prefill] == ["http://a:1", "http://b:2"]
    assert [b.url for b in cfg.decode] == ["http://c:3"]
    r = Router(cfg)
    assert r.prefill_indices == {0, 1} and len(r.backends) == 3
    with pytest.raises(ValueError, match="--decode"):
        config_from_args(_args("--pd-disaggregation", "--prefill", "http://a:1"))
    with pytest.raises(ValueError, match="need --pd-disaggregation"):
        config_from_args(_args("--prefill", "http://a:1", "--decode", "http://c:3"))
    with pytest.raises(ValueError, match="not --backend"):
        config_from_args(_args("--pd-disaggregation", "--prefill", "http://a:1", "--decode", "http://c:3",
                               "--backend", "http://d:4"))
    with pytest.raises(ValueError, match="--prefill URL"):
        Router(RouterConfig(pd_disaggregation=True, decode=[BackendSpec("http://c:3")]))


def test_prefill_body_asks_for_one_token_and_remote_decode():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "temperature": 0.7}
    pre = prefill_body(body)
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1 and pre["stream"] is False
    assert "stream_options" not in pre and "min_tokens" not in pre and pre["n"] == 1
    assert pre["kv_transfer_params"] == {"do_remote_decode": True} and pre["temperature"] == 0.7
    assert body["max_tokens"] == 50 and body["stream"] is True      # the original is untouched
