"""EPLB's per-rank state: :class:`EplbController` counts every step, rebalances every ``step_interval`` steps and
exports its statistics; the start-up checks and the builder the runner and executors call."""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch
import torch.distributed as dist

from tokenmill import envs
from tokenmill.distributed.eplb.load import (ExpertLoadWindow, expert_imbalance_ratio, imbalance_ratio, logical_counts,
                                             rank_loads, slot_imbalance_ratio)
from tokenmill.distributed.eplb.placement import ExpertPlacement
from tokenmill.distributed.eplb.policy import preserve_slots, rebalance_experts
from tokenmill.distributed.eplb.transfer import MoveStats, move_expert_weights
from tokenmill.metrics.stats import EPLB_MAX_LOAD_SERIES, EplbStats

logger = logging.getLogger("tokenmill.distributed.eplb")


class EplbController:
    """Expert-parallel load balancing on one rank: counts every step, rebalances every ``step_interval``.

    Drives the model's MoE layers (:class:`tokenmill.model.layers.moe.FusedMoE`
    or anything with the same attributes: ``num_experts``,
    ``num_physical_experts``, ``physical_to_logical`` ``[P]``, ``w13`` / ``w2``
    ``[slots_per_rank, ...]``, ``take_expert_load()`` -> ``[P]`` int64 and
    ``set_placement(physical_to_logical)``). After every engine step
    (:meth:`after_step`) it folds the layers' per-slot counters into the
    sliding window of logical-expert loads; every ``step_interval`` steps it
    all-reduces the window over the expert-parallel group (every rank counted
    the tokens it routed), computes the DeepSeek EPLB placement, keeps
    replicas in the slots they already occupy (:func:`preserve_slots`), and —
    if the predicted imbalance improves — moves the weights
    (:func:`move_expert_weights`) and switches every layer's maps. All of it
    runs between two engine steps on every rank at the same step count (the
    ranks step in lockstep), so no forward ever sees half-moved weights or a
    map that disagrees with them: service pauses for the rebalance's duration
    (``eplb_rebalance_seconds_total``), it never stops.

    With one expert-parallel rank every slot is local: a rebalance only
    changes the maps (which replica a token uses) and the metrics; the rank's
    load — all of it — cannot change.

    Args:
        layers: the MoE layers of this rank's model, in layer order.
        config: :class:`tokenmill.config.EplbConfig`.
        ep_rank, ep_size: this rank's place in the expert-parallel group.
        group: the group's ``torch.distributed`` process group (None: the
            default group; unused when ``ep_size == 1``).
        global_ranks: global rank of each group rank (default: the identity).
        num_groups, num_nodes: for the hierarchical policy (expert groups of
            group-limited routing, machines); 1 and 1 use the global policy.

    Raises:
        ValueError: no layers, layers of different sizes, or slots that do not
            divide over ``ep_size``.
    """

    # refresh the metrics snapshot (two small all-reduces) this often, in steps: TOKENMILL_EPLB_STATS_STEPS,
    # read when the state is built (``__init__``)
    STATS_EVERY = 32

    def __init__(self, layers: Sequence, config, ep_rank: int = 0, ep_size: int = 1, group=None,
                 global_ranks: Sequence[int] | None = None, num_groups: int = 1, num_nodes: int = 1) -> None:
        if not layers:
            raise ValueError("EPLB needs a mixture-of-experts model (no MoE layer found)")
        first = layers[0]
        num_logical, num_physical = int(first.num_experts), int(first.num_physical_experts)
        for layer in layers:
            if (int(layer.num_experts), int(layer.num_physical_experts)) != (num_logical, num_physical):
                raise ValueError("MoE layers with different expert counts")
        self.layers = list(layers)
        self.config = config
        self.STATS_EVERY = envs.TOKENMILL_EPLB_STATS_STEPS
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.group, self.global_ranks = group, global_ranks
        self.num_groups, self.num_nodes = num_groups, num_nodes
        p2l = torch.stack([layer.physical_to_logical.detach().to("cpu", torch.int64) for layer in self.layers])
        self.placement = ExpertPlacement.from_physical_to_logical(p2l, num_logical, ep_size)
        self.window = ExpertLoadWindow(len(self.layers), num_logical, config.window_size)
        self._total = torch.zeros(len(self.layers), num_physical, dtype=torch.int64)   # this rank's counts
        self._total_at_rebalance = torch.zeros_like(self._total)      # the group's totals at the last rebalance
        self.num_steps = 0
        self.num_rebalances = 0
        self.num_placement_changes = 0
        self.num_experts_moved = 0
        self.rebalance_seconds_total = 0.0
        self.last_rebalance_seconds = 0.0
        self.imbalance_before: float | None = None
        self.imbalance_after: float | None = None
        self.last_move: MoveStats | None = None
        self._stats = None

    # -- counting ------------------------------------------------------------------------------------------------
    def after_step(self) -> bool:
        """Record this step's counters; rebalance when the interval is reached.

        Collective over the expert-parallel group every ``STATS_EVERY``,
        ``log_balancedness_interval`` (with ``log_balancedness``) and
        ``step_interval`` steps: every rank must call it once per engine step.

        Returns:
            True when this call rebalanced.
        """
        counts = torch.stack([layer.take_expert_load().detach().to("cpu", torch.int64) for layer in self.layers])
        self.window.record(logical_counts(counts, self.placement))
        self._total += counts
        self.num_steps += 1
        cfg = self.config
        if cfg.log_balancedness and self.num_steps % cfg.log_balancedness_interval == 0:
            self._log_balancedness(counts)
        if self.num_steps % cfg.step_interval == 0:
            self.rebalance()
            return True
        if self.num_steps % self.STATS_EVERY == 0 or self._stats is None:
            self._stats = self._snapshot(self._all_reduce(self._total), self._all_reduce(self.window.load()))
        return False

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return t.clone()
        out = t.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def _rank_loads_measured(self, physical_counts: torch.Tensor) -> torch.Tensor:
        """``[L, ep_size]`` assignments each rank's slots computed (measured, not predicted)."""
        return physical_counts.to(torch.float64).view(len(self.layers), self.ep_size, -1).sum(-1)

    def _log_balancedness(self, counts: torch.Tensor) -> None:
        per_rank = self._rank_loads_measured(self._all_reduce(counts))
        ratio = imbalance_ratio(per_rank)
        if self.ep_rank == 0:
            logger.info(
                "EPLB step %d: balancedness %.4f (mean / max tokens per rank; imbalance ratio %.3f)",
                self.num_steps, 1.0 / ratio, ratio)

    # -- rebalancing ---------------------------------------------------------------------------------------------
    def rebalance(self) -> bool:
        """Compute a placement from the window and switch to it if it predicts a lower imbalance.

        Collective over the expert-parallel group.

        Returns:
            True when the placement changed (weights moved / maps switched).

        Raises:
            RuntimeError: from ``torch.distributed`` (a peer died or timed out).
        """
        t0 = time.perf_counter()
        load = self._all_reduce(self.window.load())                      # [L, E] over the group
        total = self._all_reduce(self._total)
        self.imbalance_before = imbalance_ratio(self._rank_loads_measured(total - self._total_at_rebalance))
        self._total_at_rebalance = total
        old = self.placement
        new = preserve_slots(rebalance_experts(load, old.num_physical, self.num_groups, self.num_nodes,
                                               self.ep_size), old)
        predicted_old = imbalance_ratio(rank_loads(load, old))
        predicted_new = imbalance_ratio(rank_loads(load, new))
        # switch when the rank imbalance drops; on a tie (always with one rank) when the busiest replica's share does
        key_old = (round(predicted_old, 9), round(slot_imbalance_ratio(load, old), 9))
        key_new = (round(predicted_new, 9), round(slot_imbalance_ratio(load, new), 9))
        changed = key_new < key_old and not torch.equal(new.physical_to_logical, old.physical_to_logical)
        if changed:
            self.last_move = move_expert_weights([[layer.w13.data, layer.w2.data] for layer in self.layers],
                                                 old, new, self.ep_rank, self.group, self.global_ranks)
            for i, layer in enumerate(self.layers):
                layer.set_placement(new.physical_to_logical[i])
            self.placement = new
            self.num_placement_changes += 1
            self.num_experts_moved += self.last_move.num_moves
        self.imbalance_after = predicted_new if changed else predicted_old
        self.num_rebalances += 1
        self.last_rebalance_seconds = time.perf_counter() - t0
        self.rebalance_seconds_total += self.last_rebalance_seconds
        self._stats = self._snapshot(total, load)
        if self.ep_rank == 0:
            logger.info(
                "EPLB rebalance %d at step %d: imbalance %.3f measured -> %.3f predicted (%s; %d replicas moved, "
                "%.1f ms)", self.num_rebalances, self.num_steps, self.imbalance_before, self.imbalance_after,
                "placement changed" if changed else "placement kept: no gain",
                self.last_move.num_moves if changed and self.last_move else 0, 1e3 * self.last_rebalance_seconds)
        return changed

    # -- reporting -----------------------------------------------------------------------------------------------
    def _snapshot(self, total: torch.Tensor, load: torch.Tensor) -> EplbStats:
        """Stats from the group's cumulative per-slot counts ``total`` ``[L, P]`` and the window ``load`` ``[L, E]``.

        The measured imbalance covers the steps since the last rebalance; right
        after one (no step yet) it stays the value measured before it.
        """
        since = total - self._total_at_rebalance
        if int(since.sum()) > 0 or self.imbalance_before is None:
            measured_ratio = imbalance_ratio(self._rank_loads_measured(since))
        else:
            measured_ratio = self.imbalance_before
        num_layers, num_logical = load.shape
        if num_layers * num_logical <= EPLB_MAX_LOAD_SERIES:
            labels, rows = [str(i) for i in range(num_layers)], load.tolist()
        else:
            labels, rows = ["all"], [load.sum(0).tolist()]
        return EplbStats(
            num_ranks=self.ep_size, num_moe_layers=num_layers, num_logical_experts=num_logical,
            num_physical_experts=self.placement.num_physical, window_steps=self.window.num_steps,
            load_layers=labels, expert_load=rows,
            imbalance_ratio=measured_ratio,
            rank_load_total=self._rank_loads_measured(total).to(torch.int64).tolist(),
            expert_imbalance_ratio=expert_imbalance_ratio(load),
            imbalance_before=self.imbalance_before, imbalance_after=self.imbalance_after,
            num_rebalances=self.num_rebalances, num_placement_changes=self.num_placement_changes,
            num_experts_moved=self.num_experts_moved, rebalance_seconds_total=self.rebalance_seconds_total,
            last_rebalance_seconds=self.last_rebalance_seconds)

    def stats(self) -> EplbStats:
        """The latest :class:`~tokenmill.metrics.stats.EplbStats` (refreshed every ``STATS_EVERY`` steps
        and at each rebalance; local, no communication)."""
        if self._stats is None:
            z = torch.zeros(len(self.layers), self.placement.num_logical, dtype=torch.int64)
            self._stats = self._snapshot(self._total.clone(), z)
        return self._stats

    def describe(self) -> str:
        """The start-up line: expert slots per rank, redundant experts, the first MoE layer's placement."""
        pl = self.placement
        ranks = "; ".join(f"rank {r}: {row}" for r, row in enumerate(pl.experts_per_rank(0)))
        return (f"EPLB on: {len(self.layers)} MoE layers x {pl.num_logical} experts, {pl.num_redundant} redundant "
                f"-> {pl.num_physical} slots, {pl.slots_per_rank} per rank over {pl.num_ranks} expert-parallel "
                f"rank(s); window {self.config.window_size} steps, rebalance every {self.config.step_interval} "
                f"steps; layer 0 experts per rank: {ranks}"
                + (" (one rank: a rebalance changes only the replica maps and metrics)" if pl.num_ranks == 1 else ""))


