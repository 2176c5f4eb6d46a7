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
