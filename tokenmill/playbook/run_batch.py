"""``tokenmill run-batch``: an OpenAI batch file in, a results file out, through a local engine.

Input: JSON lines in the OpenAI Batch API format (as ``vllm run-batch``)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}}

``url`` is ``/v1/completions`` or ``/v1/chat/completions``; ``body`` is what
that endpoint takes (``model`` may be left out: the served model is used;
``stream`` must not be true). Output: one line per input line, in input
order::

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "...", "body": {<the endpoint's response>}},
     "error": null}

A request the endpoint refuses keeps its line: ``response.status_code`` is the
HTTP status the server would have answered (400, 404, ...), ``response.body``
the OpenAI-style error, and ``error`` ``{"code", "message"}``. A malformed
input file (bad JSON, missing fields, unsupported ``url`` or ``method``,
duplicate ``custom_id``) is refused as a whole before anything runs, as the
Batch API validates a file on upload.

How it runs: one engine core process (the same scheduler, KV cache and
continuous batching as ``tokenmill serve``) and the server's own request
handlers, called in-process through an ASGI transport (no socket, no HTTP
server), so every body is validated and answered exactly as the server
would. Up to ``--max-concurrency`` requests are in flight at once (default
4 × ``--max-num-seqs``: enough to keep the running batch full, not so many
that a million-line file is tokenized up front); the batch size is what the
scheduler makes of them. Results are written as soon as all earlier lines are
done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from tokenmill.config import EngineConfig
from tokenmill.server.launch import create_server_state, resolve_model_path
from tokenmill.tokenizer import load_tokenizer
from tokenmill.server.cli_args import add_serve_args, config_from_args

logger = logging.getLogger("tokenmill.run_batch")

SUPPORTED_URLS = ("/v1/completions", "/v1/chat/completions")


class BatchFileError(ValueError):
    """The input file is not a valid batch file (message names the line)."""


@dataclass
class BatchRequest:
    """One input line. Attributes: line number (1-based), custom_id, url, body."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class BatchSummary:
    """What a run did. Attributes: requests, succeeded, failed (per-line errors), elapsed_s, output tokens."""

    requests: int
    succeeded: int
    failed: int
    elapsed_s: float
    prompt_tokens: int
    completion_tokens: int

    @property
    def output_throughput(self) -> float:
        """Completion tokens per second over the whole run."""
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def read_batch_file(text: str) -> list[BatchRequest]:
    """Parse and validate a batch file's text (blank lines are skipped).

    Raises:
        BatchFileError: a line is not a JSON object with a string ``custom_id``, ``method`` ``POST``, a
            supported ``url`` and an object ``body``; or a ``custom_id`` repeats; or the file has no request.
    """
    out: list[BatchRequest] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise BatchFileError(f"line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise BatchFileError(f"line {n}: expected a JSON object")
        cid, method, url, body = obj.get("custom_id"), obj.get("method"), obj.get("url"), obj.get("body")
        if not isinstance(cid, str) or not cid:
            raise BatchFileError(f"line {n}: 'custom_id' must be a non-empty string")
        if cid in seen:
            raise BatchFileError(f"line {n}: custom_id {cid!r} repeats line {seen[cid]}")
        if str(method).upper() != "POST":
            raise BatchFileError(f"line {n}: 'method' must be POST, got {method!r}")
        if url not in SUPPORTED_URLS:
            raise BatchFileError(f"line {n}: 'url' must be one of {', '.join(SUPPORTED_URLS)}, got {url!r}")
        if not isinstance(body, dict):
            raise BatchFileError(f"line {n}: 'body' must be a JSON object")
        seen[cid] = n
        out.append(BatchRequest(line=n, custom_id=cid, url=url, body=body))
    if not out:
        raise BatchFileError("the batch file holds no request")
    return out


def _error_line(req: BatchRequest, status: int, body: dict[str, Any] | None, message: str) -> dict[str, Any]:
    err = (body or {}).get("error") or {}
    code = err.get("code") if isinstance(err, dict) else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.custom_id,
            "response": {"status_code": status, "request_id": f"tokenmill-batch-{uuid.uuid4().hex}",
                         "body": body},
            "error": {"code": str(code or status), "message": message}}


