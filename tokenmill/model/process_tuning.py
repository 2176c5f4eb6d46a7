"""Process-level tuning of the engine core: torch threads and the C allocator.

Called once by :meth:`tokenmill.model.runner.ModelRunner.from_config` before the
model loads; benchmarks call them to run under the same settings as the server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

from tokenmill import envs

logger = logging.getLogger(__name__)


def rss_bytes() -> int:
    """Resident set size of this process in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def configure_allocator(device: torch.device) -> bool:
    """Keep freed activation memory in the heap instead of returning it to the OS (glibc only).

    glibc serves allocations above ``M_MMAP_THRESHOLD`` with fresh ``mmap``
    pages and trims the heap top above ``M_TRIM_THRESHOLD``; a decode step
    allocates and frees megabyte-sized activations per layer, so each one
    page-faults anew. Raising both thresholds to 256/512 MiB made a batch-32
    decode step of SmolLM2-135M 13% (bfloat16) to 26% (float32) faster on
    the 2-core CPU (one thread, same load, process pairs run back to back). Off with ``TOKENMILL_MALLOC_TUNING=0``.

    Returns:
        True when the thresholds were set.
    """
    if device.type != "cpu" or not envs.TOKENMILL_MALLOC_TUNING:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = bool(libc.mallopt(m_mmap_threshold, 256 << 20)) and bool(libc.mallopt(m_trim_threshold, 512 << 20))
    except (OSError, AttributeError):
        ok = False
    logger.info("glibc malloc tuning (mmap threshold 256 MiB, trim threshold 512 MiB): %s",
                "on" if ok else "unavailable")
    return ok


def configure_threads(device: torch.device) -> int:
    """Set and log intra-op threads for the engine core.

    Default: one per CPU this process may run on (its affinity mask, so
    ``taskset -c 0 tokenmill serve`` gets one thread); ``TOKENMILL_NUM_THREADS``
    overrides it.
    """
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # not Linux
        usable = os.cpu_count() or 1
    explicit = envs.TOKENMILL_NUM_THREADS
    n = explicit or usable
    if device.type == "cpu":
        torch.set_num_threads(n)
    logger.info("engine core: torch intra-op threads=%d, inter-op threads=%d", torch.get_num_threads(),
                torch.get_num_interop_threads())
    if device.type == "cpu" and not explicit and n > 1:
        warn_if_busy(n)
    return torch.get_num_threads()


def warn_if_busy(threads: int) -> bool:
    """Warn when the 1-minute load average exceeds the CPUs: other work holds the cores, and OpenMP threads
    that wait on each other at every barrier stall whenever one is descheduled (decode steps of seconds
    were seen at load 27-40 on 2 cores with two threads, against ms with one). Returns True when it warned."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return False
    cpus = os.cpu_count() or threads
    if load <= cpus:
        return False
    logger.warning("load average %.1f on %d CPUs: other work is using the cores, and %d torch threads stall "
                   "each other whenever one is descheduled; set TOKENMILL_NUM_THREADS=1 on a busy machine",
                   load, cpus, threads)
    return True
