"""LoRA through the HTTP server (a real ``python -m tokenmill.server`` on a tiny random Llama):
/v1/models, adapter selection by ``model``, 404s, runtime load/unload (400 on a bad adapter, the
server keeps serving), unloading while a request streams, metrics, and a start-up error naming the file."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.lora.conftest import peft_model, reference_greedy
from tests.server.server_proc import start_server

PROMPT = [3, 9, 4, 11, 50, 60, 7]


@pytest.fixture(scope="module")
def server(lora_root):
    base, ads = lora_root
    sp = start_server(base, "--dtype", "float32", "--served-model-name", "base", "--enable-lora",
                      "--lora-modules", f"r4={ads['r4']}",
                      json.dumps({"name": "r8", "path": ads["r8"], "base_model_name": "base"}),
                      "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
                      "--num-kv-blocks", "256")
    try:
        yield sp
    finally:
        sp.stop()


def complete(sp, model, max_tokens=6, prompt=PROMPT, **kw):
    return httpx.post(sp.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, **kw})


def tokens_of(resp_json):
    """Generated token strings ``w<id>`` -> ids (the tiny tokenizer is word-level)."""
    toks = resp_json["choices"][0]["logprobs"]["tokens"]
    return [int(t.strip()[1:]) for t in toks]


def test_models_lists_adapters_with_parent(server, lora_root):
    _, ads = lora_root
    data = httpx.get(server.url + "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert by_id["base"]["parent"] is None
    assert by_id["r4"]["parent"] == "base" and by_id["r4"]["root"] == ads["r4"]
    assert by_id["r8"]["parent"] == "base"


def test_model_name_picks_the_adapter(server, lora_root):
    base, ads = lora_root
    for name in ("r4", "r8", "base"):
        r = complete(server, name)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        ref = reference_greedy(peft_model(base, ads.get(name)), PROMPT, 6)
        assert tokens_of(r.json()) == ref, name
    r = complete(server, "nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]


def test_runtime_load_unload_and_bad_inputs(server, lora_root, tmp_path):
    base, ads = lora_root
    url = server.url
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
    big = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": ads["r16attn"]})
    assert big.status_code == 200, big.text                      # rank 16 == --max-lora-rank
    dup = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": ads["r16attn"]})
    assert dup.status_code == 400 and "already been loaded" in dup.json()["error"]["message"]
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": ads["r4"]}
                      ).status_code == 400
    # every bad adapter is a 400 naming the problem (the loader's checks, reached over HTTP)
    import shutil

    from tests.lora.conftest import save_adapter, save_base

    corrupt = tmp_path / "corrupt"
    shutil.copytree(ads["r4"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    other = save_adapter(save_base(tmp_path / "other_base", hidden=32), tmp_path / "other", r=4)
    for path, msg in [(str(corrupt), "not a readable safetensors"),
                      (save_adapter(base, tmp_path / "r32", r=32), "above --max-lora-rank 16"),
                      (other, "trained for another base model")]:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
        assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text
    assert complete(server, "r4").status_code == 200           # still serving
    r = complete(server, "x")
    assert r.status_code == 200 and tokens_of(r.json()) == reference_greedy(peft_model(base, ads["r16attn"]),
                                                                            PROMPT, 6)
    assert "x" in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
    assert complete(server, "x").status_code == 404
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": ""}).status_code == 400


def test_unload_while_streaming_lets_the_request_finish(server, lora_root):
    base, ads = lora_root
    url = server.url
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": ads["r8"]}
                      ).status_code == 200
    got, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                "model": "s", "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got.append(json.loads(line[6:]))
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "s"}).status_code == 200
    assert complete(server, "s").status_code == 404
    other = complete(server, "r4")                  # other adapters keep streaming alongside
    t.join(300)
    assert other.status_code == 200
    text = "".join(c["choices"][0]["text"] for c in got)
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    ref = reference_greedy(peft_model(base, ads["r8"]), PROMPT, 120)
    assert text.split() == [f"w{t}" for t in ref if t >= 3]     # ids 0-2 are special tokens (no text)
    inv = httpx.get(url + "/metrics").text
    assert "tokenmill:lora_requests_info{" in inv and 'max_lora="2"' in inv
    assert 'tokenmill:lora_requests_total{lora_name="r4",model_name="base"}' in inv


def test_startup_error_names_the_file(lora_root, tmp_path):
    base, ads = lora_root
    import shutil

    bad = tmp_path / "broken"
    shutil.copytree(ads["r4"], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match=r"broken/adapter_model.safetensors: not a readable safetensors"):
        start_server(base, "--dtype", "float32", "--enable-lora", "--lora-modules", f"b={bad}")


def test_runtime_updating_needs_the_flag(lora_root):
    base, ads = lora_root
    sp = start_server(base, "--dtype", "float32", "--enable-lora", "--lora-modules", f"r4={ads['r4']}")
    try:
        r = httpx.post(sp.url + "/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": ads["r8"]})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    finally:
        sp.stop()
