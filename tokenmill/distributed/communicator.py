"""Timed collectives over one process group (gloo on CPU, NCCL on CUDA).

Every call adds its wall time to :attr:`Communicator.seconds` so the engine
and ``benchmarks/parallel.py`` can report the communication share of a step.
A communicator of size 1 does nothing (no group needed).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class Communicator:
    """Collectives of one group, with their cumulative time.

    Args:
        group: the ``torch.distributed`` process group (None when ``size == 1``).
        size: ranks in the group.
        rank: this process's rank inside the group.
        device: where the tensors live (gloo needs CPU tensors, NCCL CUDA ones).

    Attributes:
        seconds: wall seconds spent in this communicator's calls since creation.
        calls: number of calls.
    """

    def __init__(self, group=None, size: int = 1, rank: int = 0, device: torch.device | str = "cpu") -> None:
        self.group, self.size, self.rank = group, size, rank
        self.device = torch.device(device)
        self.seconds = 0.0
        self.calls = 0
        # gloo's CPU all-reduce has no bfloat16/float16 sum on every build: reduce those in float32
        self._widen = self.device.type == "cpu"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape) over the group; returns the sum (``x`` itself when reduced in place).

        On CPU, bfloat16/float16 tensors are summed in float32 and cast back
        (gloo's reduction kernels; also the more accurate sum).
        """
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        if self._widen and x.dtype in (torch.bfloat16, torch.float16):
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            x = wide.to(x.dtype)
        else:
            x = x.contiguous()
            dist.all_reduce(x, group=self.group)
        self._tick(t0)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order: ``[..., n, ...]`` -> ``[..., size * n, ...]``."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        out = torch.cat(parts, dim=dim)
        self._tick(t0)
        return out

    def all_to_all_single(self, x: torch.Tensor, output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None) -> torch.Tensor:
        """Exchange row blocks: rank ``i`` sends rows ``input_split_sizes[j]`` of ``x`` to rank ``j`` and
        receives ``output_split_sizes[j]`` rows from each rank ``j`` (rank order). ``None`` splits: equal
        blocks of ``x.shape[0] / size`` rows. Supported by gloo (torch >= 2.0, any dtype; also empty
        blocks) and NCCL.

        Args:
            x: ``[sum(input_split_sizes), ...]``.

        Returns:
            ``[sum(output_split_sizes), ...]`` (``x`` itself when ``size == 1``).
        """
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=self.group)
        self._tick(t0)
        return out

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` to global rank ``dst`` (blocking until it is handed over)."""
        t0 = time.perf_counter()
        dist.send(x.contiguous(), dst)
        self._tick(t0)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a ``shape``/``dtype`` tensor from global rank ``src``."""
        t0 = time.perf_counter()
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, src)
        self._tick(t0)
        return x

    def barrier(self) -> None:
        """Wait until every rank of the group arrives."""
        if self.size > 1:
            dist.barrier(group=self.group)

    def _tick(self, t0: float) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1
