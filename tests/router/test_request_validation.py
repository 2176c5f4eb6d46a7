"""One request validation for both router paths (:meth:`Router.parse_body`): the plain proxy and the
prefill-decode flow refuse the same bad bodies with the same 400 and count them alike (no servers)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill.router.backends import BackendSpec
from tokenmill.router.pd import proxy_pd
from tokenmill.router.router import Router, RouterConfig


class _Body:
    """The one thing the two paths read before validating: the raw body."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def body(self) -> bytes:
        return self.raw


def _routers() -> tuple[Router, Router]:
    plain = Router(RouterConfig(backends=[BackendSpec("http://127.0.0.1:9")]))
    pd = Router(RouterConfig(pd_disaggregation=True, prefill=[BackendSpec("http://127.0.0.1:9")],
                             decode=[BackendSpec("http://127.0.0.1:10")]))
    return plain, pd


def _bad_requests(r: Router) -> float:
    return r.metrics.errors.labels("bad_request")._value.get()


BAD = {
    "not JSON": (b"{oops", "request body is not valid JSON"),
    "not UTF-8": (b"\xff\xfe", "request body is not valid JSON"),
    "not an object": (b"[1, 2]", "request body must be a JSON object"),
    "model not a string": (json.dumps({"model": 7, "prompt": "x"}).encode(), "`model` must be a string"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_both_paths_refuse_a_bad_body_alike(case):
    raw, message = BAD[case]
    plain, pd = _routers()
    answers = [asyncio.run(plain.proxy(_Body(raw), "/v1/completions")),
               asyncio.run(proxy_pd(pd, _Body(raw), "/v1/completions"))]
    for r, resp in zip((plain, pd), answers):
        assert resp.status_code == 400
        assert message in json.loads(resp.body)["error"]["message"]
        assert _bad_requests(r) == 1
    assert answers[0].body == answers[1].body


def test_parse_body_returns_the_object_and_its_model():
    plain, _ = _routers()
    assert plain.parse_body(b'{"model": "m", "prompt": "x"}') == ({"model": "m", "prompt": "x"}, "m")
    assert plain.parse_body(b"") == ({}, None)          # no backend has listed a model yet: any pool
    assert _bad_requests(plain) == 0
