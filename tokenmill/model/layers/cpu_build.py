"""Build-on-first-use C kernels for the CPU path, one build per instruction set, loaded with :mod:`ctypes`.

The kernel sources live in ``tokenmill/model/csrc/*.c`` / ``*.h`` (package
data). A library is compiled once per instruction-set variant with the system
C compiler (``cc -O3 -ffast-math -fopenmp`` plus the variant's ``-march``,
about a second) into a per-user cache directory
(``$XDG_CACHE_HOME/tokenmill/kernels``, keyed by the hash of the sources, the
flags and the torch version) and loaded with :mod:`ctypes`; it links the same
``libgomp`` torch already loaded, so it shares torch's OpenMP thread pool.

Variants (:data:`ISAS`), best first:

* ``avx512``: ``-march=x86-64-v4`` (AVX-512 F/BW/CD/DQ/VL), 16-wide float32 paths;
* ``avx2``: ``-march=x86-64-v3`` (AVX2, FMA, F16C, BMI2), 8-wide float32 paths;
* ``scalar``: the compiler's default target, portable loops (any CPU).

Each source picks its code path from the compiler's predefined macros
(``__AVX512F__``, ``__AVX2__``), so one source serves every variant. At run
time :func:`cpu_isa` chooses the best variant this CPU can run (from
``/proc/cpuinfo``); ``TOKENMILL_CPU_ISA=avx2|scalar`` forces a lower one
(ablations, or a CPU whose flags are misreported). Tests build and run every
variant the CPU supports explicitly (``load_library(..., isa=...)``).
When no compiler is available or the build fails, :func:`load_library`
returns None (logged once) and callers keep their torch path.

Test-only variants (:data:`TEST_ISAS`), never chosen by :func:`cpu_isa`, :func:`use_isa` or an engine's kernel
plan, only by an explicit ``load_library(..., isa="avx512emu")`` (or ``"amxemu"``):

* ``avx512emu``: the ``avx2`` flags plus the force-included ``csrc/emu512.h``, which defines ``__AVX512F__``
  (and BW/CD/DQ/VL) and maps every AVX-512 intrinsic the sources use (the AVX512-BF16 and -VNNI ones
  included) to C with the instruction's semantics: the ``avx512`` code paths, run on any AVX2 CPU. Slow;
  for correctness tests where the CPU lacks AVX-512 (docs/guide/cpu_kernels.md, "Emulated AVX-512").
* ``amxemu``: the ``avx512emu`` build plus the force-included ``csrc/emuamx.h``, which defines ``__AMX_TILE__``
  and ``__AMX_INT8__`` and emulates the tile instructions (per-thread tile state, the SDM's semantics and
  faults): the ``avx512`` variant's AMX-INT8 paths, their run-time gate always open (docs/guide/cpu_kernels.md,
  "AMX-INT8").

The ``avx512`` variant is also compiled with ``-mamx-tile -mamx-int8``: that only compiles the sources' AMX
paths (compilers emit no AMX instruction on their own); they run behind a run-time gate (CPUID, Linux's
permission request, ``TOKENMILL_CPU_AMX``, a self-check against the other paths' bits).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
import threading
from typing import Sequence

import torch

from tokenmill import envs, kernel_plan

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_libs: dict[tuple[str, str], ctypes.CDLL | None] = {}

#: Source directory of the kernels (shipped as package data).
CSRC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")

#: Instruction-set variants, best first (and the CPU flags each needs): tokenmill/kernel_plan.py.
ISAS = kernel_plan.ISAS
_X86_V3, _X86_V4 = kernel_plan.X86_V3, kernel_plan.X86_V4
# The variant an engine's kernel plan chose for this process (use_isa); None: TOKENMILL_CPU_ISA or the best.
_isa_override: str | None = None
# Library switches an engine's config set for this process where they differ from the environment (configure).
_switch_overrides: dict[str, bool] = {}
#: Test-only variants (never chosen on their own; see the module docstring) -> the variant whose code paths
#: they run, emulated: load them with ``load_library(..., isa=...)``.
TEST_ISAS = {"avx512emu": "avx512", "amxemu": "avx512"}
#: The header that makes the ``avx2`` build compile and run the ``avx512`` paths (``-include``).
EMU512_HEADER = os.path.join(CSRC_DIR, "emu512.h")
#: The header that adds the AMX-INT8 paths to the ``avx512emu`` build (``-include``, after :data:`EMU512_HEADER`).
EMUAMX_HEADER = os.path.join(CSRC_DIR, "emuamx.h")
_EMU_HEADERS = (EMU512_HEADER, EMUAMX_HEADER)
_EMU_NAMES = {os.path.basename(f) for f in _EMU_HEADERS}
# avx512: -mamx-tile / -mamx-int8 only let the sources' AMX paths (#if __AMX_TILE__ && __AMX_INT8__) compile;
# compilers never emit AMX instructions on their own, and those paths run only behind a run-time gate
# (csrc/lowbit_gemm.c), so the build still runs on every AVX-512 CPU.
_ISA_FLAGS = {"avx512": ["-march=x86-64-v4", "-mtune=generic", "-mamx-tile", "-mamx-int8"],
              "avx2": ["-march=x86-64-v3", "-mtune=generic"],
              "scalar": [],
              "avx512emu": ["-march=x86-64-v3", "-mtune=generic", "-include", EMU512_HEADER, "-Wno-psabi"],
              "amxemu": ["-march=x86-64-v3", "-mtune=generic", "-include", EMU512_HEADER, "-include", EMUAMX_HEADER,
                         "-Wno-psabi"]}


def cache_dir() -> str:
    """Where compiled kernels are kept (``$XDG_CACHE_HOME/tokenmill/kernels`` or ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenmill", "kernels")


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty when unreadable or not Linux)."""
    return kernel_plan.read_cpu_flags()


def isa_supported(isa: str) -> bool:
    """True when this CPU can run the ``isa`` variant (``scalar`` always can; a :data:`TEST_ISAS` one where
    ``avx2`` runs)."""
    if isa == "scalar":
        return True
    if isa in TEST_ISAS:
        return isa_supported("avx2")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return kernel_plan.isa_supported(isa, _cpu_flags())


def code_path(isa: str) -> str:
    """The variant whose code paths the ``isa`` build runs: itself, or the one a :data:`TEST_ISAS` variant
    emulates (``avx512emu``, ``amxemu`` -> ``avx512``)."""
    return TEST_ISAS.get(isa, isa)


def supported_isas() -> tuple[str, ...]:
    """The variants this CPU runs, best first (``scalar`` always)."""
    return tuple(isa for isa in ISAS if isa_supported(isa))


@functools.lru_cache(maxsize=1)
def cpu_isa() -> str:
    """The variant the kernels use in this process: the one an engine's kernel plan chose (:func:`use_isa`),
    else ``TOKENMILL_CPU_ISA`` (for kernels used outside an engine), else the best the CPU supports.

    Decided once per process (``cpu_isa.cache_clear()`` re-reads the environment).

    Raises:
        ValueError: ``TOKENMILL_CPU_ISA`` names an unknown variant or one this CPU cannot run.
    """
    if _isa_override is not None:
        return _isa_override
    forced = envs.TOKENMILL_CPU_ISA
    if forced and forced not in ISAS:
        raise ValueError(f"TOKENMILL_CPU_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    return kernel_plan.choose_isa(kernel_plan.CpuKernelSwitches(isa=forced),
                                  kernel_plan.CpuFacts(supported_isas=supported_isas()))


def use_isa(isa: str | None) -> None:
    """Make ``isa`` this process's variant (the engine's kernel plan, from its config); None: back to the
    environment's. Call before the first kernel library loads (the model runner does, at start-up).

    Raises:
        ValueError: an unknown variant or one this CPU cannot run.
    """
    global _isa_override
    if isa is not None and (isa not in ISAS or not isa_supported(isa)):
        raise ValueError(f"CPU kernel variant {isa!r}: expected one this CPU runs ({', '.join(supported_isas())})")
    _isa_override = isa
    cpu_isa.cache_clear()


def switch(name: str) -> bool:
    """A library switch (``TOKENMILL_CPU_ATTENTION_KERNEL``, ``_FUSED_OPS``, ``_LOWBIT_KERNEL``,
    ``_LOWBIT_BF16_DOT``, ``_LORA_KERNEL``) for this process: the engine config's (:func:`configure`), else the environment's."""
    value = _switch_overrides.get(name)
    return envs.get(name) if value is None else value


def configure(isa: str | None, switches: "kernel_plan.CpuKernelSwitches") -> None:
    """Make an engine config's kernel choices this process's: the plan's ISA variant (:func:`use_isa`) and the
    library switches (:meth:`~tokenmill.kernel_plan.CpuKernelSwitches.library_switches`), each only where it
    differs from what the environment gives (so a config built from this environment changes nothing).
    Call before the first kernel library loads: the model runner does, at start-up.

    Raises:
        ValueError: an unknown ISA variant or one this CPU cannot run.
    """
    if isa is not None and isa != cpu_isa():
        use_isa(isa)
    for name, on in switches.library_switches().items():
        if on == envs.get(name):
            _switch_overrides.pop(name, None)
        else:
            _switch_overrides[name] = on


def _sources_digest(sources: Sequence[str], isa: str = "") -> str:
    """Hash of the named sources and every header in :data:`CSRC_DIR` (the emulation headers only for the
    variants that include them, so editing them rebuilds no real variant)."""
    h = hashlib.sha256()
    emu = {os.path.basename(f) for f in _EMU_HEADERS if f in _ISA_FLAGS.get(isa, ())}
    names = list(sources) + sorted(n for n in os.listdir(CSRC_DIR)
                                   if n.endswith(".h") and (n not in _EMU_NAMES or n in emu))
    for n in names:
        with open(os.path.join(CSRC_DIR, n), "rb") as f:
            h.update(n.encode() + b"\0" + f.read())
    return h.hexdigest()


# Part of the cache key: bump when the compile/link recipe changes (v2: link without -ffast-math).
_BUILD_RECIPE = " recipe-v2"


def _compile_commands(cc: str, sources: Sequence[str], isa: str, tmp: str, out: str) -> list[list[str]]:
    """The compiler runs that build ``out``: each source to an object with ``-ffast-math``, then a link
    without it. Linking with ``-ffast-math`` (GCC < 13) adds ``crtfastmath.o``, whose constructor sets
    flush-to-zero / denormals-are-zero in MXCSR for the whole process on load, changing torch's and
    numpy's arithmetic far from our kernels."""
    objs = [os.path.join(tmp, f"{i}.o") for i in range(len(sources))]
    cmds = [[cc, "-O3", *_ISA_FLAGS[isa], "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11", f"-I{CSRC_DIR}",
             "-c", os.path.join(CSRC_DIR, src), "-o", obj] for src, obj in zip(sources, objs)]
    cmds.append([cc, "-shared", "-fopenmp", *objs, "-o", out, "-lm"])
    return cmds


