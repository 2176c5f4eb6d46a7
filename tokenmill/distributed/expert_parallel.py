"""Expert parallelism: each rank of the tensor-parallel group holds a share of the experts whole.

``--enable-expert-parallel`` (vLLM's flag) shards the physical expert slots of
every MoE layer over the ranks of the tensor-parallel group (rank ``r`` of
``n`` holds slots ``[r * S, (r + 1) * S)``, see
:mod:`tokenmill.model.layers.moe`) instead of cutting every expert's columns;
attention and dense layers stay tensor-parallel. The scheme is GShard's
(Lepikhin et al., arXiv 2006.16668 §2.2, §3.2) dispatch / compute / combine
with two all-to-all exchanges (Switch Transformer, arXiv 2101.03961 §2.2;
DeepSpeed-MoE, arXiv 2201.05596 §5 for inference).

After attention every rank of the group holds the same ``[T, H]`` hidden
states. Per MoE layer (:meth:`ExpertParallel.forward`):

1. each rank takes its slice of the tokens (``ceil(T / n)`` rows, the last
   slices may be shorter or empty) and routes it (router, top-k, replica
   choice by token index, load counters: :meth:`FusedMoE.route`);
2. the ``slice * k`` (token, expert) rows are sorted by physical slot, which
   groups them by owner rank; one all-to-all of per-slot counts (``[P]``
   int64 each way) tells every owner how many rows come for each of its
   slots from each source;
3. **dispatch**: all-to-all of the hidden rows (``[rows, H]``, uneven splits);
4. the owner runs its slots grouped (:meth:`FusedMoE.run_experts`);
5. **combine**: all-to-all of the results back to the sources, which weight
   and sum each token's k outputs (:meth:`FusedMoE.combine`, the same order
   as one process);
6. an all-gather of the slices restores the replicated ``[T, H]``.

All collectives run on ``ParallelContext.ep`` (own timers: ``seconds`` is
the MoE communication time).

**Across data-parallel engine cores** (``--data-parallel-size N
--enable-expert-parallel``, tensor-parallel size 1): the expert-parallel group
is the ``N`` engine cores (:func:`~tokenmill.distributed.parallel_state.init_data_parallel_ep`).
Their tokens are not replicated: each core routes all of its own step's
tokens (``token_comm`` of size 1: no slicing, no final all-gather); the
dispatch and combine are the same. Every core must enter every MoE layer's
collectives in every step, so a core with nothing to run takes part with zero
tokens (:func:`dummy_forward`), and the engine cores agree before each step
whether anyone has work (:class:`StepSync`; vLLM's data-parallel "waves"). gloo in torch 2.13
supports ``all_to_all_single`` with uneven and empty splits, float32 and
bfloat16 (exercised by ``tests/distributed/test_expert_parallel.py``), so
there is no all-gather fallback; NCCL does too.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tokenmill.distributed.communicator import Communicator


class ExpertParallel:
    """All-to-all dispatch and combine of one MoE layer over an expert-parallel group.

    Args:
        comm: the group (size ``n`` = the layer's ``ep_size``; this rank's ``rank`` = ``ep_rank``).
        token_comm: the ranks that hold the same tokens (the tensor-parallel group): each routes its
            slice and an all-gather over it rebuilds the output. None: ``comm`` itself (expert
            parallelism over the tensor-parallel group); a size-1 communicator: every rank has its own
            tokens (data-parallel engine cores).

    Raises:
        ValueError: from :meth:`forward` when the layer's expert group does not match ``comm``.
    """

    def __init__(self, comm: Communicator, token_comm: Communicator | None = None) -> None:
        self.comm = comm
        self.token_comm = comm if token_comm is None else token_comm

    def forward(self, layer, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` (the same on every rank of ``token_comm``; ``T`` may be 0) -> the MoE output
        ``[T, H]`` (the same on every rank of ``token_comm``).

        Args:
            layer: a :class:`~tokenmill.model.layers.moe.FusedMoE` holding this rank's slots.
        """
        comm, n = self.comm, self.comm.size
        if layer.ep_size != n or layer.ep_rank != comm.rank:
            raise ValueError(f"layer is expert-parallel rank {layer.ep_rank}/{layer.ep_size}, the group "
                             f"{comm.rank}/{n}")
        t, h = x.shape
        k, s, p = layer.top_k, layer.num_local_experts, layer.num_physical_experts
        tc = self.token_comm
        chunk = -(-t // tc.size)
        lo, hi = min(tc.rank * chunk, t), min((tc.rank + 1) * chunk, t)
        weights, phys = layer.route(x[lo:hi], token_offset=lo)            # [ts, k]
        flat = phys.flatten()
        order = torch.argsort(flat, stable=True)                            # grouped by slot, so by owner
        send_slot = torch.bincount(flat, minlength=p)                       # [P]: rows for each slot
        recv_slot = comm.all_to_all_single(send_slot)                       # [n * S]: source-major
        send_rank = send_slot.view(n, s).sum(1).tolist()
        recv_by_src = recv_slot.view(n, s)
        recv_rank = recv_by_src.sum(1).tolist()
        xs = x[lo:hi].index_select(0, order // k)
        recv_x = comm.all_to_all_single(xs, recv_rank, send_rank)           # dispatch
        # rows arrive source by source, each sorted by slot: regroup by slot across sources
        slot_of_row = torch.repeat_interleave(torch.arange(s, device=x.device).repeat(n), recv_slot)
        regroup = torch.argsort(slot_of_row, stable=True)
        y_sorted = layer.run_experts(recv_x.index_select(0, regroup), recv_by_src.sum(0).tolist())
        y = torch.empty_like(y_sorted)
        y[regroup] = y_sorted
        back = comm.all_to_all_single(y, send_rank, recv_rank)              # combine
        out = layer.combine(back, order, weights)                           # [ts, H]
        if tc.size == 1 or t == 0:      # own tokens only, or none on any rank of token_comm (a dummy step)
            return out
        if out.shape[0] < chunk:
            out = torch.cat([out, out.new_zeros(chunk - out.shape[0], h)])
        return tc.all_gather(out, dim=0)[:t]


def moe_layers(model: torch.nn.Module) -> list:
    """The model's expert-parallel MoE layers (:class:`FusedMoE` with a dispatcher), in forward order."""
    from tokenmill.model.layers.moe import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE) and m.ep is not None]


