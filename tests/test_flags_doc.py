"""docs/flags.md is generated (python -m tokenmill.flags_doc --write) and must match the code."""

from __future__ import annotations

import dataclasses

from tokenmill import envs, flags_doc
from tokenmill.config import CacheConfig, ModelConfig, SchedulerConfig


def test_docs_flags_md_is_current():
    assert flags_doc.DOC_PATH.exists(), f"docs/flags.md is missing: run {flags_doc.REGENERATE}"
    assert flags_doc.DOC_PATH.read_text() == flags_doc.render(), f"docs/flags.md is stale: run {flags_doc.REGENERATE}"


def test_every_config_field_and_switch_is_listed():
    text = flags_doc.render()
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            assert f"`--{f.name.replace('_', '-')}`" in text, f.name
    for name in envs.VARS:
        assert f"`{name}`" in text, name
    assert "`--speculative-config`" in text and "### `EplbConfig`" in text


def test_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "flags.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(flags_doc, "DOC_PATH", stale)
    assert flags_doc.main(["--check"]) == 1
    assert "is stale" in capsys.readouterr().out
    assert flags_doc.main(["--write"]) == 0 and flags_doc.main(["--check"]) == 0


def test_the_users_environment_does_not_leak_into_the_document(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    assert "sk-secret" not in flags_doc.render()
