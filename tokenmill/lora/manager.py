"""The model runner's adapter manager: a CPU cache of loaded adapters (LRU), the step's slots, async loads.

Two tiers, as in vLLM's LoRA manager (and S-LoRA's unified memory pool, arXiv 2311.03285 §4,
in spirit):

* **CPU cache** — up to ``--max-cpu-loras`` validated adapters in memory
  (:class:`~tokenmill.lora.adapter.LoRAAdapter`, in the model dtype, scale folded in). Beyond it
  the least recently used one not needed by a queued or running request is dropped; a later
  request of it reloads it from its folder.
* **slots** — ``--max-loras`` places in every :class:`~tokenmill.model.layers.lora.LoRALinear`'s
  stacked A/B buffers. A step's adapters must all sit in slots (the scheduler puts at most
  ``--max-loras`` distinct adapters in a step); an adapter entering takes a free slot or the
  least recently used slot the step does not need (a copy of its matrices, no disk I/O).

Loads from disk (safetensors read, validation, dtype conversion) run on one background thread,
so the engine loop keeps stepping while an adapter loads: the scheduler asks :meth:`ensure`
whether a waiting request's adapter is resident, which starts the load and answers "not yet".
Thread safety: the loader thread only builds :class:`LoRAAdapter` objects; everything else runs
on the engine thread.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from tokenmill.lora.adapter import TARGETS, LoRAAdapter, LoRAAdapterError, load_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.model.layers.lora import LoRABatch, inject_lora, lora_layers

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters for one model runner.

    Args:
        model: a Llama-family model (its layers get wrapped by :func:`inject_lora`).
        arch: the model's :class:`~tokenmill.model.arch_config.ModelArchConfig`.
        max_loras: slots (distinct adapters in one step).
        max_rank: ``--max-lora-rank``.
        max_cpu_loras: adapters kept in CPU memory (``>= max_loras``).
        dtype: the model dtype.
        layout: on a tensor/pipeline-parallel worker, its
            :class:`~tokenmill.distributed.layout.RankLayout`: ``arch`` is then the *full* model's
            architecture (adapters are validated against it) and each loaded adapter is cut to the
            rank's shard (:func:`tokenmill.lora.tp.shard_adapter`). None: one process.

    Attributes:
        slot_bytes: bytes of all slot buffers (counted against the KV budget by the runner).
        batch: the :class:`LoRABatch` every wrapped layer reads.
        mode: ``auto`` / ``stacked`` / ``segmented`` / ``loop`` (the delta's form, see
            :mod:`tokenmill.model.layers.lora`; benchmarks set it).
    """

    def __init__(self, model: torch.nn.Module, arch, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, layout=None) -> None:
        self.arch, self.dtype, self.layout = arch, dtype, layout
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.batch, self.slot_bytes = inject_lora(model, max_loras, max_rank, dtype)
        self.layers = lora_layers(model)
        self.by_module = {(i, name): mod for i, name, mod in self.layers}
        # which PEFT targets each layer can take (an MoE block has no gate/up/down here)
        fused = {name for _, name, _ in self.layers}
        self.supported = {t for t, (_, f, _) in TARGETS.items() if f in fused}
        self.mode = "auto"
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()   # lora_int_id -> adapter, LRU order
        self.slots: list[int | None] = [None] * max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict()      # slot order of last use
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-lora-load")
        self._loading: dict[int, Future] = {}
        self._errors: dict[int, str] = {}
        self.pinned: set[int] = set()   # adapters queued or running (never evicted from the CPU cache)
        self.num_loads = 0
        logger.info("LoRA: %d slots of rank <= %d on %d linear layers (%.1f MiB), up to %d adapters in CPU memory",
                    max_loras, max_rank, len(self.layers), self.slot_bytes / 2**20, self.max_cpu_loras)

    # -- loading ----------------------------------------------------------------
    def _load(self, req: LoRARequest) -> LoRAAdapter:
        adapter = load_adapter(req.lora_path, self.arch, self.max_rank, self.dtype)
        if self.layout is not None:
            from tokenmill.lora.tp import shard_adapter

            adapter = shard_adapter(adapter, self.layout)
        lacking = sorted({mod for _, mod in adapter.modules} - self.supported)
        if lacking:
            raise LoRAAdapterError(f"{req.lora_path}: targets {lacking} do not exist in this base model "
                                   f"(its layers have {sorted(self.supported)})")
        return adapter

    def load_now(self, req: LoRARequest) -> LoRAAdapter:
        """Load (or return the cached) adapter on the calling thread; it enters the CPU cache.

        Raises:
            LoRAAdapterError: the adapter is invalid (message names the file).
        """
        if req.lora_int_id in self.cpu:
            self.cpu.move_to_end(req.lora_int_id)
            return self.cpu[req.lora_int_id]
        adapter = self._load(req)
        self._insert(req.lora_int_id, adapter)
        return adapter

    def load_async(self, req: LoRARequest) -> Future:
        """Start loading ``req`` on the loader thread (no-op when resident or already loading).

        Returns:
            a future resolving to the :class:`LoRAAdapter` (or raising :class:`LoRAAdapterError`).
        """
        lid = req.lora_int_id
        fut = self._loading.get(lid)
        if fut is not None:
            return fut
        if lid in self.cpu:
            fut = Future()
            fut.set_result(self.cpu[lid])
            return fut
        fut = self._pool.submit(self._load, req)
        self._loading[lid] = fut
        return fut

    def _insert(self, lid: int, adapter: LoRAAdapter) -> None:
        self.cpu[lid] = adapter
        self.cpu.move_to_end(lid)
        self.num_loads += 1
        self._evict_cpu()

    def _evict_cpu(self) -> None:
        """Drop least recently used adapters beyond ``max_cpu_loras`` (never pinned or slotted ones)."""
        in_slots = {s for s in self.slots if s is not None}
        for lid in list(self.cpu):
            if len(self.cpu) <= self.max_cpu_loras:
                break
            if lid in self.pinned or lid in in_slots:
                continue
            del self.cpu[lid]
            logger.info("LoRA: adapter %d dropped from CPU memory (--max-cpu-loras %d)", lid, self.max_cpu_loras)

    def poll(self) -> list[tuple[int, str | None]]:
        """Collect finished background loads into the CPU cache (engine thread).

        Returns:
            ``(lora_int_id, error message or None)`` per load finished since the last call.
        """
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
                done.append((lid, msg))
        return done

    @property
    def busy(self) -> bool:
        """A background load is running."""
        return bool(self._loading)

    def ensure(self, req: LoRARequest) -> tuple[bool, str | None]:
        """Is ``req``'s adapter resident? Starts a background load when not.

        Returns:
            ``(True, None)`` resident; ``(False, None)`` loading; ``(False, message)`` it failed
            to load (the caller fails the request with the message).
        """
        lid = req.lora_int_id
        if lid in self.cpu:
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
        """Forget adapter ``lid`` (after an unload with no request of it left): CPU cache and slot."""
        self.cpu.pop(lid, None)
        self._errors.pop(lid, None)
        self._loading.pop(lid, None)     # a load still running is not collected into the cache
        for s, held in enumerate(self.slots):
            if held == lid:
                self.slots[s] = None
                self._slot_lru.pop(s, None)

    # -- the step ----------------------------------------------------------------
    def _slot_for(self, req: LoRARequest, needed: set[int]) -> int:
        """The slot holding ``req``'s adapter, copying it into one first if needed."""
        lid = req.lora_int_id
        if lid in self.slots:
            s = self.slots.index(lid)
            self._slot_lru.pop(s, None)
            self._slot_lru[s] = None
            return s
        adapter = self.cpu.get(lid)
        if adapter is None and lid in self._loading:   # a worker told to load it: wait for that load
            self._loading[lid].exception()
            self.poll()
            adapter = self.cpu.get(lid)
        if adapter is None:     # not resident (e.g. evicted between scheduling and now): load here
            logger.warning("LoRA: adapter %s (%d) loaded on the step's path", req.lora_name, lid)
            adapter = self.load_now(req)
        else:
            self.cpu.move_to_end(lid)
        free = [s for s, held in enumerate(self.slots) if held is None]
        if free:
            s = free[0]
        else:
            cands = [s for s in self._slot_lru if self.slots[s] not in needed]
            if not cands:
                raise RuntimeError(f"LoRA: more than --max-loras {self.max_loras} adapters in one step")
            s = cands[0]
        for (i, name), mod in self.by_module.items():
            weights = {t: (w.a, w.b) for t, _, _ in mod.slices
                       if (w := adapter.modules.get((i, t))) is not None}
            mod.set_slot(s, weights)
        self.slots[s] = lid
        self._slot_lru.pop(s, None)
        self._slot_lru[s] = None
        return s

    def set_batch(self, lora_requests: list, query_lens: np.ndarray, num_rows: int) -> None:
        """Fill :attr:`batch` for a step (every wrapped layer reads it during the forward).

        Args:
            lora_requests: per scheduled request (batch order) its :class:`LoRARequest` or None (base).
            query_lens: ``[num_reqs]`` rows of each request in the flattened batch.
            num_rows: rows of the (padded) batch.

        Raises:
            RuntimeError: more distinct adapters than slots (a scheduler bug).
            LoRAAdapterError: an adapter that had to be loaded here is invalid.
        """
        b = self.batch
        b.mode = self.mode
        if not any(r is not None for r in lora_requests):
            b.active = False
            return
        needed = {r.lora_int_id for r in lora_requests if r is not None}
        slot_of: dict[int, int] = {}
        for r in lora_requests:
            if r is not None and r.lora_int_id not in slot_of:
                slot_of[r.lora_int_id] = self._slot_for(r, needed)
        slots = np.array([slot_of[r.lora_int_id] if r is not None else -1 for r in lora_requests], dtype=np.int64)
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        b.req_runs = [(int(s0), int(e0), int(sl)) for s0, e0, sl in zip(starts, ends, slots) if sl >= 0 and e0 > s0]
        runs: list[tuple[int, int, int]] = []
        for s0, e0, sl in b.req_runs:
            if runs and runs[-1][1] == s0 and runs[-1][2] == sl:
                runs[-1] = (runs[-1][0], e0, sl)
            else:
                runs.append((s0, e0, sl))
        b.runs = runs
        b.num_slots = int(slots.max()) + 1
        row_slot = np.full(num_rows, -1, dtype=np.int64)
        row_slot[:int(ends[-1])] = np.repeat(slots, query_lens)
        mask = (row_slot[:, None] == np.arange(b.num_slots)[None, :])
        b.mask = torch.from_numpy(mask).to(self.dtype).unsqueeze(-1)
        b.active = True

    def clear_batch(self) -> None:
        """No adapter rows (after a step; the layers add nothing until the next :meth:`set_batch`)."""
        self.batch.active = False

    @property
    def cpu_bytes(self) -> int:
        """Bytes of the adapters in the CPU cache."""
        return sum(a.nbytes for a in self.cpu.values())

    def shutdown(self) -> None:
        """Stop the loader thread (pending loads are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
