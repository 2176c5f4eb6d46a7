"""Memory diagnostics for soak runs: where a process's Python memory was allocated (tracemalloc).

A leak of a few KB per request shows up as an allocation site whose total size grows with the number
of requests served. With ``TOKENMILL_TRACEMALLOC=1`` the API and engine core processes start
:mod:`tracemalloc` at start-up (about 2x slower Python: diagnostics only), and ``GET /debug/invariants``
(served only with ``TOKENMILL_DEBUG_ENDPOINTS=1``) reports each process's top sites;
``benchmarks/soak.py --tracemalloc`` prints them at the end of a run. Native allocations (torch
tensors, oneDNN, the C kernels) are not traced: resident-set growth with flat Python sites points there.
"""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

from tokenmill import envs

ENV = "TOKENMILL_TRACEMALLOC"


def maybe_start_tracemalloc() -> bool:
    """Start :mod:`tracemalloc` when ``TOKENMILL_TRACEMALLOC`` is a positive integer (frames kept per site).

    Returns:
        True when tracing is on (started now or before).
    """
    frames = envs.get(ENV)
    if frames > 0 and not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    return tracemalloc.is_tracing()


def top_allocation_sites(k: int = 25) -> list[dict[str, Any]]:
    """The ``k`` source lines holding the most live Python memory, largest first.

    Returns:
        ``[{"site": "path:line", "size_kib": float, "count": int}]``; empty when tracing is off.
    """
    if not tracemalloc.is_tracing():
        return []
    snap = tracemalloc.take_snapshot().filter_traces([
        tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>")])
    out = []
    for stat in snap.statistics("lineno")[:k]:
        frame = stat.traceback[0]
        path = frame.filename
        cut = path.rfind("site-packages/")
        path = path[cut + len("site-packages/"):] if cut >= 0 else os.path.relpath(path) if path.startswith("/") else path
        out.append({"site": f"{path}:{frame.lineno}", "size_kib": round(stat.size / 1024, 1), "count": stat.count})
    return out
