"""Executors: what runs the model for the engine core.

:class:`Executor` is the interface the core's step loop needs; today one
implementation exists, the in-process model runner
(:class:`tokenmill.model.runner.ModelRunner`, created by
:func:`create_executor`). Multi-process and Ray executors plug in here behind
the same interface.
"""

from __future__ import annotations

from typing import Any, Protocol

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """What the core needs from a model runner (see :class:`tokenmill.model.runner.ModelRunner`).

    Attributes:
        num_kv_blocks: blocks the scheduler may hand out.
        max_model_len: context limit in tokens.
        eos_token_ids: ids that end generation.
    """

    num_kv_blocks: int
    max_model_len: int
    eos_token_ids: list[int]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


def create_executor(config: EngineConfig, **kwargs: Any) -> Executor:
    """Load the checkpoint named by ``config.model`` and build the in-process model runner.

    ``kwargs`` go to :meth:`ModelRunner.from_config` (e.g. ``with_tokenizer``).
    torch is imported here, not when this module is imported.

    Raises:
        FileNotFoundError, ValueError: from model loading (bad path, unsupported architecture).
    """
    from tokenmill.model.runner import ModelRunner  # torch stays out of processes that never run a model

    return ModelRunner.from_config(config, **kwargs)
