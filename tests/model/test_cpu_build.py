"""The build-on-first-use helper for the CPU C kernels: caching, per-ISA variants, fallbacks."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from tokenmill.model.layers import cpu_build

SOURCE = ('#include <stdint.h>\nvoid add_one(int64_t* x) { *x += 1; }\n'
          'void isa_level(int64_t* x) {\n#if defined(__AVX512F__)\n*x = 2;\n#elif defined(__AVX2__)\n*x = 1;\n'
          '#else\n*x = 0;\n#endif\n}\n')
FUNCS = {"add_one": [ctypes.c_void_p], "isa_level": [ctypes.c_void_p]}
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty kernel cache, a source directory holding probe.c, and no libraries loaded in this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "probe.c").write_text(SOURCE)
    (src / "broken.c").write_text("this is not C")
    monkeypatch.setattr(cpu_build, "CSRC_DIR", str(src))
    monkeypatch.setattr(cpu_build, "_libs", {})
    return tmp_path


@needs_cc
def test_builds_once_per_isa(fresh):
    lib = cpu_build.load_library("probe", ["probe.c"], FUNCS, "TOKENMILL_TEST_PROBE", isa="scalar")
    x = ctypes.c_int64(41)
    lib.add_one(ctypes.byref(x))
    assert x.value == 42
    built = os.listdir(cpu_build.cache_dir())
    assert len(built) == 1 and built[0].startswith("probe_scalar_")
    assert cpu_build.load_library("probe", ["probe.c"], FUNCS, "TOKENMILL_TEST_PROBE", isa="scalar") is lib


@needs_cc
@pytest.mark.parametrize("isa,level", [("avx512", 2), ("avx2", 1), ("scalar", 0)])
def test_each_variant_is_built_for_its_instruction_set(fresh, isa, level):
    if not cpu_build.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} variant")
    lib = cpu_build.load_library("probe", ["probe.c"], FUNCS, "TOKENMILL_TEST_PROBE", isa=isa)
    x = ctypes.c_int64(-1)
    lib.isa_level(ctypes.byref(x))
    assert x.value == level


def test_switch_build_failure_and_unsupported_isa_fall_back_to_none(fresh, monkeypatch):
    monkeypatch.setenv("TOKENMILL_TEST_PROBE", "0")
    assert cpu_build.load_library("probe", ["probe.c"], FUNCS, "TOKENMILL_TEST_PROBE", isa="scalar") is None
    monkeypatch.delenv("TOKENMILL_TEST_PROBE")
    assert cpu_build.load_library("broken", ["broken.c"], FUNCS, "TOKENMILL_TEST_PROBE", isa="scalar") is None
    monkeypatch.setattr(cpu_build, "isa_supported", lambda isa: isa == "scalar")
    assert cpu_build.load_library("probe", ["probe.c"], FUNCS, "TOKENMILL_TEST_PROBE", isa="avx2") is None


def test_cpu_isa_choice_and_override(monkeypatch):
    cpu_build.cpu_isa.cache_clear()
    try:
        monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: frozenset(cpu_build._X86_V3))
        monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
        monkeypatch.delenv("TOKENMILL_CPU_ISA", raising=False)
        assert cpu_build.cpu_isa() == "avx2"          # AVX2 + FMA only: no AVX-512 variant
        cpu_build.cpu_isa.cache_clear()
        monkeypatch.setenv("TOKENMILL_CPU_ISA", "scalar")
        assert cpu_build.cpu_isa() == "scalar"
        cpu_build.cpu_isa.cache_clear()
        monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx512")
        with pytest.raises(ValueError, match="lacks"):
            cpu_build.cpu_isa()
        cpu_build.cpu_isa.cache_clear()
        monkeypatch.setenv("TOKENMILL_CPU_ISA", "sse9")
        with pytest.raises(ValueError, match="expected one of"):
            cpu_build.cpu_isa()
    finally:
        cpu_build.cpu_isa.cache_clear()


def test_sources_are_package_data():
    names = os.listdir(cpu_build.CSRC_DIR)
    assert {"common.h", "paged_attention.c", "fused_ops.c"} <= set(names)