def _build(sources: Sequence[str], isa: str, path: str) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_so = os.path.join(tmp, "out.so")
        for cmd in _compile_commands(cc, sources, isa, tmp, tmp_so):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        staged = f"{path}.{os.getpid()}.tmp"
        shutil.copyfile(tmp_so, staged)
        os.replace(staged, path)  # atomic: concurrent builders never load a half-written file


def load_library(name: str, sources: Sequence[str], functions: dict[str, Sequence], env_switch: str,
                 isa: str | None = None) -> ctypes.CDLL | None:
    """Compile (once) and load the kernel library ``name`` for one instruction-set variant.

    Args:
        name: file-name stem and log label (``paged_attention``, ``fused_ops``).
        sources: C files in :data:`CSRC_DIR` compiled into the library (headers
            there are found with ``-I``).
        functions: exported function name -> ctypes argument types (all return void).
        env_switch: the switch that disables the library when off (:func:`switch`: the engine config's,
            else the environment variable's ``"0"``).
        isa: a variant of :data:`ISAS` or :data:`TEST_ISAS`; None: :func:`cpu_isa`.

    Returns:
        The loaded library, or None (disabled, no compiler, build or load
        failure, or a variant this CPU cannot run; logged once per process).
    """
    if isa is None:
        isa = cpu_isa()
    key = (name, isa)
    if key in _libs:           # fast path: called per layer per step
        return _libs[key]
    with _lock:
        if key in _libs:
            return _libs[key]
        lib = None
        if not switch(env_switch):
            logger.info("CPU %s kernels disabled by %s=0", name, env_switch)
        elif not isa_supported(isa):
            logger.warning("CPU %s kernels: this CPU cannot run the %s variant", name, isa)
        else:
            # the flags without the checkout's path (the emulation header's text is in the digest): a second checkout
            # reuses the cached build
            flags = " ".join(os.path.basename(f) if f in _EMU_HEADERS else f for f in _ISA_FLAGS[isa])
            key_text = _sources_digest(sources, isa) + flags + torch.__version__ + _BUILD_RECIPE
            digest = hashlib.sha256(key_text.encode()).hexdigest()[:16]
            path = os.path.join(cache_dir(), f"{name}_{isa}_{digest}.so")
            try:
                if not os.path.exists(path):
                    logger.info("building CPU %s kernels (%s) with the C compiler (first start only; cached in %s)",
                                name, isa, cache_dir())
                    t0 = time.perf_counter()
                    _build(sources, isa, path)
                    logger.info("built CPU %s kernels (%s) in %.1f s", name, isa, time.perf_counter() - t0)
                lib = ctypes.CDLL(path)
                for fn_name, argtypes in functions.items():
                    fn = getattr(lib, fn_name)
                    fn.argtypes = list(argtypes)
                    fn.restype = None
                logger.info("CPU %s kernels (%s) loaded from %s", name, isa, path)
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
                logger.warning("CPU %s kernels (%s) unavailable (%s); using the torch path", name, isa, e)
                lib = None
        _libs[key] = lib
        return lib
