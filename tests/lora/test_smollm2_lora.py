"""A LoRA adapter on the packaged SmolLM2 model through the server (slow): with structured outputs
(``response_format`` json_schema), in the batch lane (``service_tier: batch``) and through
``tokenmill run-batch``. The adapter is random (rank 8, every target), written without any download."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import jsonschema
import pytest

from tests.lora.conftest import save_random_adapter
from tests.server.server_proc import start_server

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "The three most useful kitchen tools are"
ENGINE = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--kv-cache-memory", "64MiB", "--enable-lora",
          "--max-loras", "2", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from tokenmill.model.checkpoint import load_arch_config
    from tokenmill.model.default_model import default_model_path

    arch = load_arch_config(default_model_path())
    return save_random_adapter(tmp_path_factory.mktemp("smol_lora") / "demo", arch, std_b=0.05)


@pytest.fixture(scope="module")
def server(adapter):
    sp = start_server(*ENGINE, "--lora-modules", f"demo={adapter}")
    try:
        yield sp
    finally:
        sp.stop()


def _complete(sp, model, **kw):
    r = httpx.post(sp.url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _base_name(sp):
    return next(m["id"] for m in httpx.get(sp.url + "/v1/models").json()["data"] if m["parent"] is None)


def test_the_adapter_changes_the_output(server):
    assert _complete(server, "demo") != _complete(server, _base_name(server))


def test_json_schema_with_an_adapter(server):
    body = {"model": "demo", "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert r.json()["model"] == "demo"


def test_batch_lane_with_an_adapter(server):
    """A batch-lane request of the adapter gives the interactive request's greedy text (batch invariance)."""
    assert _complete(server, "demo", service_tier="batch") == _complete(server, "demo")


def test_run_batch_with_an_adapter(server, adapter, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    base = _base_name(server)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": m, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}}
             for i, m in enumerate(["demo", base, "demo", "nope"])]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run-batch", "-i", str(inp), "-o", str(out),
                        "--disable-tqdm", *ENGINE, "--lora-modules", f"demo={adapter}"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]        # one line (the unknown model) failed
    got = [json.loads(x) for x in out.read_text().splitlines()]
    texts = [g["response"]["body"]["choices"][0]["text"] if g["error"] is None else None for g in got]
    assert texts[:3] == [_complete(server, "demo"), _complete(server, base), _complete(server, "demo")]
    assert got[3]["response"]["status_code"] == 404
