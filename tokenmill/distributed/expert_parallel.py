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

All collectives run on ``ParallelContext.ep`` (the tensor-parallel group,
own timers: ``seconds`` is the MoE communication time). gloo in torch 2.13
supports ``all_to_all_single`` with uneven and empty splits, float32 and
bfloat16 (exercised by ``tests/distributed/test_expert_parallel.py``), so
there is no all-gather fallback; NCCL does too.
"""

from __future__ import annotations

import torch

from tokenmill.distributed.communicator import Communicator


class ExpertParallel:
    """All-to-all dispatch and combine of one MoE layer over an expert-parallel group.

    Args:
        comm: the group (size ``n`` = the layer's ``ep_size``; this rank's ``rank`` = ``ep_rank``).

    Raises:
        ValueError: from :meth:`forward` when the layer's expert group does not match ``comm``.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def forward(self, layer, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` (the same on every rank) -> the MoE output ``[T, H]`` (the same on every rank).

        Args:
            layer: a :class:`~tokenmill.model.layers.moe.FusedMoE` holding this rank's slots.
        """
        comm, n = self.comm, self.comm.size
        if layer.ep_size != n or layer.ep_rank != comm.rank:
            raise ValueError(f"layer is expert-parallel rank {layer.ep_rank}/{layer.ep_size}, the group "
                             f"{comm.rank}/{n}")
        t, h = x.shape
        k, s, p = layer.top_k, layer.num_local_experts, layer.num_physical_experts
        chunk = -(-t // n)
        lo, hi = min(comm.rank * chunk, t), min((comm.rank + 1) * chunk, t)
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
        if out.shape[0] < chunk:
            out = torch.cat([out, out.new_zeros(chunk - out.shape[0], h)])
        return comm.all_gather(out, dim=0)[:t]
