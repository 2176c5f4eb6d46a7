"""LoRA adapters on tensor-, pipeline- and data-parallel engines: sharding A/B, and the core's proxy.

**Sharding** (:func:`shard_adapter`). A rank's base layers are cut as in Megatron-LM (Shoeybi et al.,
arXiv 1909.08053, §3; :mod:`tokenmill.distributed.layout`), and each adapter is cut the same way,
as vLLM's ``ColumnParallelLinearWithLoRA`` / ``RowParallelLinearWithLoRA`` do:

* column-parallel layers (q/k/v, gate/up: the rank owns output rows): ``A`` ``[r, in]`` stays
  whole, ``B`` ``[out, r]`` keeps the rank's output rows (its query heads, its K/V heads —
  replicated ones included —, its FFN columns). The rank's delta ``(x Aᵀ) B_localᵀ`` is exactly
  its slice of the full delta.
* row-parallel layers (o_proj, down_proj: the rank owns input columns and the outputs are partial
  sums reduced by one all-reduce): ``A`` keeps the rank's input columns, ``B`` stays whole. The
  rank's ``(x_local A_localᵀ) Bᵀ`` is a partial sum of the delta, so
  :class:`~tokenmill.model.layers.lora.LoRALinear` wraps the row-parallel layer's *inner* linear
  (``RowParallelLinear.lora_inner``) and the delta joins the base's partial product before the one
  all-reduce (no extra collective; summing ``x_local A_localᵀ`` over ranks gives ``x Aᵀ``).
* pipeline stages keep the adapter's layers of their own layer range, renumbered to local indices.

Every rank validates the full adapter against the full architecture first (same errors as one
process), then cuts it; a rank holds ``1/tp`` of the B of column layers and of the A of row layers.

**The engine core's side** (:class:`WorkerLoRAProxy`). With a multi-process executor the model,
and so the adapters, live in the workers. The proxy gives :class:`~tokenmill.engine.engine_core.EngineCore`
the interface of :class:`~tokenmill.lora.manager.LoRAManager` (``ensure`` / ``load_async`` /
``load_now`` / ``poll`` / ``remove`` / ``pinned``): it validates each adapter on its own loader
thread (so a bad one is a 400 or a start-up error naming the file, and the scheduler admits a
request only once the adapter proved loadable), keeps no tensors, and tells every worker to load
(``("load", LoRARequest)``, on the worker's loader thread, off its step path) or drop
(``("remove", lora_int_id)``) an adapter. The proxy owns the ``--max-cpu-loras`` LRU (it knows
which adapters queued and running requests pin); the workers keep what they are told and load
on the step path only an adapter whose load has not finished yet (it waits for that load).
Messages go on the same ordered channel as the steps, so a worker sees a load before any step
that uses the adapter and a remove after the last one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from tokenmill.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRAWeights, load_adapter

logger = logging.getLogger(__name__)

#: the PEFT targets that are column-parallel (output rows cut) and row-parallel (input columns cut)
COLUMN_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_TARGETS = ("o_proj", "down_proj")


def target_ranges(lay: Any) -> dict[str, tuple[int, int]]:
    """Per PEFT target, the ``(first, end)`` feature range a rank owns: output rows for column-parallel
    targets, input columns for row-parallel ones (``lay``: a :class:`~tokenmill.distributed.layout.RankLayout`)."""
    d = lay.head_dim
    q = (lay.q_heads[0] * d, lay.q_heads[1] * d)
    kv = (lay.kv_heads[0] * d, lay.kv_heads[1] * d)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": lay.ffn, "up_proj": lay.ffn,
            "o_proj": q, "down_proj": lay.ffn}


def shard_adapter(adapter: LoRAAdapter, lay: Any) -> LoRAAdapter:
    """The part of a validated full ``adapter`` that rank ``lay`` serves (see the module docstring).

    Args:
        adapter: from :func:`~tokenmill.lora.adapter.load_adapter` against the *full* architecture
            (global layer indices; ``a`` ``[r, in]``, scaled ``b`` ``[out, r]``).
        lay: the rank's :class:`~tokenmill.distributed.layout.RankLayout`.

    Returns:
        a :class:`LoRAAdapter` with local layer indices (the stage's layers only) and contiguous
        shards: column targets ``b[first:end]``, row targets ``a[:, first:end]``.
    """
    ranges = target_ranges(lay)
    first_layer, end_layer = lay.layers
    out = LoRAAdapter(path=adapter.path, rank=0, base_model_name=adapter.base_model_name)
    for (layer, mod), w in adapter.modules.items():
        if not first_layer <= layer < end_layer:
            continue
        lo, hi = ranges[mod]
        if mod in ROW_TARGETS:
            a, b = w.a[:, lo:hi].contiguous(), w.b
        else:
            a, b = w.a, w.b[lo:hi].contiguous()
        out.modules[(layer - first_layer, mod)] = LoRAWeights(a=a, b=b, scale=w.scale)
        out.rank = max(out.rank, w.rank)
    return out


def supported_targets(arch: Any) -> set[str]:
    """The PEFT targets every layer of ``arch`` has: all seven for a dense model; attention only for a
    mixture of experts (its experts have no ``gate_up_proj`` / ``down_proj`` the adapter could wrap)."""
    attn = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if getattr(arch, "is_moe", False) and getattr(arch, "moe_layer_mask", None) is None:
        return attn
    return attn | {"gate_proj", "up_proj", "down_proj"}


class WorkerLoRAProxy:
    """The engine core's adapter manager when the workers hold the model (see the module docstring).

    Args:
        arch: the full model's architecture (validation).
        max_rank: ``--max-lora-rank``.
        max_cpu_loras: adapters kept loaded in the workers (LRU beyond it, never one a queued or
            running request needs).
        send: ``send(op)`` delivers ``("load", LoRARequest)`` or ``("remove", lora_int_id)`` to every
            worker, ordered with the steps (the executor's ``lora_control``).

    Attributes:
        cpu: ``lora_int_id`` -> the validated adapter's metadata (no tensors), LRU order.
        pinned: adapters of queued or running requests (set by the core's housekeeping).
        num_loads: validations finished (tests count reloads).
    """

    def __init__(self, arch: Any, max_rank: int, max_cpu_loras: int, send: Callable[[tuple], None]) -> None:
        self.arch, self.max_rank = arch, max_rank
        self.max_cpu_loras = max_cpu_loras
        self.supported = supported_targets(arch)
        self._to_workers = send
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-lora-check")
        self._loading: dict[int, Future] = {}
        self._errors: dict[int, str] = {}
        self.pinned: set[int] = set()
        self.num_loads = 0
        self.mode = "auto"

    def _validate(self, req: Any) -> LoRAAdapter:
        """Load and check ``req``'s folder against the full architecture; keep only its metadata."""
        import torch

        adapter = load_adapter(req.lora_path, self.arch, self.max_rank, torch.float32)
        lacking = sorted({mod for _, mod in adapter.modules} - self.supported)
        if lacking:
            raise LoRAAdapterError(f"{req.lora_path}: targets {lacking} do not exist in this base model "
                                   f"(its layers have {sorted(self.supported)})")
        return LoRAAdapter(path=adapter.path, rank=adapter.rank, base_model_name=adapter.base_model_name)

    def load_now(self, req: Any) -> LoRAAdapter:
        """Validate ``req`` on the calling thread and have the workers load it (start-up's ``--lora-modules``).

        Raises:
            LoRAAdapterError: the adapter is invalid (the message names the file).
        """
        lid = req.lora_int_id
        if lid in self.cpu:
            self.cpu.move_to_end(lid)
            return self.cpu[lid]
        meta = self._validate(req)
        self._to_workers(("load", req))
        self._insert(lid, meta)
        return meta

    def load_async(self, req: Any) -> Future:
        """Start validating ``req`` (the workers start loading it at once; a failed check removes it there)."""
        lid = req.lora_int_id
        fut = self._loading.get(lid)
        if fut is not None:
            return fut
        if lid in self.cpu:
            fut = Future()
            fut.set_result(self.cpu[lid])
            return fut
        self._to_workers(("load", req))
        fut = self._pool.submit(self._validate, req)
        self._loading[lid] = fut
        return fut

    def _insert(self, lid: int, meta: LoRAAdapter) -> None:
        self.cpu[lid] = meta
        self.cpu.move_to_end(lid)
        self.num_loads += 1
        for old in list(self.cpu):
            if len(self.cpu) <= self.max_cpu_loras:
                break
            if old in self.pinned or old == lid:
                continue
            del self.cpu[old]
            self._to_workers(("remove", old))
            logger.info("LoRA: adapter %d dropped from the workers' memory (--max-cpu-loras %d)", old,
                        self.max_cpu_loras)

    def poll(self) -> list[tuple[int, str | None]]:
        """Collect finished validations (see :meth:`LoRAManager.poll <tokenmill.lora.manager.LoRAManager.poll>`)."""
        done = []
        for lid, fut in list(self._loading.items()):
            if not fut.done():
                continue
            del self._loading[lid]
            try:
                self._insert(lid, fut.result())
                self._errors.pop(lid, None)
                done.append((lid, None))
            except Exception as e:  # noqa: BLE001 - a bad adapter fails its requests, not the engine
                msg = str(e) if isinstance(e, LoRAAdapterError) else f"{type(e).__name__}: {e}"
                self._errors[lid] = msg
                self._to_workers(("remove", lid))
                done.append((lid, msg))
        return done

    @property
    def busy(self) -> bool:
        return bool(self._loading)

    def ensure(self, req: Any) -> tuple[bool, str | None]:
        """As :meth:`LoRAManager.ensure <tokenmill.lora.manager.LoRAManager.ensure>`: resident means validated
        and sent to the workers."""
        lid = req.lora_int_id
        if lid in self.cpu:
            self.cpu.move_to_end(lid)
            return True, None
        self.poll()
        if lid in self.cpu:
            return True, None
        err = self._errors.pop(lid, None)
        if err is not None:
            return False, err
        self.load_async(req)
        return False, None

    def remove(self, lid: int) -> None:
        """Forget adapter ``lid`` here and in every worker (after an unload with no request of it left)."""
        self.cpu.pop(lid, None)
        self._errors.pop(lid, None)
        self._to_workers(("remove", lid))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_worker_op(manager: Any, op: tuple) -> None:
    """A worker's side of :class:`WorkerLoRAProxy`'s messages, on its :class:`~tokenmill.lora.manager.LoRAManager`.

    Raises:
        ValueError: an unknown op.
    """
    kind, arg = op
    if kind == "load":
        manager.load_async(arg)
    elif kind == "remove":
        manager.remove(arg)
    else:
        raise ValueError(f"unknown LoRA op {kind!r}")
