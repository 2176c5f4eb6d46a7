"""``tokenmill serve`` flags as data: the serve parser's options, flags <-> argv, a trial's flags merged over the base command."""

from __future__ import annotations

import argparse
import json
from typing import Any
from tokenmill.server.cli_args import build_parser


def serve_options() -> dict[str, argparse.Action]:
    """The ``tokenmill serve`` parser's options on this checkout: ``--flag`` → argparse action."""
    return dict(build_parser()._option_string_actions)  # noqa: SLF001 - argparse has no public accessor


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": 64, "enable_prefix_caching": False}`` → ``["--max-num-seqs", "64", "--no-enable-prefix-caching"]``."""
    argv: list[str] = []
    for k, v in flags.items():
        name = k.replace("_", "-")
        if isinstance(v, bool):
            argv.append(f"--{name}" if v else f"--no-{name}")
        else:
            argv += [f"--{name}", v if isinstance(v, str) else json.dumps(v) if isinstance(v, dict) else str(v)]
    return argv


def merge_serve_args(base: list[str], flags: dict[str, Any], options: dict[str, argparse.Action]) -> list[str]:
    """``base`` serve arguments with the flags in ``flags`` replaced by their new values (appended)."""
    names = {k.replace("_", "-") for k in flags}
    out, i = [], 0
    while i < len(base):
        tok = base[i]
        flag = tok.split("=", 1)[0]
        name = flag[2:].removeprefix("no-") if flag.startswith("--") else None
        if name in names:
            action = options.get(flag) or options.get("--" + name)
            takes_value = action is not None and action.nargs != 0 and "=" not in tok
            i += 2 if takes_value else 1
            continue
        out.append(tok)
        i += 1
    return out + flags_to_argv(flags)


def normalize_flags(flags: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``flags`` without the entries equal to the base configuration's values (one key per configuration)."""
    return {k: v for k, v in flags.items() if k not in defaults or defaults[k] != v}


def serve_defaults(base_args: list[str]) -> dict[str, Any]:
    """Every serve field's value under the user's base serve arguments (dataclass defaults otherwise)."""
    return dict(vars(build_parser().parse_args(base_args)))
