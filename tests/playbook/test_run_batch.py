"""tokenmill run-batch: OpenAI batch file round trip."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.fakes import CharTokenizer, make_fake_executor, next_token
from tokenmill.config import EngineConfig
from tokenmill.playbook.run_batch import BatchFileError, read_batch_file, run_batch


def _expected(prompt: str, k: int) -> str:
    tok = CharTokenizer()
    ids, out = tok.encode(prompt), []
    last = ids[-1]
    for _ in range(k):
        last = next_token(last)
        out.append(last)
    return tok.decode(out)


def _line(cid: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_round_trip_order_errors_and_bodies(tmp_path):
    prompts = [("p%d" % i, "abcdefghij"[: 2 + i % 7]) for i in range(24)]
    lines = [_line(cid, "/v1/completions", {"model": "fake", "prompt": p, "max_tokens": 3 + i % 4})
             for i, (cid, p) in enumerate(prompts)]
    lines.insert(5, _line("chat", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}))  # model filled in
    lines.insert(9, _line("too-long", "/v1/completions", {"prompt": "abc", "max_tokens": 10_000}))
    lines.insert(12, _line("wrong-model", "/v1/completions", {"model": "other", "prompt": "abc"}))
    lines.insert(14, "")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    config = EngineConfig.from_kwargs(served_model_name="fake", num_kv_blocks=64, max_model_len=256,
                                      max_num_seqs=4, log_stats_interval=0.0)
    summary = run_batch(str(inp), str(out), config, executor_factory=make_fake_executor, tokenizer=CharTokenizer(),
                        max_concurrency=6, progress=False)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    expected_ids = [json.loads(x)["custom_id"] for x in lines if x]
    assert [r["custom_id"] for r in rows] == expected_ids          # input order, one line each
    assert summary.requests == 27 and summary.succeeded == 25 and summary.failed == 2
    by_id = {r["custom_id"]: r for r in rows}
    for i, (cid, p) in enumerate(prompts):
        r = by_id[cid]
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == "fake"
        assert body["choices"][0]["text"] == _expected(p, 3 + i % 4)
        assert body["usage"]["completion_tokens"] == 3 + i % 4
    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion" and len(chat["choices"][0]["message"]["content"]) == 4
    too_long = by_id["too-long"]
    assert too_long["response"]["status_code"] == 400 and "256" in too_long["error"]["message"]
    assert too_long["response"]["body"]["error"]["type"] == "BadRequestError"
    assert by_id["wrong-model"]["response"]["status_code"] == 404
    assert summary.completion_tokens == sum(3 + i % 4 for i in range(24)) + 4


@pytest.mark.parametrize("text,msg", [
    ("{not json", "line 1: not valid JSON"),
    (_line("a", "/v1/embeddings", {}), "'url' must be"),
    (_line("a", "/v1/completions", {}) + "\n" + _line("a", "/v1/completions", {}), "repeats line 1"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}), "must be POST"),
    ("\n\n", "no request"),
])
def test_bad_files_are_refused_whole(text, msg):
    with pytest.raises(BatchFileError, match=msg):
        read_batch_file(text)


def test_cli_bad_file_exit_2(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("[1, 2]\n")
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run-batch", "-i", str(inp), "-o",
                        str(tmp_path / "o.jsonl")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "line 1: expected a JSON object" in r.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
def test_real_model_matches_offline_engine(tmp_path):
    """The packaged model: greedy results equal LLM.generate's for the same prompts."""
    from tokenmill import LLM, SamplingParams

    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(_line(f"r{i}", "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0})
                           + "\n" for i, p in enumerate(prompts)))
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "run-batch", "-i", str(inp), "-o", str(out),
                        "--dtype", "float32", "--disable-tqdm", "--kv-cache-memory", "64MiB"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = [json.loads(x)["response"]["body"]["choices"][0]["text"] for x in out.read_text().splitlines()]
    llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    assert got == want
