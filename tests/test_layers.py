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
DATA = {"tokenmill.config", "tokenmill.sampling_params", "tokenmill.outputs", "tokenmill.envs", "tokenmill.kernel_plan"}
UPPER = ("tokenmill.server", "tokenmill.router", "tokenmill.bench", "tokenmill.playbook", "tokenmill.entrypoints",
         "tokenmill.cli", "tokenmill.flags_doc")

# package prefix -> (allowed tokenmill imports: prefixes, or None for "anything not forbidden"; forbidden prefixes)
RULES: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...]]] = {
    "tokenmill.core": (("tokenmill.core",) + tuple(DATA), ()),
    "tokenmill.envs": ((), ()),              # the switch registry: imports no tokenmill module
    "tokenmill.kernel_plan": (("tokenmill.envs",), ()),   # torch-free kernel-choice rules (engine and planner)
    "tokenmill.config": (tuple(DATA), ()),
    "tokenmill.sampling_params": (tuple(DATA), ()),
    "tokenmill.outputs": (tuple(DATA), ()),
    "tokenmill.tokenizer": (tuple(DATA), ()),
    "tokenmill.model": (None, ("tokenmill.engine",) + UPPER),
    "tokenmill.distributed": (None, ("tokenmill.engine",) + UPPER),
    "tokenmill.metrics": (None, ("tokenmill.engine", "tokenmill.model") + UPPER),
    "tokenmill.engine": (None, UPPER),
    "tokenmill.kv_transfer": (None, ("tokenmill.engine",) + UPPER),
    # below the loader: the loader queries quantization's registry, never the other way round
    "tokenmill.quantization": (None, ("tokenmill.engine", "tokenmill.model.loader", "tokenmill.model.runner",
                                      "tokenmill.distributed", "tokenmill.spec_decode", "tokenmill.kv_transfer")
                               + UPPER),
    "tokenmill.spec_decode": (None, ("tokenmill.engine",) + UPPER),
    # the upper layers: each may use the ones below, none another beside it
    "tokenmill.server": (None, ("tokenmill.router", "tokenmill.bench", "tokenmill.playbook", "tokenmill.entrypoints",
                                "tokenmill.cli", "tokenmill.flags_doc")),
    "tokenmill.router": (None, ("tokenmill.engine", "tokenmill.model", "tokenmill.bench", "tokenmill.playbook",
                                "tokenmill.entrypoints", "tokenmill.cli", "tokenmill.flags_doc")),
    "tokenmill.bench": (("tokenmill.bench",) + tuple(DATA), ()),    # a client of any server: no engine code
    "tokenmill.playbook": (None, ("tokenmill.router", "tokenmill.entrypoints", "tokenmill.cli", "tokenmill.flags_doc")),
    "tokenmill.entrypoints": (None, ("tokenmill.server", "tokenmill.router", "tokenmill.bench", "tokenmill.playbook",
                                     "tokenmill.cli", "tokenmill.flags_doc")),
    # the entry points of the command line, and the package root (re-exports LLM and SamplingParams)
    "tokenmill.cli": (None, ()),
    "tokenmill.flags_doc": (None, ()),
    "tokenmill.structured_output": (None, ("tokenmill.engine", "tokenmill.model", "tokenmill.core") + UPPER),
    "tokenmill.lora": (None, ("tokenmill.engine",) + UPPER),
}
ROOT_RULE: tuple[tuple[str, ...] | None, tuple[str, ...]] = (None, ())
# Import cycles tolerated (none: router/app.py <-> router/pd.py was broken by router/relay.py). Any cycle fails.
KNOWN_CYCLES: list[set[str]] = []
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
    if mod == "tokenmill":
        return ROOT_RULE
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


def test_every_module_has_a_rule():
    missing = [module_name(p) for p in sorted(PKG.rglob("*.py")) if rule_for(module_name(p)) is None]
    assert not missing, "give these packages a layer rule (RULES above, docs/architecture.md):\n" + "\n".join(missing)


def module_graph(pkg: pathlib.Path = PKG, root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every import statement, lazy ones included).

    ``from a.b import c`` counts as an import of ``a.b.c`` when that is a module, else of ``a.b`` (the
    package's ``__init__``). The parent packages Python initialises on the way are not counted: every
    submodule has them, and they only close a cycle through an import the ``__init__`` itself makes.
    """
    mods = {module_name(p, root): p for p in pkg.rglob("*.py")}
    top = pkg.name

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                target = resolve(name) if _under(name, top) else None
                if target and target != top:
                    deps.add(target)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def test_no_import_cycles():
    graph = module_graph()
    bad = [c for c in import_cycles(graph) if c not in KNOWN_CYCLES]
    lines = []
    for comp in bad:
        lines.append(" <-> ".join(sorted(comp)))
        lines += [f"    {a} imports {b}" for a in sorted(comp) for b in sorted(graph[a] & comp)]
    assert not bad, "import cycles (lazy imports count):\n" + "\n".join(lines)


def test_cycle_finder_sees_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "tokenmill"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from tokenmill.a import y\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from .z import g\n")
    (pkg / "a" / "z.py").write_text("def g():\n    import tokenmill.a.x\n")
    (pkg / "b.py").write_text("from tokenmill.a.x import nothing\n")
    graph = module_graph(pkg, tmp_path)
    assert graph["tokenmill.b"] == {"tokenmill.a.x"}
    assert import_cycles(graph) == [{"tokenmill.a.x", "tokenmill.a.y", "tokenmill.a.z"}]


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