@torch.inference_mode()
def dummy_forward(layers: list, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Take part in one step's expert-parallel collectives with zero tokens of one's own.

    An engine core with nothing scheduled still holds experts the other cores' tokens go to: it
    runs every MoE layer's dispatch, its experts on the rows it receives, and the combine, in the
    order of a real forward (attention and dense layers are skipped: they exchange nothing across
    data-parallel cores). vLLM runs "dummy batches" for the same reason.

    Args:
        layers: :func:`moe_layers` of the model.
    """
    x = torch.empty(0, hidden_size, dtype=dtype, device=device)
    for layer in layers:
        layer.ep.forward(layer, x)


class StepSync:
    """The data-parallel engine cores agree, before every step, whether to run it (lockstep "waves").

    Each core contributes ``(has_work, wakes_seen, stop)``; one all-reduce (MAX) of
    ``[has_work, wakes_seen, -wakes_seen, stop]`` gives every core the same answer:

    * ``run``: some core has work, or the cores have not all seen the same wake-ups yet (an add is
      on its way to one of them): every core runs one step, a real one or :func:`dummy_forward`;
    * otherwise the wave ends: every core goes back to blocking on its input. The API process sends
      every core a numbered wake-up after each request it adds (to whichever core), so all of them
      join the next wave; because a wave only ends when all have seen the same wake-ups, no core can
      be left waiting in a collective for a peer that is blocked on its input.
    * ``stop``: some core is leaving (shutdown, its parent gone).

    Args:
        comm: a communicator over all the engine cores (a group of its own: its time is not MoE time).

    Raises:
        RuntimeError: from ``torch.distributed`` in :meth:`sync` when a peer died (gloo: connection
            closed) or did not arrive within the group's timeout (``TOKENMILL_DIST_TIMEOUT`` s).
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.num_syncs = 0

    def sync(self, has_work: bool, wakes_seen: int, stop: bool = False) -> tuple[bool, bool, int]:
        """``(run, stop, max wakes seen)`` agreed by every core (see the class docstring)."""
        t = torch.tensor([int(has_work), wakes_seen, -wakes_seen, int(stop)], dtype=torch.int64,
                         device=self.comm.device)
        if self.comm.size > 1:
            t0 = time.perf_counter()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.comm.group)
            self.comm._tick(t0)
        self.num_syncs += 1
        work, hi, neg_lo, stop_any = t.tolist()
        return bool(work) or hi != -neg_lo, bool(stop_any), hi
