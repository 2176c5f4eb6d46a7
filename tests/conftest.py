"""Suite-wide setup: under ``pytest -n N`` (pytest-xdist, how ``scripts/test`` runs the suite) each worker process is
pinned to its own CPU, so it and every process it starts (servers, engine cores, TP workers: they size their thread
pools from their affinity mask, ``tokenmill.model.process_tuning.configure_threads``) run one thread per CPU instead
of two workers' thread pools spinning against each other on the same cores."""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):             # not Linux: leave the scheduler to it
        return
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if n < 2 or len(cpus) < n:
        return
    i = int(worker[2:])
    share = cpus[i * len(cpus) // n:(i + 1) * len(cpus) // n]
    os.sched_setaffinity(0, share)
    import torch

    torch.set_num_threads(len(share))
