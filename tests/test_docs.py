"""The README stays short and its links, and every guide's, resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_readme_is_short_and_names_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300, "README.md is for a newcomer: move detail into docs/guide/"
    assert "scripts/setup && .venv/bin/tokenmill serve" in text
    assert "scripts/test" in text          # the command .ci/run calls
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    missing = []
    for m in LINK.finditer(doc.read_text()):
        target = m.group(1)
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (doc.parent / target).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def _requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", s, maxsplit=1)[0].strip().lower().replace("_", "-") for s in specs}


def test_readme_dependency_table_is_the_pyproject_list():
    """README's "Dependencies and why" names every declared dependency (runtime and extras) and nothing else."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared |= _requirement_names(extra)
    section = (ROOT / "README.md").read_text().split("## Dependencies and why", 1)[1].split("\n## ", 1)[0]
    rows = [r.split("|")[1:3] for r in section.splitlines() if r.startswith("|") and not r.startswith("|---")][1:]
    assert rows, "README.md has no dependency table"
    # the first column lists packages (parenthesised notes and the "test extras:" label aside)
    listed = {w.strip().lower().replace("_", "-") for first, _ in rows
              for w in re.sub(r"\(.*?\)|test extras:", "", first).split(",") if w.strip()}
    # an optional backend may be named in its row's reason instead, in backticks
    named = listed | {w.lower() for _, why in rows for w in re.findall(r"`([A-Za-z][\w.-]*)`", why)}
    missing = sorted(declared - named)
    assert not missing, f"README.md's dependency table does not name {missing} (pyproject.toml declares them)"
    extra = sorted(listed - declared)
    assert not extra, f"README.md's dependency table names {extra}, which pyproject.toml does not declare"


# A repository path written in backticks (not a link) in the README or a guide: it must exist too (a module
# turned into a package left `tokenmill/distributed/eplb.py` in two docs). Paths in other projects are listed.
CODE_PATH = re.compile(r"`((?:tokenmill|tests|benchmarks|scripts|docs|deploy)/[A-Za-z0-9_./-]*[A-Za-z0-9_/])`")
OTHER_PROJECTS_PATHS = {"tests/v1/core/test_prefix_caching.py"}   # vLLM's, in architecture.md's examples


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_backticked_repository_paths_exist(doc):
    missing = [m.group(1) for m in CODE_PATH.finditer(doc.read_text())
               if m.group(1) not in OTHER_PROJECTS_PATHS and not (ROOT / m.group(1)).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} names missing paths: {missing}"
