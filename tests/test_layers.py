"""The layer rule of docs/architecture.md, enforced by scanning every import in the package.

core ← engine ← server / router / bench / playbook; model and distributed sit
beside engine and never import it. Every ``import`` statement counts — module
level, inside functions and under ``TYPE_CHECKING`` — so a lazy import cannot
hide an upward dependency.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "tokenmill"

# The shared data vocabulary every layer may use (each imports no other tokenmill module but these).
DATA = {"tokenmill.config", "tokenmill.sampling_params", "tokenmill.outputs"}
UPPER = ("tokenmill.server", "tokenmill.router", "tokenmill.bench", "tokenmill.playbook", "tokenmill.entrypoints",
         "tokenmill.cli")

# package prefix -> (allowed tokenmill imports: prefixes, or None for "anything not forbidden"; forbidden prefixes)
RULES: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...]]] = {
    "tokenmill.core": (("tokenmill.core",) + tuple(DATA), ()),
    "tokenmill.config": (tuple(DATA), ()),
    "tokenmill.sampling_params": (tuple(DATA), ()),
    "tokenmill.outputs": (tuple(DATA), ()),
    "tokenmill.tokenizer": (tuple(DATA), ()),
    "tokenmill.model": (None, ("tokenmill.engine",) + UPPER),
    "tokenmill.distributed": (None, ("tokenmill.engine",) + UPPER),
    "tokenmill.metrics": (None, ("tokenmill.engine", "tokenmill.model") + UPPER),
    "tokenmill.engine": (None, UPPER),
    "tokenmill.kv_transfer": (None, ("tokenmill.engine",) + UPPER),
    "tokenmill.lora": (None, ("tokenmill.engine",) + UPPER),
}
# Third-party packages the pure-Python core must not need.
CORE_FORBIDDEN_LIBS = ("torch", "numpy", "zmq", "fastapi", "transformers")


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """Every imported module name (absolute; relative imports resolved) with its line."""
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            # ``from tokenmill import x`` may name a submodule
            if name == "tokenmill":
                out.extend((node.lineno, f"tokenmill.{a.name}") for a in node.names)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rule_for(mod: str) -> tuple[tuple[str, ...] | None, tuple[str, ...]] | None:
    best = None
    for prefix in RULES:
        if _under(mod, prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    return RULES[best] if best else None


def violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        mod = module_name(path)
        rule = rule_for(mod)
        if rule is None:
            continue
        allowed, forbidden = rule
        for line, name in imports_of(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if _under(mod, "tokenmill.core") and name.split(".")[0] in CORE_FORBIDDEN_LIBS:
                bad.append(f"{where}: core imports {name}")
            if not _under(name, "tokenmill") or name == "tokenmill":
                continue
            if allowed is not None and not any(_under(name, a) for a in allowed):
                bad.append(f"{where}: {mod} imports {name} (allowed: {', '.join(allowed)})")
            if any(_under(name, f) for f in forbidden):
                bad.append(f"{where}: {mod} imports {name} (a layer above it)")
    return bad


def test_layer_rule_holds():
    bad = violations()
    assert not bad, "layer rule broken (docs/architecture.md, 'Layers'):\n" + "\n".join(bad)


def test_scanner_catches_a_lazy_upward_import(tmp_path):
    """The scanner sees imports inside functions and under TYPE_CHECKING, and relative ones."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tokenmill.engine import x\n"
           "def f():\n    import torch\n    from ..server import app\n")
    pkg = tmp_path / "tokenmill" / "core"
    pkg.mkdir(parents=True)
    f = pkg / "bad.py"
    f.write_text(src)
    names = [n for _, n in imports_of(f, tmp_path)]
    assert names == ["typing", "tokenmill.engine", "torch", "tokenmill.server"]


@pytest.mark.parametrize("sub", ["tokenmill", "benchmarks", "scripts"])
def test_no_reference_to_documents_outside_the_repo(sub):
    """Docstrings and comments cite docs/architecture.md, never a file beside the repository."""
    pat = re.compile(r"design\.md|shared/notes")
    hits = []
    for path in sorted((ROOT / sub).rglob("*")):
        if path.is_file() and path.suffix in {".py", ".md", ""} and ".venv" not in path.parts:
            for i, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
                if pat.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