def expert_parallel_size(parallel_config, data_parallel_size: int = 1) -> int:
    """Ranks the experts are spread over with ``--enable-expert-parallel``: the tensor-parallel group of a
    pipeline stage times the data-parallel engine cores; else 1 (every rank holds every expert)."""
    if not parallel_config.enable_expert_parallel:
        return 1
    return parallel_config.tensor_parallel_size * data_parallel_size


def check_eplb_startup(parallel_config, arch, data_parallel_size: int = 1) -> None:
    """Refuse at start-up what ``--enable-eplb`` cannot do (before any weight or worker is loaded).

    Args:
        parallel_config: :class:`tokenmill.config.ParallelConfig`.
        arch: the checkpoint's :class:`~tokenmill.model.arch_config.ModelArchConfig`.

    Raises:
        ValueError: EPLB on a dense model, without ``--enable-expert-parallel``
            (vLLM's rule), or with ``num_experts + num_redundant_experts`` not a
            multiple of the expert-parallel size (the message says which
            ``num_redundant_experts`` values fit).
    """
    if not parallel_config.enable_eplb:
        return
    num_experts = arch.num_experts
    if not arch.is_moe:
        raise ValueError(f"--enable-eplb needs a mixture-of-experts model; {arch.architecture} has no experts")
    if not parallel_config.enable_expert_parallel:
        raise ValueError("--enable-eplb needs --enable-expert-parallel (experts placed over the ranks)")
    ep = expert_parallel_size(parallel_config, data_parallel_size)
    r = parallel_config.eplb.num_redundant_experts
    if (num_experts + r) % ep:
        fits = [k for k in range(r, r + 2 * ep) if (num_experts + k) % ep == 0][:2]
        raise ValueError(f"--eplb-config num_redundant_experts {r}: {num_experts} experts + {r} redundant slots do "
                         f"not divide over {ep} expert-parallel ranks; use e.g. {fits}")


def build_controller(config, model, ep_rank: int = 0, ep_size: int = 1, group=None,
                     global_ranks: Sequence[int] | None = None) -> "EplbController | None":
    """The rank's :class:`EplbController` for ``model`` (None without ``--enable-eplb``); logs its start-up line.

    ``model.moe_layers()`` lists the MoE layers (the MoE models' helper).

    Raises:
        ValueError: ``--enable-eplb`` on a model with no MoE layer.
    """
    par = config.parallel
    if not par.enable_eplb:
        return None
    moe_layers = getattr(model, "moe_layers", None)
    ctl = EplbController(moe_layers() if moe_layers is not None else [], par.eplb, ep_rank=ep_rank, ep_size=ep_size,
                         group=group, global_ranks=global_ranks)
    if ep_rank == 0:
        logger.info("%s", ctl.describe())
    return ctl
