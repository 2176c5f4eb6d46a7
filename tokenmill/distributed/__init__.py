"""Tensor and pipeline parallelism on ``torch.distributed``.

* :mod:`~tokenmill.distributed.parallel_state`: the rank layout and process
  groups (:class:`ParallelContext`, :func:`init_distributed`).
* :mod:`~tokenmill.distributed.communicator`: timed collectives over a group
  (gloo on CPU, NCCL on CUDA).
* :mod:`~tokenmill.distributed.layout`: which layers, heads, FFN columns and
  vocabulary rows a rank owns, and the slicing of checkpoint tensors.
* :mod:`~tokenmill.distributed.layers`: row-parallel linear, vocabulary-parallel
  embedding and LM head, the pipeline hand-over between stages.
* :mod:`~tokenmill.distributed.model_loader`: build one rank's shard of a
  Llama-family model from a checkpoint.

Megatron-LM (Shoeybi et al., arXiv 1909.08053, §3) is the scheme: q/k/v and
gate/up are column-parallel (each rank computes its heads / FFN columns), o_proj
and down_proj are row-parallel (partial sums, one all-reduce each), the
embedding and LM head are split over the vocabulary. Pipeline stages own
contiguous layer ranges (GPipe, Huang et al., arXiv 1811.06965, §2).

This package imports :mod:`tokenmill.model` (it shards its modules) and never
the engine.
"""
