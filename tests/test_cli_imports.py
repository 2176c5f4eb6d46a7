"""``tokenmill serve`` spawns its engine core before the heavy imports (start-up time, issue 10).

Checked by module, not by clock: parsing ``serve`` flags and naming the default model must not import
torch (the core imports it), nor the router's or benchmark's modules (httpx, rich, numpy).
"""

import subprocess
import sys

import pytest

from tokenmill.cli import _chosen_subcommand, build_parser

_PROBE = r"""
import sys
from tokenmill.cli import _chosen_subcommand, build_parser
from tokenmill.server.cli_args import config_from_args
from tokenmill.server.launch import resolve_model_path
args = build_parser(_chosen_subcommand(["serve"])).parse_args(["serve"])
config = config_from_args(args)
try:
    resolve_model_path(config)
except FileNotFoundError:
    pass
heavy = [m for m in ("torch", "numpy", "httpx", "rich", "tokenmill.router", "tokenmill.bench", "fastapi")
         if m in sys.modules]
print(",".join(heavy))
"""


def test_serve_parsing_imports_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported before the engine core is spawned: {out.stdout.strip()}"


@pytest.mark.parametrize("argv,expected", [
    (["serve", "--model", "x"], "serve"),
    (["--log-level", "DEBUG", "bench", "serve"], "bench"),
    (["run-batch", "-i", "f"], "run-batch"),
    (["--help"], None),
    ([], None),
    (["nosuch"], None),
])
def test_chosen_subcommand(argv, expected):
    assert _chosen_subcommand(argv) == expected


def test_full_parser_still_lists_every_subcommand():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # noqa: SLF001
    assert {"serve", "generate", "router", "bench", "plan", "top", "run-batch", "tune"} <= set(sub.choices)
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["router"])
