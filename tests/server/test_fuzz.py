"""Schema-driven fuzzing (schemathesis) of a live server: every operation in /openapi.json, bounded examples.

Checks: no 5xx (``not_a_server_error``) and every response matches the schema's documented status codes and
bodies (``status_code_conformance``, ``response_schema_conformance``). The server runs a model-free engine
core (tests.server.fake_serve), so the examples exercise validation, the serving layer and the engine core,
not the model. ``TOKENMILL_FUZZ_EXAMPLES`` raises the bound for a longer run (default 25 per operation).
"""

from __future__ import annotations

import collections

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance  # noqa: E402

from tests.server.live_fake import live_fake_server  # noqa: E402

from tokenmill import envs

EXAMPLES = envs.TOKENMILL_FUZZ_EXAMPLES


def fuzz(url: str, examples: int) -> dict[str, collections.Counter]:
    """Run every operation with ``examples`` generated cases; returns status counts per operation.

    Raises:
        AssertionError (from schemathesis): a check failed, with the reproducing request.
    """
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    statuses: dict[str, collections.Counter] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        seen = statuses.setdefault(op.label, collections.Counter())

        @given(case=op.as_strategy())
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            resp = case.call_and_validate(base_url=url, timeout=60, checks=[
                not_a_server_error, status_code_conformance, response_schema_conformance])
            seen[resp.status_code] += 1
            if resp.status_code == 400 and envs.TOKENMILL_FUZZ_VERBOSE:
                print(op.label, resp.json()["error"]["message"][:150])

        run()
    return statuses


def test_schemathesis_no_server_errors_and_responses_match_the_schema():
    # a short context bounds every generated request (max_tokens near the limit: 128 steps of 10 ms)
    with live_fake_server("--max-model-len", "128", "--num-kv-blocks", "1024") as sp:
        statuses = fuzz(sp.url, EXAMPLES)
        for label, c in sorted(statuses.items()):
            print(f"{label}: {dict(sorted(c.items()))}")
        cmpl = statuses["POST /v1/completions"]
        # the schema describes what is enforced, so most generated bodies are served
        assert cmpl[200] >= 0.5 * sum(cmpl.values()), cmpl
        assert not any(code >= 500 for c in statuses.values() for code in c)
