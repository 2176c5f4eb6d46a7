"""LoRA with data parallelism (``--data-parallel-size 2``, a real server on a tiny random Llama): every
engine core loads the ``--lora-modules`` adapters, a runtime load and unload reach every core, requests
spread over the cores give transformers + peft's greedy tokens, and the per-adapter request counter sums
the cores."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.lora.conftest import peft_model, reference_greedy
from tests.lora.test_server_lora import PROMPT, complete, tokens_of
from tests.server.server_proc import start_server


def test_data_parallel_cores_serve_adapters(lora_root, tmp_path):
    base, ads = lora_root
    refs = {n: reference_greedy(peft_model(base, ads[n]), PROMPT, 6) for n in ("r4", "r8")}
    sp = start_server(base, "--dtype", "float32", "--served-model-name", "base", "--enable-lora",
                      "--lora-modules", f"r4={ads['r4']}", "--max-loras", "2", "--max-lora-rank", "16",
                      "--allow-runtime-lora-updating", "--num-kv-blocks", "128", "--data-parallel-size", "2")
    try:
        url = sp.url
        assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "r8", "lora_path": ads["r8"]},
                          timeout=120).status_code == 200
        bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "no")},
                         timeout=120)
        assert bad.status_code == 400 and "does not exist" in bad.json()["error"]["message"]
        names = ["r4", "r8"] * 4           # concurrent: the least-loaded pick sends them to both cores
        with ThreadPoolExecutor(len(names)) as pool:
            resps = list(pool.map(lambda n: complete(sp, n), names))
        for n, r in zip(names, resps):
            assert r.status_code == 200, r.text
            assert tokens_of(r.json()) == refs[n], n
        metrics = httpx.get(url + "/metrics").text
        counts = dict(re.findall(r'tokenmill:lora_requests_total\{[^}]*lora_name="(\w+)"[^}]*\} (\S+)', metrics))
        assert float(counts["r4"]) == 4 and float(counts["r8"]) == 4, counts
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "r8"}).status_code == 200
        assert complete(sp, "r8").status_code == 404
        assert tokens_of(complete(sp, "r4").json()) == refs["r4"]
    finally:
        sp.stop()
