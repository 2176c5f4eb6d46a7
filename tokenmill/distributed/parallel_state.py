"""Rank layout and process groups.

Global rank ``r`` of a ``tp x pp`` world is ``pp_rank * tp + tp_rank`` (the
ranks of one pipeline stage are consecutive, as in vLLM and Megatron-LM), so a
tensor-parallel group is one stage, and a pipeline hand-over goes from rank
``r`` to rank ``r + tp``.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tokenmill import envs
from tokenmill.distributed.communicator import Communicator

logger = logging.getLogger(__name__)

# How long one collective may wait for its peers before it raises (s). A peer that died closes its sockets at
# once (gloo raises "connection closed"; the executor sees the process exit); this only bounds a peer that is
# alive but stuck. Generous: a loaded 2-core machine can stall a rank for tens of seconds.
# TOKENMILL_DIST_TIMEOUT (tokenmill/envs.py), read when a group is built. How long the data-parallel engine
# cores wait for each other to join their group at start-up (s): TOKENMILL_WORKER_START_TIMEOUT.


@dataclass
class ParallelContext:
    """One rank's place in the ``tp x pp`` layout, with its communicators.

    Attributes:
        rank: global rank in ``[0, world_size)``.
        tp_size, pp_size: tensor-parallel ranks per stage, pipeline stages.
        device: where this rank's weights, KV cache and activations live.
        tp: communicator of this rank's tensor-parallel group (the stage).
        pp: communicator of the whole world, used for stage-to-stage send/recv.
        ep: the tensor-parallel group again, with its own timers, for the expert-parallel
            all-to-all dispatch and combine (:mod:`~tokenmill.distributed.expert_parallel`); across
            data-parallel engine cores, the group of the cores (:func:`init_data_parallel_ep`).
        dp: the data-parallel engine cores' group for their per-step agreement
            (:class:`~tokenmill.distributed.expert_parallel.StepSync`); size 1 otherwise.
        dp_size, dp_rank: data-parallel engine cores in the expert-parallel group, this one's index.
    """

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp: Communicator = field(default_factory=Communicator)
    pp: Communicator = field(default_factory=Communicator)
    ep: Communicator = field(default_factory=Communicator)
    dp: Communicator = field(default_factory=Communicator)
    dp_size: int = 1
    dp_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        """Global rank of the same tensor-parallel slot in the previous stage."""
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        """Global rank of the same tensor-parallel slot in the next stage."""
        return self.rank + self.tp_size

    def comm_seconds(self) -> float:
        """Seconds this rank spent in collectives and point-to-point transfers since start."""
        return self.tp.seconds + (self.pp.seconds if self.pp is not self.tp else 0.0) + self.ep.seconds


def collective_backend(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def _join_world(backend: str, init_method: str, rank: int, world: int, timeout_s: float,
                start_timeout_s: float | None = None) -> None:
    """``init_process_group`` with per-collective ``timeout_s``; with ``start_timeout_s`` (``tcp://`` only) the
    rendezvous itself may wait that long (engine cores that start minutes apart on a loaded machine)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if start_timeout_s is not None and init_method.startswith("tcp://"):
        host, port = init_method[len("tcp://"):].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=max(timeout_s, start_timeout_s)))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)


