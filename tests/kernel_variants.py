"""The C-kernel variants a kernel test runs, as pytest parameters: every real variant (:data:`cpu_build.ISAS`,
each built explicitly and skipped with its reason where this CPU cannot run it) and, on a CPU without
AVX-512, the emulated one (``avx512emu``, id ``avx512-emulated``: the avx512 code paths on AVX2 through
csrc/emu512.h), so the avx512 paths' logic is tested on every CPU kind. Where the CPU has AVX-512 the real
variant runs instead and the emulated one is skipped (tests/model/test_emu512.py checks the emulation
against the real instructions there). Likewise ``amxemu`` (id ``amx-emulated``): the avx512 variant's AMX-INT8
paths on tiles emulated by csrc/emuamx.h, skipped where the CPU runs the real ones."""

from __future__ import annotations

import pytest

from tokenmill.model.layers import cpu_build

EMU = "avx512emu"
EMU_ID = "avx512-emulated"
#: The avx512 variant with its AMX-INT8 paths on emulated tiles (csrc/emuamx.h), on any AVX2 CPU.
AMX_EMU = "amxemu"
AMX_EMU_ID = "amx-emulated"


def cpu_has_amx() -> bool:
    """This CPU runs the real avx512 variant's AMX-INT8 paths' instructions (AMX-TILE and AMX-INT8 listed in
    /proc/cpuinfo, i.e. also enabled by the kernel)."""
    return cpu_build.isa_supported("avx512") and {"amx_tile", "amx_int8"} <= cpu_build._cpu_flags()


def emulated_param(*values, id: str = EMU_ID):
    """One parameter set for the emulated variant (``values``: the parameter values, the variant's name among
    them), skipped where the real avx512 variant runs or the CPU lacks AVX2."""
    real = cpu_build.isa_supported("avx512")
    why = ("this CPU runs the real avx512 variant" if real
           else "the emulated avx512 variant needs AVX2, FMA and F16C")
    return pytest.param(*values, id=id, marks=pytest.mark.skipif(real or not cpu_build.isa_supported(EMU),
                                                                 reason=why))


def amx_emulated_param(*values, id: str = AMX_EMU_ID):
    """One parameter set for the emulated AMX variant, skipped where the CPU runs the real AMX paths or lacks
    AVX2 (it runs on AVX-512 CPUs without AMX too: their real avx512 build never takes the AMX paths)."""
    real = cpu_has_amx()
    why = ("this CPU runs the real AMX-INT8 paths" if real else "the emulated AMX variant needs AVX2, FMA and F16C")
    return pytest.param(*values, id=id, marks=pytest.mark.skipif(real or not cpu_build.isa_supported(AMX_EMU),
                                                                 reason=why))


def real_param(isa: str):
    """One real variant, skipped with its reason where this CPU cannot run it."""
    return pytest.param(isa, id=isa, marks=pytest.mark.skipif(not cpu_build.isa_supported(isa),
                                                              reason=f"this CPU cannot run the {isa} variant"))


def variants(emulated: bool = True) -> list:
    """Every real variant and (``emulated``) the emulated avx512 one, as pytest parameters."""
    return [real_param(i) for i in cpu_build.ISAS] + ([emulated_param(EMU)] if emulated else [])
