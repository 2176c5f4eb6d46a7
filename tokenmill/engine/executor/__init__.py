"""Executors: what runs the model for the engine core.

:class:`Executor` is the interface the core's step loop needs. Three implementations:

* ``uniproc`` (:mod:`.uniproc`): the model runner inside the engine process
  (:class:`tokenmill.model.runner.ModelRunner`; one rank).
* ``mp`` (:mod:`.mp`): one worker process per rank on this machine, each pinned to its own CPUs.
* ``ray`` (:mod:`.ray`): one Ray actor per rank, so a model can span machines.

:func:`create_executor` picks one from ``--distributed-executor-backend`` and
the parallel sizes. The scheduler runs once, in the engine core; distributed
executors send every worker a diff-shaped step description (:mod:`.step_codec`)
and take the sampled tokens from the output rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.executor.base import WorkerDiedError

__all__ = ["Executor", "WorkerDiedError", "create_executor"]

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """What the core needs from a model runner (see :class:`tokenmill.model.runner.ModelRunner`).

    Attributes:
        num_kv_blocks: blocks the scheduler may hand out.
        max_model_len: context limit in tokens.
        eos_token_ids: ids that end generation.

    A distributed executor also has ``shutdown()`` (stop its workers) and may
    raise an exception with ``fatal = True`` (:class:`WorkerDiedError`) from
    ``execute_model``: the core then stops instead of failing one batch.

    Optional: ``release_requests(req_ids)`` drops per-request state of
    finished requests when a step has nothing to run (otherwise they arrive
    in the next ``SchedulerOutput.finished_req_ids``); the runner keeps such
    state for speculative decoding. Optional: ``eplb_stats`` (the EPLB state
    for metrics, :class:`~tokenmill.metrics.stats.EplbStats`, or None).
    """

    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: list[int]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


def create_executor(config: EngineConfig, **kwargs: Any) -> Executor:
    """Build the executor ``config.parallel`` asks for (loading the model).

    ``kwargs`` go to the executor (e.g. ``with_tokenizer``: ``"eos"`` loads
    the tokenizer only as the EOS fallback, as the server's engine core does).
    torch is imported here, not when this module is imported.

    Raises:
        FileNotFoundError, ValueError: from model loading (bad path,
            unsupported architecture) or a layout the model cannot be split into.
        ImportError: ``ray`` asked for but not installed (``pip install tokenmill[ray]``).
        WorkerDiedError: a worker failed to start.
    """
    backend = config.parallel.executor_backend
    if backend == "uniproc":
        t0 = time.perf_counter()
        from tokenmill.model.runner import ModelRunner  # torch stays out of processes that never run a model

        logger.info("imported torch and the model runner in %.1f s", time.perf_counter() - t0)
        return ModelRunner.from_config(config, **kwargs)
    if backend == "mp":
        from tokenmill.engine.executor.mp import MultiprocExecutor

        return MultiprocExecutor(config, **kwargs)
    from tokenmill.engine.executor.ray import RayExecutor

    return RayExecutor(config, **kwargs)
