"""A short soak (300 mixed requests: streamed and not, n > 1, 10% disconnects, 5% bad requests) against a live
server with a model-free engine core; afterwards nothing is left running, every KV block is free again,
the engine's invariant check finds no leaked block, no 5xx, no restart and memory is flat
(benchmarks/soak.py runs the 10,000-request version against the real model)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_short_soak_leaves_no_request_block_or_memory_behind(tmp_path):
    spec = importlib.util.spec_from_file_location("_soak", ROOT / "benchmarks" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    sys.modules["_soak"] = soak          # dataclasses look their module up
    spec.loader.exec_module(soak)
    out = tmp_path / "soak.json"
    rc = soak.main(["--fake", "--requests", "300", "--concurrency", "16", "--max-words", "60", "--no-progress",
                    "--max-rss-growth-mib", "32", "--json", str(out),
                    "--serve-args", "--max-model-len", "4096", "--num-kv-blocks", "512"])
    res = json.loads(out.read_text())
    assert rc == 0, res["failures"]
    assert res["failures"] == [] and res["server_errors"] == 0
    assert res["ok"] > 150 and res["disconnected"] > 5 and res["bad_rejected"] > 5
    assert res["kv_free_blocks"] == [512, 512]
