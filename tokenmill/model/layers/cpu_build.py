"""Build-on-first-use C kernels for the CPU path, loaded with :mod:`ctypes`.

A kernel source is compiled once with the system C compiler (``cc -O3
-march=native -ffast-math -fopenmp``, about a second) into a per-user cache
directory (``$XDG_CACHE_HOME/tokenmill/kernels``, keyed by the hash of the
source, the torch version and the CPU's model and feature flags) and loaded with :mod:`ctypes`; it links the same
``libgomp`` torch already loaded, so it shares torch's OpenMP thread pool.
When no compiler is available or the build fails, :func:`load_library`
returns None (logged once) and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


# Prepended to every kernel source: the headers all kernels use and bfloat16 <-> float32 conversion
# with torch's rounding (round to nearest even; NaN stays NaN), so each kernel does not carry a copy.
PRELUDE = r"""
#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c; c.u = ((uint32_t)x) << 16; return c.f;
}
static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch */
    union { uint32_t u; float f; } c; c.f = f;
    if ((c.u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(c.u >> 16) | ((c.u & 0xffff) ? 0x40 : 0);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}
"""


def cache_dir() -> str:
    """Where compiled kernels are kept (``$XDG_CACHE_HOME/tokenmill/kernels`` or ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenmill", "kernels")


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine type and the CPU's feature flags.

    Part of the cache key, so a cache directory shared between different
    CPUs (an NFS home, a copied container layer) never loads a kernel built
    for instructions this CPU lacks.
    """
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    sig += "|" + line.strip()
                    if line.startswith(("flags", "Features")):
                        break
    except OSError:
        sig += "|" + platform.processor()
    return sig


def _build(source: str, path: str) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.c")
        with open(src, "w") as f:
            f.write(source)
        tmp_so = os.path.join(tmp, "out.so")
        subprocess.run([cc, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11",
                        src, "-o", tmp_so, "-lm"], check=True, capture_output=True, timeout=300)
        staged = f"{path}.{os.getpid()}.tmp"
        shutil.copyfile(tmp_so, staged)
        os.replace(staged, path)  # atomic: concurrent builders never load a half-written file


def load_library(name: str, source: str, functions: dict[str, Sequence], env_switch: str) -> ctypes.CDLL | None:
    """Compile (once) and load the kernel library ``name``; None when unavailable.

    Args:
        name: file-name stem and log label (``paged_attention``, ``fused_ops``).
        source: the C source (:data:`PRELUDE` is prepended: ``math.h``,
            ``stdint.h``, ``bf16_to_f32``, ``f32_to_bf16``).
        functions: exported function name -> ctypes argument types (all return void).
        env_switch: environment variable that disables the library when ``"0"``.

    Returns:
        The loaded library, or None (disabled, no compiler, build or load
        failure; logged once per process).
    """
    if name in _libs:           # fast path: called per layer per step
        return _libs[name]
    with _lock:
        if name in _libs:
            return _libs[name]
        lib = None
        if os.environ.get(env_switch, "1") == "0":
            logger.info("CPU %s kernels disabled by %s=0", name, env_switch)
        else:
            source = PRELUDE + source
            digest = hashlib.sha256((source + torch.__version__ + _cpu_signature()).encode()).hexdigest()[:16]
            path = os.path.join(cache_dir(), f"{name}_{digest}.so")
            try:
                if not os.path.exists(path):
                    _build(source, path)
                lib = ctypes.CDLL(path)
                for fn_name, argtypes in functions.items():
                    fn = getattr(lib, fn_name)
                    fn.argtypes = list(argtypes)
                    fn.restype = None
                logger.info("CPU %s kernels loaded from %s", name, path)
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
                logger.warning("CPU %s kernels unavailable (%s); using the torch path", name, e)
                lib = None
        _libs[name] = lib
        return lib
