"""The C-kernel variants a kernel test runs, as pytest parameters: every real variant (:data:`cpu_build.ISAS`,
each built explicitly and skipped with its reason where this CPU cannot run it) and, on a CPU without
AVX-512, the emulated one (``avx512emu``, id ``avx512-emulated``: the avx512 code paths on AVX2 through
csrc/emu512.h), so the avx512 paths' logic is tested on every CPU kind. Where the CPU has AVX-512 the real
variant runs instead and the emulated one is skipped (tests/model/test_emu512.py checks the emulation
against the real instructions there)."""

from __future__ import annotations

import pytest

from tokenmill.model.layers import cpu_build

EMU = "avx512emu"
EMU_ID = "avx512-emulated"


def emulated_param(*values, id: str = EMU_ID):
    """One parameter set for the emulated variant (``values``: the parameter values, the variant's name among
    them), skipped where the real avx512 variant runs or the CPU lacks AVX2."""
    real = cpu_build.isa_supported("avx512")
    why = ("this CPU runs the real avx512 variant" if real
           else "the emulated avx512 variant needs AVX2, FMA and F16C")
    return pytest.param(*values, id=id, marks=pytest.mark.skipif(real or not cpu_build.isa_supported(EMU),
                                                                 reason=why))


def real_param(isa: str):
    """One real variant, skipped with its reason where this CPU cannot run it."""
    return pytest.param(isa, id=isa, marks=pytest.mark.skipif(not cpu_build.isa_supported(isa),
                                                              reason=f"this CPU cannot run the {isa} variant"))


def variants(emulated: bool = True) -> list:
    """Every real variant and (``emulated``) the emulated avx512 one, as pytest parameters."""
    return [real_param(i) for i in cpu_build.ISAS] + ([emulated_param(EMU)] if emulated else [])
