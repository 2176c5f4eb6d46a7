"""Mixture-of-experts feed-forward block: top-k router and grouped SwiGLU experts.

A sparse MoE layer (Shazeer et al., arXiv 1701.06538 §2; GShard, Lepikhin et al.,
arXiv 2006.16668 §2.2; Switch Transformer, Fedus et al., arXiv 2101.03961 §2.1)
replaces the dense SwiGLU block: a router (one ``[num_experts, hidden]`` linear)
scores every token, the token goes to its ``top_k`` best experts, and the
block's output is the routing-weighted sum of those experts' SwiGLU outputs.

Normalisation of the routing weights, per family:

* Mixtral (Jiang et al., arXiv 2401.04088 §2.1): ``softmax`` over the top-k
  logits, i.e. the softmax over all experts restricted to the top k and
  renormalised to sum to 1 (the two are equal).
* Qwen3-MoE (Qwen3 technical report, arXiv 2505.09388 §2): softmax over all
  experts, top k, renormalised only when the config's ``norm_topk_prob`` is set.

Both are :func:`select_experts` with ``renormalize`` True/``norm_topk_prob``.

Experts are computed grouped: the ``num_tokens * top_k`` (token, expert)
assignments are sorted by expert, and each active expert runs one gate/up GEMM,
SiLU-and-multiply and one down GEMM over all of its rows
(:meth:`FusedMoE.run_experts`). The Python loop is over active experts, never
over tokens.

**Logical and physical experts** (for expert parallelism and EPLB).
The checkpoint's experts are *logical* experts ``0 .. E-1``. The layer stores
*physical* expert slots ``0 .. P-1`` with ``P = E + R`` (``R`` redundant
slots that hold replicas of busy experts); expert-parallel rank ``r`` of
``ep_size`` holds slots ``[r * S, (r + 1) * S)``, ``S = P / ep_size``, in
:attr:`FusedMoE.w13` / :attr:`FusedMoE.w2` (local slot ``s`` = physical slot
``r * S + s``). Three buffers, identical on every rank, describe the placement:

* ``physical_to_logical`` ``[P]`` int64: the logical expert in each slot;
* ``logical_to_physical`` ``[E, max_replicas]`` int64: each logical expert's
  slots (``-1`` padded), ``logical_replica_count`` ``[E]`` int64 how many;
* at dispatch, token ``t`` routed to logical expert ``e`` uses replica
  ``t mod replica_count[e]`` (token index in the step), which spreads a hot
  expert's tokens evenly over its replicas.

``expert_load`` ``[P]`` int64 counts the assignments this rank routed to each
physical slot since the last :meth:`FusedMoE.take_expert_load` (one
``bincount`` per forward). :mod:`tokenmill.distributed.eplb` and docs/architecture.md say how EPLB uses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers import fused_cpu


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing (GShard arXiv 2006.16668 §2.2; Switch arXiv 2101.03961 §2.1).

    Softmax over all experts in float32, keep the ``top_k`` largest
    probabilities; with ``renormalize`` they are divided by their sum (which
    equals Mixtral's softmax over the top-k logits, arXiv 2401.04088 §2.1).

    Args:
        router_logits: ``[num_tokens, num_experts]`` any float dtype.
        top_k: experts per token.
        renormalize: rescale the kept weights to sum to 1 per token.

    Returns:
        ``(weights, ids)``: ``[num_tokens, top_k]`` float32 and int64, in
        descending weight order (ties: ``torch.topk``'s order, as transformers).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def initial_placement(num_experts: int, num_redundant: int) -> torch.Tensor:
    """Default ``physical_to_logical`` ``[num_experts + num_redundant]`` int64: slot ``p < E`` holds
    expert ``p``, redundant slot ``E + j`` a replica of expert ``j mod E`` (EPLB replaces it by a
    load-balanced placement)."""
    p = torch.arange(num_experts + num_redundant, dtype=torch.int64, device="cpu")
    return torch.where(p < num_experts, p, (p - num_experts) % max(num_experts, 1))


def replica_tables(physical_to_logical: torch.Tensor, num_experts: int, max_replicas: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of a placement.

    Args:
        physical_to_logical: ``[P]`` int64, every logical expert at least once.
        num_experts: logical experts ``E``.
        max_replicas: width of the table (``P - E + 1`` fits any placement).

    Returns:
        ``(logical_to_physical [E, max_replicas] int64, -1 padded, in slot order;
        logical_replica_count [E] int64)``.

    Raises:
        ValueError: an id outside ``[0, E)``, a logical expert with no slot, or
            more replicas than ``max_replicas``.
    """
    p2l = physical_to_logical.to("cpu", torch.int64)
    if p2l.numel() and (int(p2l.min()) < 0 or int(p2l.max()) >= num_experts):
        raise ValueError(f"physical_to_logical holds ids outside [0, {num_experts})")
    if p2l.device.type != "cpu":
        raise ValueError("physical_to_logical must hold data (not a meta tensor)")
    counts = torch.bincount(p2l, minlength=num_experts)
    if int(counts.min()) < 1:
        raise ValueError(f"logical experts {torch.nonzero(counts == 0).flatten().tolist()} have no physical slot")
    if int(counts.max()) > max_replicas:
        raise ValueError(f"an expert has {int(counts.max())} replicas, more than the table's {max_replicas}")
    table = torch.full((num_experts, max_replicas), -1, dtype=torch.int64, device="cpu")
    order = torch.argsort(p2l, stable=True)              # slots grouped by logical expert, slot order inside
    first = torch.cumsum(counts, 0) - counts
    col = torch.arange(p2l.numel(), device="cpu") - torch.repeat_interleave(first, counts)
    table[p2l[order], col] = order
    return table, counts


