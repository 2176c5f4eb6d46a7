"""The ``tokenmill`` command: ``serve``, ``generate``, ``bench`` and the playbook (``plan``, ``tune``, ``run-batch``, ``top``).

Engine flags are generated from the config dataclasses (vLLM's names), so
``tokenmill serve --help`` and ``tokenmill generate --help`` list the same
engine knobs with units and defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from tokenmill.server.cli_args import add_serve_args

    p = sub.add_parser("generate", help="Generate a completion for one prompt and print it.")
    p.add_argument("prompt_text", metavar="PROMPT", help="The prompt text.")
    p.add_argument("--max-tokens", type=int, default=64, help="Maximum new tokens [default: 64].")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (0 = greedy) [default: 0].")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass in (0, 1] [default: 1].")
    p.add_argument("--top-k", type=int, default=0, help="Top-k sampling (<= 0 disables) [default: 0].")
    p.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    p.add_argument("--chat", action="store_true", help="Wrap the prompt as a user message with the model's chat template.")
    p.add_argument("--stats", action="store_true", help="Print token counts and timings to stderr.")
    add_serve_args(p, include_server=False)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import time

    from tokenmill import LLM, SamplingParams

    config = _config_or_exit(args, "generate")
    if config is None:
        return 2
    llm = LLM(**_flat(config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    t0 = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt_text}], params)[0]
    else:
        out = llm.generate(args.prompt_text, params)[0]
    dt = time.perf_counter() - t0
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.outputs[0].text)
    if args.stats:
        n = len(out.outputs[0].token_ids)
        print(f"[{len(out.prompt_token_ids)} prompt tokens, {n} generated, {dt:.2f} s, "
              f"{n / dt if dt else 0:.1f} tok/s, finish_reason={out.outputs[0].finish_reason}]", file=sys.stderr)
    return 0


def _flat(config) -> dict:
    import dataclasses

    flat = {}
    for section in ("model", "cache", "scheduler", "parallel"):
        obj = getattr(config, section)
        for f in dataclasses.fields(obj):
            flat[f.name] = getattr(obj, f.name)
    flat["speculative_config"] = config.speculative
    flat["cpu_kernels"] = config.cpu_kernels
    return flat


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from tokenmill.server.cli_args import add_serve_args

    serve = sub.add_parser("serve", help="Run the OpenAI-compatible API server.",
                           description="Serve a model behind an OpenAI-compatible HTTP API.")
    add_serve_args(serve)
    serve.set_defaults(func=_run_serve)


def _add_router(sub: argparse._SubParsersAction) -> None:
    from tokenmill.router.cli import add_router_parser

    add_router_parser(sub)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from tokenmill.bench.cli import add_bench_subparsers

    add_bench_subparsers(sub)


def _add_playbook(sub: argparse._SubParsersAction) -> None:
    from tokenmill.playbook.cli import add_playbook_subparsers

    add_playbook_subparsers(sub)


# Sub-command name -> the function that registers it (several names may share one). Each registration
# imports its own module: the router's pulls in httpx/rich and the benchmark's numpy (~1 s together), which
# ``tokenmill serve`` must not pay before it spawns the engine core (start-up time, issue 10).
_SUBCOMMANDS: dict[str, Any] = {
    "serve": _add_serve, "generate": _add_generate, "router": _add_router, "bench": _add_bench,
    "plan": _add_playbook, "top": _add_playbook, "run-batch": _add_playbook, "tune": _add_playbook,
}


def _chosen_subcommand(argv: list[str] | None) -> str | None:
    """The sub-command named in ``argv`` (the first word that is one), or None (help, or a typo)."""
    args = sys.argv[1:] if argv is None else argv
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--log-level":
            skip = True
            continue
        if a.startswith("-"):
            continue
        return a if a in _SUBCOMMANDS else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``tokenmill`` argument parser.

    Args:
        only: register only this sub-command (``main`` passes the one named on the command line, so
            that e.g. ``serve`` does not import the router's and benchmark's modules); None registers
            every sub-command (``--help``, a missing or unknown command).
    """
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS,
                        help="Logging level: DEBUG, INFO, WARNING, ERROR [default: INFO].")
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: an LLM serving engine built for goodput.",
                                     parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    _orig_add_parser = sub.add_parser

    def add_parser(name: str, **kw):  # every sub-command also takes --log-level (before or after it)
        return _orig_add_parser(name, parents=[common, *kw.pop("parents", [])], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]
    adders = [_SUBCOMMANDS[only]] if only in _SUBCOMMANDS else list(dict.fromkeys(_SUBCOMMANDS.values()))
    for add in adders:
        add(sub)
    return parser


def _config_or_exit(args: argparse.Namespace, command: str):
    """The engine config from the flags (and environment switches), or None after printing why not."""
    from tokenmill.server.cli_args import config_from_args

    try:
        config = config_from_args(args)
        if config.model.quantization is not None:   # (imports torch, which the API process otherwise never needs)
            from tokenmill.model.checkpoint import check_quantization

            check_quantization(config.model.quantization, config.model.device, config.model.model, check_model=True,
                               int4_group=config.cpu_kernels.int4_group_size)
        return config
    except ValueError as e:
        print(f"tokenmill {command}: error: {e}", file=sys.stderr)
        return None


def _run_serve(args: argparse.Namespace) -> int:
    config = _config_or_exit(args, "serve")
    if config is None:
        return 2
    from tokenmill.server.launch import run_server

    return run_server(config)   # non-zero when the engine core died, so a supervisor restarts it


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokenmill`` console script."""
    parser = build_parser(_chosen_subcommand(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(getattr(args, "log_level", "INFO")).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