def _new_group(ranks: list[int], backend: str, timeout_s: float):
    """``dist.new_group`` with the collective timeout: without one it falls back to torch's default (30 min
    for gloo), and a collective of that sub-group waiting for a stuck peer would hang that long."""
    return dist.new_group(ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str,
                     device: torch.device | str = "cpu", timeout_s: float | None = None,
                     dp_size: int = 1, dp_rank: int = 0) -> ParallelContext:
    """Join the process group and build this rank's communicators.

    Every rank of the ``tp_size * pp_size`` world calls this with the same
    ``init_method`` (``tcp://host:port`` or ``file://path``). With one rank no
    process group is created and every collective is a no-op.

    With ``dp_size > 1`` (``--data-parallel-size N --enable-expert-parallel`` with ``-tp`` above 1, pipeline
    size 1) the tensor-parallel workers of all ``N`` engine cores join one world of ``tp_size * N`` ranks
    (world rank ``dp_rank * tp_size + rank``): each core's workers form its tensor-parallel group, and
    ``ep`` is the whole world (every MoE layer's experts are shared over all of them; each core's tokens
    stay within its tensor-parallel group). ``rank`` stays the rank inside the engine core.

    Args:
        rank: this process's rank in its engine core's ``tp_size * pp_size`` layout.
        device: ``cpu`` (gloo) or ``cuda[:N]`` (NCCL; the rank's GPU).
        timeout_s: per-collective timeout in seconds (every group).
        dp_size, dp_rank: data-parallel engine cores sharing the experts, this rank's core.

    Raises:
        ValueError: a rank outside the world, or ``dp_size > 1`` with pipeline parallelism.
        RuntimeError: from ``torch.distributed`` (rendezvous failed or timed out).
    """
    local = tp_size * pp_size
    if not 0 <= rank < local:
        raise ValueError(f"rank {rank} outside a world of {local} ({tp_size} x {pp_size})")
    if dp_size > 1 and pp_size != 1:
        raise ValueError("expert parallelism across data-parallel engine cores needs --pipeline-parallel-size 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} outside {dp_size}")
    device = torch.device(device)
    if local * dp_size == 1:
        return ParallelContext(rank=0, tp_size=1, pp_size=1, device=device)
    backend = collective_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world, grank = local * dp_size, dp_rank * local + rank
    timeout_s = envs.TOKENMILL_DIST_TIMEOUT if timeout_s is None else timeout_s
    _join_world(backend, init_method, grank, world, timeout_s,
                envs.TOKENMILL_WORKER_START_TIMEOUT if dp_size > 1 else None)
    tp_group = None
    for d in range(dp_size):           # every rank must create every group, in the same order
        for stage in range(pp_size):
            ranks = list(range(d * local + stage * tp_size, d * local + (stage + 1) * tp_size))
            g = _new_group(ranks, backend, timeout_s) if tp_size > 1 else None
            if grank in ranks:
                tp_group = g
    tp = Communicator(tp_group, tp_size, rank % tp_size, device) if tp_size > 1 else Communicator(device=device)
    if dp_size > 1:
        logger.info("data-parallel engine %d/%d, rank %d joined the expert-parallel world of %d (%s): "
                    "tensor-parallel rank %d/%d, expert-parallel rank %d/%d, collective timeout %.0f s",
                    dp_rank, dp_size, rank, world, backend, rank % tp_size, tp_size, grank, world, timeout_s)
        return ParallelContext(rank=rank, tp_size=tp_size, pp_size=1, device=device, tp=tp,
                               pp=Communicator(device=device), ep=Communicator(dist.group.WORLD, world, grank, device),
                               dp_size=dp_size, dp_rank=dp_rank)
    pp = Communicator(dist.group.WORLD, world, rank, device)
    logger.info("rank %d/%d joined (%s): tensor-parallel rank %d/%d, pipeline stage %d/%d",
                rank, world, backend, rank % tp_size, tp_size, rank // tp_size, pp_size)
    ep = Communicator(tp_group, tp_size, rank % tp_size, device) if tp_size > 1 else Communicator(device=device)
    return ParallelContext(rank=rank, tp_size=tp_size, pp_size=pp_size, device=device, tp=tp, pp=pp, ep=ep)


def init_data_parallel_ep(dp_rank: int, dp_size: int, init_method: str, device: torch.device | str = "cpu",
                          timeout_s: float | None = None) -> ParallelContext:
    """Join the expert-parallel group of ``dp_size`` data-parallel engine cores (tensor and pipeline size 1).

    Every engine core calls this with the same ``init_method`` (the API process picks it). The world is
    the cores: ``ep`` (MoE dispatch/combine) is the whole world, ``dp`` a second group over the same
    ranks for the per-step agreement (separate timers), ``tp``/``pp`` are size 1.

    Raises:
        ValueError: a rank outside ``dp_size``.
        RuntimeError: from ``torch.distributed`` (rendezvous failed or timed out).
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} outside {dp_size}")
    device = torch.device(device)
    if dp_size == 1:
        return ParallelContext(device=device)
    backend = collective_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The rendezvous waits up to the start-up timeout (a loaded machine starts one core tens of seconds after
    # the other); collectives then use ``timeout_s``.
    timeout_s = envs.TOKENMILL_DIST_TIMEOUT if timeout_s is None else timeout_s
    _join_world(backend, init_method, dp_rank, dp_size, timeout_s, envs.TOKENMILL_WORKER_START_TIMEOUT)
    sync_group = _new_group(list(range(dp_size)), backend, timeout_s)
    logger.info("data-parallel engine %d/%d joined the expert-parallel group (%s, collective timeout %.0f s)",
                dp_rank, dp_size, backend, timeout_s)
    return ParallelContext(device=device, ep=Communicator(dist.group.WORLD, dp_size, dp_rank, device),
                           dp=Communicator(sync_group, dp_size, dp_rank, device), dp_size=dp_size, dp_rank=dp_rank)


def destroy_distributed() -> None:
    """Leave the process group (no-op when none was created)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