class MoERouter(nn.Linear):
    """The router (``[num_experts, hidden]``, no bias). A subclass of ``nn.Linear`` on purpose: it is
    left dense by ``--quantization`` and by oneDNN packing (tiny; and routing decisions are sensitive
    to rounding)."""


class FusedMoE(nn.Module):
    """Router + grouped SwiGLU experts, ``[num_tokens, hidden] -> [num_tokens, hidden]``.

    Args:
        hidden_size: model width ``H``.
        intermediate_size: one expert's SwiGLU hidden width ``I`` (this rank's
            columns when experts are tensor-parallel).
        num_experts: logical experts ``E``.
        top_k: experts per token.
        renormalize: see :func:`select_experts`.
        num_redundant_experts: ``R`` extra physical slots (EPLB replicas).
        ep_size, ep_rank: expert-parallel group; this rank holds ``S = (E + R) / ep_size`` slots.

    Attributes:
        gate: :class:`MoERouter` ``[E, H]``.
        w13: ``[S, 2 * I, H]`` each local slot's gate rows then up rows.
        w2: ``[S, H, I]`` each local slot's down projection.
        physical_to_logical, logical_to_physical, logical_replica_count: the
            placement (module docstring).
        expert_load: ``[E + R]`` int64 assignments routed per physical slot.
        ep: set by :mod:`tokenmill.distributed.expert_parallel` for expert
            parallelism (an object with ``forward(layer, x)`` that dispatches
            with all-to-all); None runs every slot locally.
        tp_comm: set for tensor-parallel experts (each rank holds ``I / tp``
            columns of every expert): the output is all-reduced over it.
        count_expert_load: False skips the counters.

    Raises:
        ValueError: ``(E + R)`` not divisible by ``ep_size``, or ``top_k > E``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, num_redundant_experts: int = 0, ep_size: int = 1, ep_rank: int = 0) -> None:
        super().__init__()
        physical = num_experts + num_redundant_experts
        if physical % ep_size:
            raise ValueError(f"{physical} physical experts cannot be split evenly over {ep_size} ranks")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..{num_experts}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.num_redundant_experts = num_redundant_experts
        self.num_physical_experts = physical
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.num_local_experts = physical // ep_size
        self.first_slot = ep_rank * self.num_local_experts
        self.gate = MoERouter(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size),
                               requires_grad=False)
        self.max_replicas = num_redundant_experts + 1
        # not part of the checkpoint (persistent=False); filled here, or after to_empty when built on meta
        self.register_buffer("physical_to_logical", torch.empty(physical, dtype=torch.int64), persistent=False)
        self.register_buffer("logical_to_physical", torch.empty(num_experts, self.max_replicas, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("logical_replica_count", torch.empty(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("expert_load", torch.empty(physical, dtype=torch.int64), persistent=False)
        self._has_replicas = num_redundant_experts > 0
        self.count_expert_load = True
        self.ep = None
        self.tp_comm = None
        self._loaded: set[tuple[int, str]] = set()
        if self.w13.device.type != "meta":
            self.reset_placement_buffers()

    # -- placement (EPLB) ----------------------------------------------------------------------
    def reset_placement_buffers(self) -> None:
        """Recompute the placement buffers from the default placement (after ``to_empty``, which leaves
        buffers uninitialised) and zero the counters."""
        self.set_placement(initial_placement(self.num_experts, self.num_redundant_experts))
        self.expert_load.zero_()

    def set_placement(self, physical_to_logical: torch.Tensor) -> None:
        """Switch dispatch to a new placement (in place; every rank must call it with the same tensor
        before the same step). The caller has already put the weights in the local slots
        (:meth:`set_expert_weights`).

        Args:
            physical_to_logical: ``[E + R]`` int64.

        Raises:
            ValueError: wrong length or an invalid placement (:func:`replica_tables`).
        """
        p2l = physical_to_logical.to("cpu", torch.int64).flatten()
        if p2l.numel() != self.num_physical_experts:
            raise ValueError(f"placement has {p2l.numel()} slots, the layer {self.num_physical_experts}")
        l2p, cnt = replica_tables(p2l, self.num_experts, self.max_replicas)
        dev = self.w13.device
        self.physical_to_logical.copy_(p2l.to(dev))
        self.logical_to_physical.copy_(l2p.to(dev))
        self.logical_replica_count.copy_(cnt.to(dev))
        self._has_replicas = bool(int(cnt.max()) > 1)

    def local_logical_ids(self) -> list[int]:
        """The logical expert in each of this rank's slots, ``[S]``."""
        return self.physical_to_logical[self.first_slot:self.first_slot + self.num_local_experts].tolist()

    def expert_weights(self, local_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one local slot's weights: ``w13 [2 * I, H]`` (gate rows, then up) and ``w2 [H, I]``."""
        return self.w13[local_slot], self.w2[local_slot]

    @torch.no_grad()
    def set_expert_weights(self, local_slot: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Overwrite one local slot's weights (EPLB moves an expert in; shapes as :meth:`expert_weights`).

        Raises:
            ValueError: a slot outside ``[0, S)`` or wrong shapes.
        """
        if not 0 <= local_slot < self.num_local_experts:
            raise ValueError(f"local slot {local_slot} outside [0, {self.num_local_experts})")
        if tuple(w13.shape) != tuple(self.w13.shape[1:]) or tuple(w2.shape) != tuple(self.w2.shape[1:]):
            raise ValueError(f"expert weights {tuple(w13.shape)}, {tuple(w2.shape)} do not fit "
                             f"{tuple(self.w13.shape[1:])}, {tuple(self.w2.shape[1:])}")
        self.w13[local_slot].copy_(w13)
        self.w2[local_slot].copy_(w2)

    def take_expert_load(self, reset: bool = True) -> torch.Tensor:
        """A copy of ``expert_load`` ``[E + R]`` int64 (assignments per physical slot), zeroed with ``reset``."""
        out = self.expert_load.clone()
        if reset:
            self.expert_load.zero_()
        return out

    # -- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def load_expert_weight(self, expert: int, which: str, tensor: torch.Tensor) -> int:
        """Copy logical expert ``expert``'s ``gate_proj`` / ``up_proj`` ``[I, H]`` or ``down_proj``
        ``[H, I]`` into every local slot that holds it.

        Returns:
            slots written (0 when no local slot holds the expert: expected under expert parallelism).

        Raises:
            ValueError: an unknown ``which``, an expert id outside ``[0, E)``, or a shape mismatch.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside [0, {self.num_experts})")
        i = self.intermediate_size
        written = 0
        for s, logical in enumerate(self.local_logical_ids()):
            if logical != expert:
                continue
            if which == "gate_proj":
                dst = self.w13[s, :i]
            elif which == "up_proj":
                dst = self.w13[s, i:]
            elif which == "down_proj":
                dst = self.w2[s]
            else:
                raise ValueError(f"unknown expert weight {which!r}")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"expert {expert} {which}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dtype=dst.dtype))
            self._loaded.add((s, which))
            written += 1
        return written

    def missing_expert_weights(self) -> list[str]:
        """``"slot S (expert E) gate_proj"`` for every local slot weight not loaded yet."""
        out = []
        for s, logical in enumerate(self.local_logical_ids()):
            for which in ("gate_proj", "up_proj", "down_proj"):
                if (s, which) not in self._loaded:
                    out.append(f"slot {s} (expert {logical}) {which}")
        return out

    # -- forward -------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, token_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Router, top-k and replica choice for ``x`` ``[T, H]``; counts the load.

        Args:
            token_offset: index of ``x``'s first row in the step (replica choice uses ``offset + row``).

        Returns:
            ``(weights [T, k] float32, physical slot ids [T, k] int64)``.
        """
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self._has_replicas:
            cnt = self.logical_replica_count[ids]
            t = torch.arange(token_offset, token_offset + ids.shape[0], device=ids.device).unsqueeze(1)
            phys = self.logical_to_physical[ids, t % cnt]
        else:
            phys = self.logical_to_physical[ids, 0]
        if self.count_expert_load:
            self.expert_load += torch.bincount(phys.flatten(), minlength=self.num_physical_experts)
        return weights, phys

    def run_experts(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The grouped expert computation on rows already sorted by local slot.

        Args:
            xs: ``[N, H]`` rows; the first ``counts[0]`` go to local slot 0, the next ``counts[1]`` to slot 1, ...
            counts: ``[S]`` rows per local slot (sum ``N``).

        Returns:
            ``[N, H]`` each row's expert output ``down(silu(gate(x)) * up(x))`` (not weighted).
        """
        out = torch.empty_like(xs)
        i = self.intermediate_size
        fused = fused_cpu.usable(xs)
        off = 0
        for s, c in enumerate(counts):
            if not c:
                continue
            h = F.linear(xs[off:off + c], self.w13[s])
            h = fused_cpu.silu_mul(h) if fused else F.silu(h[:, :i]) * h[:, i:]
            torch.mm(h, self.w2[s].t(), out=out[off:off + c])
            off += c
        return out

    @staticmethod
    def combine(expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted sum over each token's k experts.

        Args:
            expert_out: ``[T * k, H]`` outputs in sorted (dispatch) order.
            order: ``[T * k]`` the assignment (``t * k + j``) of each sorted row.
            weights: ``[T, k]`` float32 routing weights.

        Returns:
            ``[T, H]`` in ``expert_out``'s dtype; summed over ``j`` in order (the same on every layout).
        """
        t, k = weights.shape
        buf = torch.empty_like(expert_out)
        buf[order] = expert_out
        buf = buf.view(t, k, expert_out.shape[-1])
        w = weights.to(buf.dtype)
        out = buf[:, 0] * w[:, :1]
        for j in range(1, k):
            out += buf[:, j] * w[:, j:j + 1]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, H]`` -> ``[num_tokens, H]``."""
        if self.ep is not None:
            return self.ep.forward(self, x)
        if self.ep_size > 1:
            raise RuntimeError("an expert-parallel MoE layer needs its dispatcher (layer.ep); "
                               "build it with tokenmill.distributed.model_loader.build_shard")
        weights, phys = self.route(x)
        k = self.top_k
        flat = phys.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_physical_experts).tolist()
        ys = self.run_experts(x.index_select(0, order // k), counts)
        out = self.combine(ys, order, weights)
        if self.tp_comm is not None:
            out = self.tp_comm.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
                f"physical={self.num_physical_experts} (redundant {self.num_redundant_experts}), "
                f"local slots {self.first_slot}-{self.first_slot + self.num_local_experts - 1} "
                f"(ep {self.ep_rank}/{self.ep_size}), intermediate={self.intermediate_size}")
