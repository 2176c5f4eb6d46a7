"""The build-on-first-use helper for the CPU C kernels: caching, CPU-specific cache keys, fallbacks."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from tokenmill.model.layers import cpu_build

SOURCE = "#include <stdint.h>\nvoid add_one(int64_t* x) { *x += 1; }\n"
FUNCS = {"add_one": [ctypes.c_void_p]}
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty kernel cache and no libraries loaded in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_libs", {})
    return tmp_path


@needs_cc
def test_builds_once_and_keys_the_cache_by_cpu(fresh, monkeypatch):
    lib = cpu_build.load_library("probe", SOURCE, FUNCS, "TOKENMILL_TEST_PROBE")
    x = ctypes.c_int64(41)
    lib.add_one(ctypes.byref(x))
    assert x.value == 42
    built = os.listdir(cpu_build.cache_dir())
    assert len(built) == 1 and built[0].startswith("probe_")
    assert cpu_build.load_library("probe", SOURCE, FUNCS, "TOKENMILL_TEST_PROBE") is lib  # cached in-process
    # another CPU (different feature flags) must not reuse the -march=native build
    monkeypatch.setattr(cpu_build, "_libs", {})
    monkeypatch.setattr(cpu_build, "_cpu_signature", lambda: "x86_64|flags: sse2")
    assert cpu_build.load_library("probe", SOURCE, FUNCS, "TOKENMILL_TEST_PROBE") is not None
    assert len(os.listdir(cpu_build.cache_dir())) == 2


def test_switch_and_build_failure_fall_back_to_none(fresh, monkeypatch):
    monkeypatch.setenv("TOKENMILL_TEST_PROBE", "0")
    assert cpu_build.load_library("probe", SOURCE, FUNCS, "TOKENMILL_TEST_PROBE") is None
    monkeypatch.delenv("TOKENMILL_TEST_PROBE")
    monkeypatch.setattr(cpu_build, "_libs", {})
    assert cpu_build.load_library("broken", "this is not C", FUNCS, "TOKENMILL_TEST_PROBE") is None


def test_cpu_signature_names_the_machine():
    sig = cpu_build._cpu_signature()
    assert sig.split("|")[0] == os.uname().machine
