"""Expert-parallel load balancing (EPLB): where each MoE expert's replicas live.

Tokens do not spread evenly over a mixture-of-experts layer's experts: a few
"hot" experts get most of them, and under expert parallelism the rank that
holds them sets the step time while the others wait. EPLB gives every MoE
layer ``num_physical = num_logical + num_redundant`` expert *slots* (the
*physical* experts), ``num_physical / num_ranks`` per rank, and decides from
measured per-expert token counts which *logical* expert each slot holds: hot
experts get several replicas (their tokens are split among them) and the
replicas are packed onto ranks so that every rank gets about the same load.

The placement algorithm is the one DeepSeek published with DeepSeek-V3
(github.com/deepseek-ai/EPLB, "Expert Parallelism Load Balancer"; the
redundant-experts strategy of the DeepSeek-V3 technical report, arXiv
2412.19437, §3.4). Written here from its description, in our own words:

1. **Replicate** (:func:`replicate_experts`): start with one replica per
   logical expert; each redundant slot goes, one at a time, to the expert
   whose load per replica is currently the highest.
2. **Pack** (:func:`balanced_packing`): put items (expert groups, or expert
   replicas weighted by their share of the load) into packs that must each
   take the same number of items, heaviest item first, each into the
   currently lightest pack that still has room (greedy longest-processing-
   time with a cardinality limit).
3. **Hierarchical policy** (when the expert groups of group-limited routing
   divide evenly over the nodes): pack whole expert groups onto nodes first
   (so a group's experts stay on one node and tokens rarely cross nodes),
   then replicate inside each node, then pack the node's replicas onto its
   ranks. Otherwise the **global policy**: the same with one group and one
   node — replicate over all experts, pack the replicas onto all ranks.

Everything here runs rarely (every ``step_interval`` engine steps) on small
tensors; the loops run over items (at most ``num_physical`` iterations) and are
vectorised over layers.

The package, split as vLLM splits its own EPLB: :mod:`~tokenmill.distributed.eplb.placement`
(:class:`ExpertPlacement`, the maps, as vLLM names them: ``physical_to_logical``, ``logical_to_physical``,
``logical_replica_count``), :mod:`~tokenmill.distributed.eplb.policy` (the algorithm above and
:func:`preserve_slots`, which keeps replicas where they already are so a rebalance moves as few weights as
possible), :mod:`~tokenmill.distributed.eplb.load` (:class:`ExpertLoadWindow`, per-step per-expert token
counts over a sliding window, and the imbalance measures :func:`rank_loads`, :func:`imbalance_ratio`,
:func:`expert_imbalance_ratio`), :mod:`~tokenmill.distributed.eplb.transfer` (:func:`move_expert_weights`,
the transfer of expert weights between ranks with ``torch.distributed`` point-to-point operations) and
:mod:`~tokenmill.distributed.eplb.state` (:class:`EplbController`, one rank's driver, and the start-up
checks). Every name is re-exported here.
"""

from __future__ import annotations

from tokenmill.distributed.eplb.placement import ExpertPlacement, check_sizes
from tokenmill.distributed.eplb.policy import balanced_packing, replicate_experts, rebalance_experts, preserve_slots
from tokenmill.distributed.eplb.load import (rank_loads, imbalance_ratio, slot_imbalance_ratio,
                                             expert_imbalance_ratio, ExpertLoadWindow, logical_counts)
from tokenmill.distributed.eplb.transfer import Move, plan_moves, MoveStats, move_expert_weights
from tokenmill.distributed.eplb.state import (EplbController, expert_parallel_size, check_eplb_startup,
                                              build_controller)

__all__ = [
    "ExpertPlacement", "check_sizes", "balanced_packing", "replicate_experts", "rebalance_experts",
    "preserve_slots", "rank_loads", "imbalance_ratio", "slot_imbalance_ratio", "expert_imbalance_ratio",
    "ExpertLoadWindow", "logical_counts", "Move", "plan_moves", "MoveStats", "move_expert_weights",
    "EplbController", "expert_parallel_size", "check_eplb_startup", "build_controller",
]