async def _run(requests: list[BatchRequest], out, config: EngineConfig, *, executor_factory: Callable | None,
               tokenizer: Any, max_concurrency: int, progress: bool) -> BatchSummary:
    import httpx
    from tqdm import tqdm

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.app import build_app

    model_path = "/models/fake" if executor_factory is not None else resolve_model_path(config)
    engine = AsyncEngine(config, tokenizer, executor_factory=executor_factory)
    engine.launch()
    try:
        if tokenizer is None:
            tokenizer = load_tokenizer(config.model.tokenizer or model_path)
            engine.set_tokenizer(tokenizer)
        await asyncio.to_thread(engine.wait_ready)
        state = create_server_state(config, engine, tokenizer, model_path)
        app = build_app(state)
        await engine.start_background()
        sem = asyncio.Semaphore(max_concurrency)
        results: dict[int, dict[str, Any]] = {}
        counts = {"ok": 0, "failed": 0, "prompt": 0, "completion": 0}
        next_to_write = 0
        bar = tqdm(total=len(requests), desc="run-batch", unit="req", disable=not progress, file=sys.stderr)
        t0 = time.perf_counter()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batch",
                                     timeout=None) as client:

            async def one(i: int, req: BatchRequest) -> None:
                nonlocal next_to_write
                body = dict(req.body)
                body.setdefault("model", state.model_name)
                async with sem:
                    if body.get("stream"):
                        line = _error_line(req, 400, None, "stream is not supported in a batch")
                    else:
                        r = await client.post(req.url, json=body)
                        try:
                            payload = r.json()
                        except ValueError:
                            payload = {"error": {"message": r.text, "code": r.status_code}}
                        if r.status_code == 200:
                            line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.custom_id,
                                    "response": {"status_code": 200, "request_id": payload.get("id"),
                                                 "body": payload},
                                    "error": None}
                            usage = payload.get("usage") or {}
                            counts["prompt"] += int(usage.get("prompt_tokens") or 0)
                            counts["completion"] += int(usage.get("completion_tokens") or 0)
                        else:
                            msg = (payload.get("error") or {}).get("message", r.text) if isinstance(payload, dict) \
                                else r.text
                            line = _error_line(req, r.status_code, payload, msg)
                counts["ok" if line["error"] is None else "failed"] += 1
                results[i] = line
                while next_to_write in results:  # input order, written as soon as possible
                    out.write(json.dumps(results.pop(next_to_write), ensure_ascii=False) + "\n")
                    next_to_write += 1
                out.flush()
                bar.update(1)

            await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        bar.close()
        return BatchSummary(requests=len(requests), succeeded=counts["ok"], failed=counts["failed"],
                            elapsed_s=time.perf_counter() - t0, prompt_tokens=counts["prompt"],
                            completion_tokens=counts["completion"])
    finally:
        engine.shutdown()


def run_batch(input_path: str, output_path: str, config: EngineConfig, *, executor_factory: Callable | None = None,
              tokenizer: Any = None, max_concurrency: int | None = None, progress: bool = True) -> BatchSummary:
    """Run every request of the batch file ``input_path`` and write the results file ``output_path``.

    ``-`` reads stdin / writes stdout. ``executor_factory`` and ``tokenizer`` replace the model (tests).

    Raises:
        BatchFileError: the input is not a valid batch file (nothing is run or written).
        RuntimeError: the engine failed to start.
    """
    text = sys.stdin.read() if input_path == "-" else open(input_path, encoding="utf-8").read()
    requests = read_batch_file(text)
    conc = max_concurrency or 4 * config.scheduler.max_num_seqs
    out = sys.stdout if output_path == "-" else open(output_path, "w", encoding="utf-8")
    try:
        return asyncio.run(_run(requests, out, config, executor_factory=executor_factory, tokenizer=tokenizer,
                                max_concurrency=conc, progress=progress))
    finally:
        if out is not sys.stdout:
            out.close()


def add_run_batch_args(p) -> None:
    """Flags of ``tokenmill run-batch`` (vLLM's names) plus the engine flags."""
    p.add_argument("-i", "--input-file", required=True, help="Batch file (JSON lines, OpenAI batch format); - for stdin.")
    p.add_argument("-o", "--output-file", required=True, help="Results file (JSON lines); - for stdout.")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Requests in flight at once (default: 4 × --max-num-seqs).")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_serve_args(p, include_server=False)


def run_batch_cli(args) -> int:
    """``tokenmill run-batch``: 0 when every request succeeded, 1 when some failed, 2 on a bad file or flags."""
    try:
        config = config_from_args(args)
        summary = run_batch(args.input_file, args.output_file, config, max_concurrency=args.max_concurrency,
                            progress=not args.disable_tqdm)
    except (BatchFileError, ValueError, FileNotFoundError) as e:
        print(f"tokenmill run-batch: error: {e}", file=sys.stderr)
        return 2
    print(f"run-batch: {summary.requests} requests, {summary.succeeded} succeeded, {summary.failed} failed, "
          f"{summary.elapsed_s:.1f} s, {summary.completion_tokens} output tokens "
          f"({summary.output_throughput:.1f} tok/s)", file=sys.stderr)
    return 0 if summary.failed == 0 else 1
