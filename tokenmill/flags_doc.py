"""Generate ``docs/flags.md``: every command-line flag, JSON config key and environment switch.

The flags come from the argument parsers (``tokenmill serve``'s are generated from the
:mod:`tokenmill.config` dataclasses' ``metadata["help"]``), the JSON-valued configs' keys from those
dataclasses' fields and the ``Attributes:`` section of their docstrings, and the environment switches
from :mod:`tokenmill.envs`. ``tests/test_flags_doc.py`` fails when the file is stale. Regenerate with::

    .venv/bin/python -m tokenmill.flags_doc --write

``--check`` exits 1 (printing a diff) when ``docs/flags.md`` differs from what would be generated.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

from tokenmill import config as config_mod, envs
from tokenmill.server.cli_args import SECTIONS
from tokenmill.cli import build_parser

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
REGENERATE = ".venv/bin/python -m tokenmill.flags_doc --write"
# Environment read while parsers are built that must not leak into the document (a default from the
# user's environment would make the file differ from machine to machine).
_MASKED_ENV = ("OPENAI_API_KEY",)


def _cell(text: Any) -> str:
    """One Markdown table cell: single line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _subparsers(parser: argparse.ArgumentParser, prefix: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(command words, parser)`` for ``parser`` and every sub-command below it, depth first."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{prefix} {name}")


def _default_text(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or d is False and isinstance(action, argparse._StoreTrueAction):
        return ""
    return f"`{d}`" if not isinstance(d, (list, tuple)) else f"`{' '.join(map(str, d))}`"


def _help_text(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        params = {**vars(action), "default": action.default, "prog": ""}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        try:
            text = text % params
        except (KeyError, TypeError, ValueError):
            pass
    return text.replace("%%", "%")


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}` (positional)"
        if action.choices is not None and not isinstance(action, argparse.BooleanOptionalAction):
            names += " {" + ", ".join(map(str, action.choices)) + "}"
        rows.append(f"| {names} | {_cell(_default_text(action))} | {_cell(_help_text(action))} |")
    return rows


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of ``cls``'s docstring (Google style)."""
    doc = inspect.getdoc(cls) or ""
    out: dict[str, str] = {}
    m = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)+)", doc, re.M)
    if not m:
        return out
    names: list[str] = []
    for line in m.group(1).splitlines():
        entry = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
        if entry:
            names = [n.strip() for n in entry.group(1).split(",")]
            for n in names:
                out[n] = entry.group(2)
        elif line.startswith("        ") and names:
            for n in names:
                out[n] += " " + line.strip()
    return out


def _json_configs() -> list[type]:
    """The dataclasses of :mod:`tokenmill.config` that are not flag sections: the JSON-valued configs."""
    skip = {cls for _, cls in SECTIONS} | {config_mod.EngineConfig}
    out = []
    for _, obj in inspect.getmembers(config_mod, inspect.isclass):
        if dataclasses.is_dataclass(obj) and obj.__module__ == config_mod.__name__ and obj not in skip:
            out.append(obj)
    return sorted(out, key=lambda c: inspect.getsourcelines(c)[1])


def _config_rows(cls: type) -> list[str]:
    docs = _attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`"
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f"`{f.default_factory()!r}`"  # type: ignore[misc]
        else:
            default = "required"
        typ = re.sub(r"\btyping\.", "", str(hints.get(f.name, f.type)).replace("<class '", "").replace("'>", ""))
        text = f.metadata.get("help") or docs.get(f.name, "")
        rows.append(f"| `{f.name}` | `{_cell(typ)}` | {_cell(default)} | {_cell(text)} |")
    return rows


def _env_rows(group: str) -> list[str]:
    rows = []
    for v in envs.VARS.values():
        if v.group != group:
            continue
        default = "unset" if v.default is None else f"`{v.default}`"
        note = " Part of the weight cache's key." if v.in_weight_key else ""
        rows.append(f"| `{v.name}` | {_cell(v.type)} | {_cell(default)} | {_cell(v.doc + note)} |")
    return rows


def render() -> str:
    """The text of ``docs/flags.md``."""
    saved = {k: os.environ.pop(k) for k in _MASKED_ENV if k in os.environ}
    try:
        parser = build_parser()
    finally:
        os.environ.update(saved)
    lines = [
        "# Flags, config keys and environment switches",
        "",
        "<!-- Generated by `python -m tokenmill.flags_doc --write` from the argument parsers, the",
        "     tokenmill/config.py dataclasses and tokenmill/envs.py. Do not edit by hand:",
        "     tests/test_flags_doc.py fails when this file is stale. -->",
        "",
        f"Regenerate it after changing a flag, a config field or a switch (and after merging branches that do): `{REGENERATE}`.",
        "Flag names follow vLLM's where vLLM has the knob. Guides: [docs/guide/](guide/).",
        "",
        "## Command-line flags",
        "",
    ]
    for words, sub in _subparsers(parser, "tokenmill"):
        rows = _flag_rows(sub)
        if not rows or words == "tokenmill":
            continue
        lines += [f"### `{words}`", ""]
        if sub.description:
            lines += [_cell(sub.description), ""]
        lines += ["| flag | default | meaning |", "|---|---|---|", *rows, ""]
    lines += ["## JSON-valued configs", "",
              "The keys of the JSON objects some flags take (`--speculative-config '{...}'`, ...), and of the "
              "same dicts in `LLM(...)`.", ""]
    for cls in _json_configs():
        summary = (inspect.getdoc(cls) or "").split("\n\n")[0]
        lines += [f"### `{cls.__name__}`", "", _cell(summary), "",
                  "| key | type | default | meaning |", "|---|---|---|---|", *_config_rows(cls), ""]
    lines += ["## Environment switches", "",
              "Declared in `tokenmill/envs.py` (the only module that reads them); read when used, so one "
              "exported after start-up counts where the code reads it again. Kernel ablations, process tuning, "
              "paths and debugging aids; engine behaviour is a flag.", ""]
    for group in dict.fromkeys(v.group for v in envs.VARS.values()):
        lines += [f"### {group}", "", "| variable | type | default | meaning |", "|---|---|---|---|",
                  *_env_rows(group), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """``--write``: write ``docs/flags.md``; ``--check``: exit 1 with a diff when it is stale; else print it."""
    ap = argparse.ArgumentParser(prog="python -m tokenmill.flags_doc", description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
        return 0
    if args.check:
        old = DOC_PATH.read_text() if DOC_PATH.exists() else ""
        if old == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                   "docs/flags.md", "generated"))
        print(f"\ndocs/flags.md is stale: run {REGENERATE}")
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
