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
from collections.abc import Callable

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


def _resolve(name: str, mods: dict[str, pathlib.Path]) -> str | None:
    """The module ``name`` loads: itself, or its nearest enclosing module (``pkg.func`` -> ``pkg``)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(node: ast.AST, package: str, names_module: Callable[[str, str], bool]) -> list[str]:
    """The absolute names an import statement in ``package`` imports (none for another node):
    ``from a.b import c`` gives ``a.b.c`` when ``names_module("a.b", "c")``, else ``a.b``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if names_module(base, a.name) else base for a in node.names]


def module_graph(pkg: pathlib.Path = PKG, root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every import statement, lazy ones included).

    ``from a.b import c`` counts as an import of ``a.b.c`` when that is a module, else of ``a.b`` (the
    package's ``__init__``). The parent packages Python initialises on the way are not counted: every
    submodule has them, and they only close a cycle through an import the ``__init__`` itself makes.
    """
    mods = {module_name(p, root): p for p in pkg.rglob("*.py")}
    top = pkg.name

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = _imported_names(node, package, lambda base, name: f"{base}.{name}" in mods)
            for name in names:
                target = _resolve(name, mods) if _under(name, top) else None
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


def _lazy_and_top_imports(pkg: pathlib.Path = PKG, root: pathlib.Path = ROOT):
    """``(top, lazy)``: module -> the package's modules its module-level code imports (TYPE_CHECKING blocks
    aside), and ``[(module, line, statement, targets)]`` for every import of the package inside a function.

    A name that is not a module, taken from a package whose ``__init__`` resolves names on demand (a
    module-level ``__getattr__``) and does not bind it, is a lazy target of its own (``tokenmill.LLM``)."""
    mods = {module_name(p, root): p for p in pkg.rglob("*.py")}
    top_name = pkg.name

    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}

    def on_demand(pkg_mod: str, name: str) -> bool:
        body = trees[pkg_mod].body if pkg_mod in trees else []
        has_getattr = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in body)
        bound = {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        bound |= {(a.asname or a.name).split(".")[0] for n in body if isinstance(n, (ast.Import, ast.ImportFrom))
                  for a in n.names}
        bound |= {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        return has_getattr and name not in bound

    def targets(node: ast.AST, mod: str) -> list[str]:
        package = mod if mods[mod].name == "__init__.py" else mod.rpartition(".")[0]
        names = _imported_names(node, package, lambda base, name: f"{base}.{name}" in mods or on_demand(base, name))
        return [n if n not in mods and _under(n, top_name) and on_demand(n.rpartition(".")[0], n.rpartition(".")[2])
                else _resolve(n, mods) for n in names if _under(n, top_name)]

    top: dict[str, set[str]] = {}
    lazy: list[tuple[str, int, str, list[str]]] = []
    for mod, tree in trees.items():
        found: set[str] = set()

        def walk(nodes, in_function: bool, type_checking: bool) -> None:
            for n in nodes:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    walk(ast.iter_child_nodes(n), True, type_checking)
                elif isinstance(n, ast.If) and ast.unparse(n.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    walk(n.body, in_function, True)
                    walk(n.orelse, in_function, type_checking)
                elif isinstance(n, (ast.Import, ast.ImportFrom)):
                    ts = [t for t in targets(n, mod) if t]
                    if in_function and ts:
                        lazy.append((mod, n.lineno, ast.unparse(n), ts))
                    elif not in_function and not type_checking:
                        found.update(ts)
                else:
                    walk(ast.iter_child_nodes(n), in_function, type_checking)

        walk(tree.body, False, False)
        top[mod] = found
    return top, lazy


def _loaded_with(mod: str, top: dict[str, set[str]]) -> set[str]:
    """The package's modules importing ``mod`` loads (its parent packages' ``__init__`` included)."""
    seen: set[str] = set()
    stack = [mod]
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        stack += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in top]
        stack += top.get(m, ())
    return seen


def test_no_in_function_import_that_defers_nothing():
    """An import of a tokenmill module inside a function is for deferring something (torch for a light CLI, an
    optional backend); one whose module the importing module has loaded already (itself, or through its
    module-level imports) defers nothing and belongs at the top (issue 28)."""
    top, lazy = _lazy_and_top_imports()
    bad = [f"{mod.replace('.', '/')}.py:{line}: {src}" for mod, line, src, ts in lazy
           if all(t in _loaded_with(mod, top) for t in ts)]
    assert not bad, "in-function imports that defer nothing (move them to the module's imports):\n" + "\n".join(bad)


def test_defers_nothing_finder(tmp_path):
    pkg = tmp_path / "tokenmill"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def __getattr__(name):\n    from tokenmill.heavy import Big\n    return Big\n")
    (pkg / "heavy.py").write_text("class Big: ...\n")
    (pkg / "light.py").write_text("X = 1\n")
    (pkg / "mid.py").write_text("from tokenmill import light\n")
    (pkg / "user.py").write_text("import tokenmill.mid\n"
                                 "def a():\n    from tokenmill.light import X\n"       # loaded via mid: nothing
                                 "def b():\n    from tokenmill.heavy import Big\n"     # defers heavy
                                 "def c():\n    from tokenmill import Big\n"           # the package's __getattr__
                                 "def d():\n    import tokenmill\n")                   # the parent: nothing
    top, lazy = _lazy_and_top_imports(pkg, tmp_path)
    verdict = {src: all(t in _loaded_with(mod, top) for t in ts) for mod, _, src, ts in lazy if mod == "tokenmill.user"}
    assert verdict == {"from tokenmill.light import X": True, "from tokenmill.heavy import Big": False,
                       "from tokenmill import Big": False, "import tokenmill": True}
