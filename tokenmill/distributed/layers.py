"""Parallel building blocks that wrap one rank's shard of a dense module.

Column-parallel layers need no wrapper: a rank's fused q/k/v or gate/up shard
is an ordinary ``nn.Linear`` over its own output rows (see
:mod:`tokenmill.distributed.layout`). The wrappers here add the communication
the other cuts need (Megatron-LM, arXiv 1909.08053, §3, Fig. 3):

* :class:`RowParallelLinear`: partial products over the rank's input columns,
  summed by one all-reduce (o_proj, down_proj).
* :class:`VocabParallelEmbedding`: each rank looks up the ids in its
  vocabulary rows, zeros the others, all-reduce.
* :class:`ParallelLMHead`: each rank computes the logits of its rows, all-gather.
* :class:`PipelineStage`: the hand-over of ``(hidden, residual)`` between
  pipeline stages (GPipe, arXiv 1811.06965, §2).

Each wrapper keeps the dense shard as a child ``nn.Linear`` (``.linear``) so
the runner's weight packing (:func:`tokenmill.model.layers.linear.pack_linear_weights`)
still reaches it.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.communicator import Communicator


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the rank's input columns of a linear layer.

    Args:
        linear: ``nn.Linear(in_features / tp, out_features)``, the rank's
            columns of the full weight. Its bias, if any, is taken out and
            added once after the reduction (not once per rank).
        comm: the tensor-parallel group.
    """

    #: where a LoRA delta goes (:mod:`tokenmill.lora.tp`): on the inner linear, so the rank's partial delta
    #: joins its partial product before the all-reduce
    lora_inner = "linear"

    def __init__(self, linear: nn.Linear, comm: Communicator) -> None:
        super().__init__()
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
            linear.bias = None
        self.linear = linear
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, in_features / tp]`` -> ``[num_tokens, out_features]`` (full sum on every rank)."""
        y = self.comm.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup over rows ``[first, end)`` of the (padded) vocabulary on each rank, summed.

    Args:
        weight: ``[end - first, hidden_size]`` the rank's rows.
        first: the first vocabulary id of the rank's rows.
        comm: the tensor-parallel group.
    """

    def __init__(self, weight: torch.Tensor, first: int, comm: Communicator) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.first, self.end = first, first + weight.shape[0]
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]``."""
        if self.comm.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        mine = (input_ids >= self.first) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.first, torch.zeros_like(input_ids))
        x = nn.functional.embedding(local, self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.comm.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Logits of the rank's vocabulary rows, gathered: ``[n, hidden] -> [n, vocab_size]``.

    Args:
        linear: ``nn.Linear(hidden_size, padded_vocab / tp, bias=False)`` (for
            a tied head, sharing the storage of the embedding shard).
        comm: the tensor-parallel group.
        vocab_size: the real vocabulary size; padding columns are cut off.
    """

    def __init__(self, linear: nn.Linear, comm: Communicator, vocab_size: int) -> None:
        super().__init__()
        self.linear = linear
        self.comm = comm
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[n, hidden_size]`` -> logits ``[n, vocab_size]`` (model dtype)."""
        logits = self.comm.all_gather(self.linear(hidden), dim=-1)
        return logits[:, : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits


class NoLMHead(nn.Module):
    """Stands in for the LM head on a pipeline stage that has none (it never computes logits)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - a wiring error
        raise RuntimeError("this pipeline stage has no LM head; logits are computed on the last stage")


class PipelineStage:
    """Hands ``(hidden, residual)`` from one pipeline stage to the next.

    Used by :meth:`tokenmill.model.llama.LlamaForCausalLM.forward` through its
    ``pp_stage`` attribute: a stage that is not the first receives the
    previous stage's residual stream instead of embedding the tokens; one that
    is not the last sends its output on and returns None. Both tensors travel
    as one ``[2, num_tokens, hidden_size]`` message.

    Args:
        comm: the world communicator (point-to-point).
        is_first, is_last: the stage's position.
        prev_rank, next_rank: global ranks of the neighbouring stages (same tensor-parallel slot).
        hidden_size: residual stream width.
    """

    def __init__(self, comm: Communicator, is_first: bool, is_last: bool, prev_rank: int, next_rank: int,
                 hidden_size: int) -> None:
        self.comm, self.is_first, self.is_last = comm, is_first, is_last
        self.prev_rank, self.next_rank, self.hidden_size = prev_rank, next_rank, hidden_size

    def recv(self, num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` each ``[num_tokens, hidden_size]`` from the previous stage."""
        both = self.comm.recv((2, num_tokens, self.hidden_size), dtype, self.prev_rank)
        return both[0], both[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Send ``hidden`` and ``residual`` ``[num_tokens, hidden_size]`` to the next stage."""
        self.comm.send(torch.stack([hidden, residual]), self.next_rank)
