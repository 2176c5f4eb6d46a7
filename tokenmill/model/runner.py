"""Model runner: turns a :class:`SchedulerOutput` into one flattened forward pass.

All scheduled tokens of all requests (prefill chunks and decode tokens) run in
one batch ``[num_tokens, hidden_size]``; the slot mapping tells attention where
each new token's K/V goes and the block tables where each request's context
lives (PagedAttention, arXiv 2309.06180 §4.1).

Inputs live in persistent, preallocated buffers (:class:`InputBuffers`) that
are filled with numpy from the scheduler's per-request lists each step; there
is no Python loop per request per layer and no per-step allocation of input
tensors.

Compiled step (``enforce_eager=False``): the dense parts of every decoder
block (norm, fused q/k/v GEMM, RoPE; o_proj, norm, SwiGLU MLP) are
``torch.compile``-d (Inductor) once for each of a fixed set of padded
token-count buckets and captured at start-up, the way vLLM captures CUDA
graphs; the paged attention between them stays eager (its per-request
planning would otherwise break the graph). A step is padded to the next
bucket; padding rows write their K/V to a scratch block that no request owns
(the pool has ``num_kv_blocks + 1`` blocks, the last one never handed to the
scheduler) and their output rows are dropped. Steps larger than the largest
bucket run eagerly. Measured on the 2-core CPU (``benchmarks/roofline.py
--compile``, eager and compiled timed in one run): no gain at any size (the
step is GEMM- and attention-bound, Inductor fuses only the cheap elementwise
ops) and 45-60 s to capture five buckets, so eager stays the default. On CUDA
the same hook is where CUDA graphs (``mode="reduce-overhead"``) would go.
"""

from __future__ import annotations

import bisect
import logging
import time
from itertools import chain

import numpy as np
import torch

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.cpu_facts import engine_plan
from tokenmill.model.layers.cpu_build import configure as configure_kernels
from tokenmill.model.layers.linear import PackedLinear, attach_lowbit_weights, pack_linear_weights
from tokenmill.model.layers.kv_quant import KVScales, is_quantized, resolve_kv_cache_dtype
from tokenmill.model.kv_cache import allocate_kv_caches, kv_bytes_per_token, plan_kv_cache  # noqa: F401 - re-export
from tokenmill.model.process_tuning import configure_allocator, configure_threads, rss_bytes
from tokenmill.model.sampler import Sampler
from tokenmill.quantization.methods import Int8DynamicLinear, QuantizedLinear, format_bytes, weight_bytes_by_format
from tokenmill.model.layers import cpu_build, fused_cpu, paged_attention_cpu
from tokenmill.lora.manager import LoRAManager
from tokenmill.spec_decode.worker import SpecDecodeWorker
from tokenmill.model.step_graph import CpuStepGraph, unsupported_reason
from tokenmill.model.loader import load_model, resolve_dtype
from tokenmill.model import llama

logger = logging.getLogger(__name__)

DEFAULT_COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def resolve_device(device: str) -> torch.device:
    """``"auto"`` → cuda when available, else cpu; anything else as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def log_compute_paths(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                      lowbit_max_tokens: int) -> None:
    """Log, at start-up, which ISA path, dtype and weight format each part of the step uses."""
    def name(dt: torch.dtype) -> str:
        return str(dt).replace("torch.", "")
    packed = sum(1 for m in model.modules() if isinstance(m, PackedLinear))
    plain = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    weights = f"weights {name(dtype)} ({packed} oneDNN-prepacked linears, {plain} plain"
    quant: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            key = f"{m.weight_codes.fmt} low-bit kernel"
        elif isinstance(m, Int8DynamicLinear):
            key = "w8a8 int8 GEMM"
        else:
            continue
        quant[key] = quant.get(key, 0) + 1
    weights += "".join(f", {n} {k}" for k, n in sorted(quant.items())) + ")"
    if lowbit_max_tokens:
        weights += f", the GGUF's low-bit codes for steps <= {lowbit_max_tokens} tokens"
        i8 = max((m.lowbit_i8_max_rows for m in model.modules() if isinstance(m, PackedLinear)), default=0)
        if any(getattr(m, "lowbit_invariant", False) for m in model.modules() if isinstance(m, PackedLinear)):
            weights += " and, batch-invariant, for every step size"
        elif i8:
            weights += (f" (float32 activations), int8 activations x the codes for steps of "
                        f"{lowbit_max_tokens + 1}..{min(i8, 1 << 20)} tokens")
    kv = name(kv_dtype)
    if kv_dtype == torch.bfloat16 and dtype == torch.float32:
        kv += " (float32 model: --kv-cache-dtype float32 keeps float32)"
    if device.type != "cpu":
        logger.info("compute paths: %s; attention torch (%s), KV cache %s", weights, device, kv)
        return
    try:
        isa = cpu_build.cpu_isa()
    except ValueError as e:
        isa = f"invalid ({e})"
    att = paged_attention_cpu.compiled_isa()
    fused = fused_cpu.load() is not None
    prefill = "kernel" if att and paged_attention_cpu.prefill_preferred() else "SDPA"
    logger.info("compute paths: CPU ISA %s; %s; attention %s (decode kernel, prefill %s), KV cache %s; "
                "fused norm/RoPE/SiLU %s", isa, weights, att or "torch (kernel unavailable)", prefill,
                kv, isa if fused else "torch (kernel unavailable)")


class InputBuffers:
    """Persistent step inputs, allocated once at their largest size.

    Each buffer is a host tensor with a numpy view over the same memory (the
    runner writes through the view); on CUDA the host tensors are pinned and
    mirrored by device tensors that each step fills with one non-blocking
    copy per buffer. On CPU the "device" tensors are the host tensors.

    Args:
        max_num_tokens: rows of the flattened batch (including bucket padding).
        max_num_reqs: requests per step.
        max_blocks_per_req: block-table width (``ceil(max_model_len / block_size)``).
        device: where the model runs.

    Attributes (host tensor / numpy view / device tensor for each):
        input_ids, positions, slot_mapping: ``[max_num_tokens]`` int64.
        query_start_loc: ``[max_num_reqs + 1]`` int32.
        seq_lens: ``[max_num_reqs]`` int32.
        logits_indices: ``[max_num_tokens]`` int64 (one row per sampling
            request, plus one per draft token with speculative decoding).
        block_tables: ``[max_num_reqs, max_blocks_per_req]`` int32; rows
            beyond a request's own blocks hold stale ids (always valid block
            ids; attention masks them out by ``seq_lens``).
    """

    _SPECS = {"input_ids": (torch.int64, "tokens"), "positions": (torch.int64, "tokens"),
              "slot_mapping": (torch.int64, "tokens"), "query_start_loc": (torch.int32, "reqs+1"),
              "seq_lens": (torch.int32, "reqs"), "logits_indices": (torch.int64, "tokens"),
              "block_tables": (torch.int32, "table")}

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        self.max_num_tokens, self.max_num_reqs, self.max_blocks_per_req = max_num_tokens, max_num_reqs, max_blocks_per_req
        self.device = device
        pin = device.type == "cuda"
        shapes = {"tokens": (max_num_tokens,), "reqs": (max_num_reqs,), "reqs+1": (max_num_reqs + 1,),
                  "table": (max_num_reqs, max_blocks_per_req)}
        self.host: dict[str, torch.Tensor] = {}
        self.np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, (dtype, kind) in self._SPECS.items():
            t = torch.zeros(shapes[kind], dtype=dtype, pin_memory=pin)
            self.host[name], self.np[name] = t, t.numpy()
            self.dev[name] = t if device.type == "cpu" else torch.zeros(shapes[kind], dtype=dtype, device=device)

    def fits(self, num_tokens: int, num_reqs: int, num_blocks: int) -> bool:
        """True when a step of this size fits without growing."""
        return (num_tokens <= self.max_num_tokens and num_reqs <= self.max_num_reqs
                and num_blocks <= self.max_blocks_per_req)

    def to_device(self, name: str, n: int, cols: int | None = None) -> torch.Tensor:
        """The first ``n`` rows (and ``cols`` columns for the block table) of buffer ``name`` on the device."""
        if cols is None:
            if self.device.type != "cpu":
                self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)
            return self.dev[name][:n]
        if self.device.type != "cpu":
            self.dev[name][:n, :cols].copy_(self.host[name][:n, :cols], non_blocking=True)
        return self.dev[name][:n, :cols]


class ModelRunner:
    """Owns the model, the KV cache pool, the persistent input buffers and the sampler.

    Args:
        model: a decoder with ``forward(input_ids, positions, kv_caches, attn_metadata)``
            and ``compute_logits(hidden)`` (see :mod:`tokenmill.model.llama`);
            ``set_dense_fns`` is needed for the compiled step.
        arch: the model's :class:`~tokenmill.model.loader.ModelArchConfig`.
        config: engine config (block size, pool size, max_model_len, seed,
            ``enforce_eager``, compile buckets).
        device: torch device of the model and cache.
        dtype: the model's dtype (the KV cache's too, unless ``--kv-cache-dtype`` or the CPU
            low-bit path's bfloat16 default says otherwise; see ``kv_cache_dtype``).
        eos_token_ids: the model's end-of-sequence ids.
        lora_shard: on a tensor/pipeline-parallel worker with ``--enable-lora``, ``(full arch, RankLayout)``:
            adapters are validated against the full model and cut to the rank's shard (:mod:`tokenmill.lora.tp`).

    Attributes:
        kv_caches: per layer ``[2, num_kv_blocks + 1, block_size, num_kv_heads, head_dim]``;
            the last block is the scratch block padding rows write to.
        num_kv_blocks: blocks the scheduler may hand out (ids ``0 .. num_kv_blocks - 1``).
        scratch_block: id of the scratch block (``num_kv_blocks``).
        max_model_len: context limit in tokens.
        compile_buckets: padded token counts with a compiled step (empty when eager).
        lowbit_max_tokens: steps of at most this many tokens run their
            linears (and the logits head) on the GGUF's own low-bit codes
            (CPU, eager; see :meth:`PackedLinear.attach_lowbit`); 0 when off.
        last_timings: seconds of the last step's parts (``prepare``, ``forward``, ``sample``; ``propose``
            with speculative decoding: drafts for the next step; ``grammar_mask`` with structured outputs:
            waiting for the step's bitmask and applying it).
    """

    def __init__(self, model: torch.nn.Module, arch, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: list[int],
                 lowbit_weights: dict | None = None, lora_shard: tuple | None = None) -> None:
        self.model = model
        self.arch = arch
        self.config = config
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = list(eos_token_ids)
        self.block_size = config.cache.block_size
        model_len = arch.max_position_embeddings
        self.max_model_len = int(config.model.max_model_len or model_len)
        if self.max_model_len > model_len:
            logger.warning("max_model_len %d exceeds the model's context length %d", self.max_model_len, model_len)
        # the CPU kernel choices, resolved once from the config's switches and this machine (logged below)
        self.kernel_plan = engine_plan(config, device, checkpoint_lowbit=bool(lowbit_weights))
        if self.kernel_plan.dtype != str(dtype).removeprefix("torch."):   # a caller's explicit dtype wins
            self.kernel_plan = engine_plan(config.replace(dtype=str(dtype).removeprefix("torch.")), device,
                                           checkpoint_lowbit=bool(lowbit_weights))
        plan = self.kernel_plan
        if device.type == "cpu":
            configure_kernels(plan.isa, config.cpu_kernels)   # this process's C kernels follow the config
        lowbit_limit = plan.lowbit_max_tokens
        # auto: a float32 model on the CPU low-bit path keeps a bfloat16 cache (kv_quant.auto_kv_bf16)
        self.kv_cache_dtype = resolve_kv_cache_dtype(plan.kv_cache_dtype, dtype, device)
        if config.cache.kv_cache_dtype == "auto" and self.kv_cache_dtype != dtype:
            logger.info("--kv-cache-dtype auto: bfloat16 KV cache for this float32 model on the CPU low-bit path "
                        "(unlike vLLM, whose auto is the model's dtype: half the bytes a decode step reads, twice "
                        "the tokens in the pool); --kv-cache-dtype float32 or TOKENMILL_CPU_KV_BF16=0 keeps float32")
        self.kv_layout = plan_kv_cache(config.cache, arch, self.kv_cache_dtype, self.max_model_len)
        self.bytes_per_token = self.kv_layout.bytes_per_token
        self.num_kv_blocks = self.kv_layout.num_blocks
        self.scratch_block = self.num_kv_blocks
        self.kv_caches = allocate_kv_caches(self.kv_layout, device)
        blocks_per_seq = self.kv_layout.blocks_per_seq
        self.sampler = Sampler(seed=config.model.seed, device=device, logprobs_mode=config.model.logprobs_mode)
        self.compile_buckets: list[int] = []
        self.last_timings: dict[str, float] = {}
        sched = config.scheduler
        self.buffers = InputBuffers(max(sched.max_num_batched_tokens, sched.max_num_seqs),
                                    sched.max_num_seqs, blocks_per_seq, device)
        # eager: the oneDNN packing runs in a background thread (start-up does not wait for it; a layer needed
        # packed earlier is packed on the spot); TOKENMILL_CPU_PACK_BACKGROUND=0 packs before the runner is ready
        background = config.model.enforce_eager and envs.TOKENMILL_CPU_PACK_BACKGROUND
        self.num_packed_linear = pack_linear_weights(model, include_layers=config.model.enforce_eager,
                                                     background=background)
        self.lowbit_max_tokens = 0
        # --batch-invariant (default): one kernel per linear and per attention row at every step size
        self.batch_invariant = bool(getattr(config.model, "batch_invariant", False))
        backend = getattr(model, "attn_backend", None)
        if hasattr(backend, "batch_invariant"):
            backend.batch_invariant = self.batch_invariant
        if lowbit_limit and attach_lowbit_weights(model, lowbit_weights, lowbit_limit, plan.int8_act_max_tokens,
                                                  invariant=self.batch_invariant,
                                                  invariant_kernel=config.cpu_kernels.invariant_kernel)[0]:
            self.lowbit_max_tokens = lowbit_limit

        self.weight_bytes = weight_bytes_by_format(model)
        logger.info("weights: %s (total %.1f MiB)", format_bytes(self.weight_bytes),
                    sum(self.weight_bytes.values()) / 2**20)
        if not config.model.enforce_eager:
            self.capture(parse_buckets(config.model.compile_sizes, sched.max_num_batched_tokens))
        self._setup_kv_scales(config.cache.calculate_kv_scales)   # after capture: its warm-up steps are no batch
        logger.info("%s", plan.describe())
        log_compute_paths(model, device, dtype, self.kv_cache_dtype, self.lowbit_max_tokens)
        self.lora_manager = None   # a tokenmill.lora.manager.LoRAManager with --enable-lora
        if config.model.enable_lora:
            m = config.model
            # lora_shard: a tensor/pipeline-parallel worker's (full arch, RankLayout): adapters are validated
            # against the full model and cut to the rank's shard; the engine core's proxy owns the CPU LRU
            full_arch, layout = lora_shard or (arch, None)
            cpu_loras = (m.max_cpu_loras or m.max_loras) if layout is None else 1 << 30
            self.lora_manager = LoRAManager(model, full_arch, m.max_loras, m.max_lora_rank, cpu_loras, dtype,
                                            layout=layout, invariant=self.batch_invariant)
        self.step_graph = None   # a CpuStepGraph for decode and verify steps (set below when the model allows)
        self.eplb = None    # an EplbController (tokenmill.distributed.eplb) with --enable-eplb, set by the builder
        self.spec_decode = None
        # grammar-forced tokens (structured outputs) are verified as drafts even without a proposer
        if config.speculative is not None or config.model.structured_outputs.num_forced_draft_tokens:
            self.spec_decode = SpecDecodeWorker(config.speculative, config, self)
        self._setup_step_graph()

    def _setup_step_graph(self) -> None:
        """Build the :class:`~tokenmill.model.step_graph.CpuStepGraph` for decode and verify steps where the
        model, dtype, KV cache and device allow it (logged either way; ``TOKENMILL_CPU_STEP_GRAPH=0``: off)."""
        reason = unsupported_reason(self.model, self.device, self.dtype, self.kv_cache_dtype, self.lowbit_max_tokens,
                                    enabled=self.kernel_plan.step_graph)
        if reason is None and not self.config.model.enforce_eager:
            reason = "compiled step"
        if reason is not None:
            logger.info("CPU step graph off: %s", reason)
            return
        # every decode-only step up to max_num_seqs requests (TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS caps it)
        self.step_graph = CpuStepGraph(self.model, self.kv_caches, self.lowbit_max_tokens,
                                       self.kernel_plan.step_graph_max_tokens)

    def _setup_kv_scales(self, calculate: bool) -> None:
        """Per-layer K/V scales of a quantised cache: checkpoint values, else computed from the first batch
        (``--calculate-kv-scales``; always for int8, whose default 1.0 would round K/V to integers), else 1.0."""
        if not is_quantized(self.kv_cache_dtype):
            return
        scales = [m.kv_scales for m in self.model.modules() if isinstance(getattr(m, "kv_scales", None), KVScales)]
        from_ckpt = bool(scales) and all(sc.source == "checkpoint" for sc in scales)
        auto = self.kv_cache_dtype == torch.int8 and not from_ckpt and not calculate
        for sc in scales:
            if calculate or (auto and sc.source != "checkpoint"):
                sc.calculate = True
        ckpt = [sc for sc in scales if sc.source == "checkpoint"]
        if calculate or auto:
            how = "calculated from the first batch" + (" (int8 always is, unless the checkpoint has scales)"
                                                       if auto else "")
        elif ckpt:
            how = (f"from the checkpoint{'' if from_ckpt else f' for {len(ckpt)} layers, 1.0 for the others'} "
                   f"(K {min(sc.k for sc in ckpt):.4g}-{max(sc.k for sc in ckpt):.4g}, "
                   f"V {min(sc.v for sc in ckpt):.4g}-{max(sc.v for sc in ckpt):.4g})")
        else:
            how = "1.0 (no checkpoint scales; --calculate-kv-scales computes them)"
        logger.info("KV cache scales (%d layers): %s", len(scales), how)

    @classmethod
    def from_config(cls, config: EngineConfig, with_tokenizer: bool | str = True) -> "ModelRunner":
        """Load the checkpoint named by ``config.model`` and build the runner.

        ``with_tokenizer`` is passed to :func:`~tokenmill.model.loader.load_model`
        (``"eos"``: only when the checkpoint lacks an EOS id); the loaded
        checkpoint is kept as ``runner.loaded``.

        Raises:
            FileNotFoundError, ValueError: from the loader (missing file,
                unsupported architecture or dtype).
        """
        device = resolve_device(config.model.device)
        configure_threads(device)
        configure_allocator(device)
        t0 = time.perf_counter()
        # the kernel plan if the checkpoint has low-bit codes (the runner resolves the final one): the dtype,
        # the ISA variant of this process's kernels and whether to collect the codes
        plan = engine_plan(config, device, checkpoint_lowbit=True)
        if device.type == "cpu":
            configure_kernels(plan.isa, config.cpu_kernels)   # where the config differs from the environment
        dtype = resolve_dtype(plan.dtype, device)
        want_lowbit = plan.lowbit_max_tokens > 0
        loaded = load_model(config.model.model, dtype=dtype, device=device, lowbit=want_lowbit,
                            quantization=config.model.quantization,
                            num_redundant_experts=config.parallel.eplb.num_redundant_experts,
                            weight_cache=config.model.weight_cache, cpu_kernels=config.cpu_kernels,
                            with_tokenizer=with_tokenizer)
        logger.info("loaded %s (%s) in %.1f s on %s", loaded.name, loaded.arch.architecture,
                    time.perf_counter() - t0, device)
        from tokenmill.distributed.eplb import build_controller, check_eplb_startup

        check_eplb_startup(config.parallel, loaded.arch)
        runner = cls(loaded.model, loaded.arch, config, device, dtype, loaded.eos_token_ids,
                     lowbit_weights=loaded.lowbit_weights)
        runner.eplb = build_controller(config, loaded.model)
        loaded.lowbit_weights = None
        runner.loaded = loaded
        return runner

    # -- compiled step --------------------------------------------------------
    def capture(self, buckets: list[int]) -> None:
        """Compile the dense per-layer parts for each padded token count in ``buckets`` and run each once.

        Uses ``torch.compile`` (Inductor; on CPU it emits fused C++/OpenMP
        kernels around oneDNN/MKL GEMMs) with static shapes, so each bucket
        is its own graph, compiled here rather than on the first request.
        Logs the start-up time and the resident-memory growth.

        Raises:
            RuntimeError: the model has no ``set_dense_fns`` hook, or its
                decoder linears were already packed by an eager runner
                (Inductor cannot lower packed weights that are graph inputs).
        """
        if not hasattr(self.model, "set_dense_fns"):
            raise RuntimeError(f"{type(self.model).__name__} does not support the compiled step")
        if any(isinstance(m, PackedLinear) for m in self.model.model.modules()):
            raise RuntimeError("the model's decoder linears are oneDNN-packed (an eager runner packed them); "
                               "load a fresh model for the compiled step")
        if not buckets:
            return

        import torch._dynamo.config as dynamo_config

        # Two graphs per function and bucket (the first layer has no residual yet).
        need = 2 * len(buckets) + 2
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < need:
                setattr(dynamo_config, name, need)
        rss0, t0 = rss_bytes(), time.perf_counter()
        self.model.set_dense_fns(torch.compile(llama.pre_attention, dynamic=False),
                                 torch.compile(llama.post_attention, dynamic=False))
        self.compile_buckets = sorted(set(buckets))
        for n in self.compile_buckets:
            self._warmup_step(n)
        logger.info("compiled step: %d token buckets %s in %.1f s, resident memory +%.0f MiB",
                    len(self.compile_buckets), self.compile_buckets, time.perf_counter() - t0,
                    (rss_bytes() - rss0) / 2**20)

    @torch.inference_mode()
    def _warmup_step(self, num_tokens: int) -> None:
        """One forward of ``num_tokens`` padding rows (a one-token request on the scratch block)."""
        buf, dev = self.buffers, self.device
        self._ensure_buffers(num_tokens, 1, 1)
        buf.np["input_ids"][:num_tokens] = 0
        buf.np["positions"][:num_tokens] = 0
        buf.np["slot_mapping"][:num_tokens] = self.scratch_block * self.block_size
        buf.np["block_tables"][0, 0] = self.scratch_block
        md = AttentionMetadata(
            slot_mapping=buf.to_device("slot_mapping", num_tokens),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([1], dtype=torch.int32, device=dev),
            block_tables=buf.to_device("block_tables", 1, 1), query_lens=[1], seq_lens_list=[1],
            max_query_len=1, max_seq_len=1, block_size=self.block_size)
        self.model(buf.to_device("input_ids", num_tokens), buf.to_device("positions", num_tokens),
                   self.kv_caches, md)

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The bucket a step of ``num_tokens`` runs at (itself when eager or above the largest bucket)."""
        i = bisect.bisect_left(self.compile_buckets, num_tokens)
        return self.compile_buckets[i] if i < len(self.compile_buckets) else num_tokens

    # -- inputs ----------------------------------------------------------------
    def _ensure_buffers(self, num_tokens: int, num_reqs: int, num_blocks: int) -> None:
        buf = self.buffers
        if not buf.fits(num_tokens, num_reqs, num_blocks):
            self.buffers = InputBuffers(max(num_tokens, buf.max_num_tokens), max(num_reqs, buf.max_num_reqs),
                                        max(num_blocks, buf.max_blocks_per_req), self.device)

    def prepare_inputs(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Fill the persistent buffers with the step's requests and return views of them.

        The step is padded to :meth:`padded_num_tokens` rows: padding rows
        have token 0, position 0 and the scratch block's first slot.

        Returns:
            input_ids ``[padded_tokens]`` int64, positions ``[padded_tokens]``
            int64, attention metadata (covering the real requests; its
            ``slot_mapping`` is padded), and ``logits_indices`` (numpy,
            ``[num_sampling_rows]``): the row of each sampling request's last
            token, preceded by its draft rows when it has ``k`` drafts (its
            last ``k + 1`` rows).
            The tensors are views of buffers the next step overwrites.
        """
        reqs = so.scheduled
        n = len(reqs)
        bs = self.block_size
        query_lens = np.fromiter(map(len, (r.token_ids for r in reqs)), dtype=np.int64, count=n)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=n)
        nblocks = np.fromiter(map(len, (r.block_ids for r in reqs)), dtype=np.int64, count=n)
        num_tokens = int(query_lens.sum())
        padded = self.padded_num_tokens(num_tokens)
        max_blocks = int(nblocks.max())
        self._ensure_buffers(padded, n, max_blocks)
        buf = self.buffers.np

        qsl = buf["query_start_loc"][: n + 1]
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1:])
        seq_lens = starts + query_lens
        buf["seq_lens"][:n] = seq_lens
        # block tables: scatter every request's block ids into its row in one shot
        total_blocks = int(nblocks.sum())
        flat_blocks = np.fromiter(chain.from_iterable(r.block_ids for r in reqs), dtype=np.int32, count=total_blocks)
        row_of_block = np.repeat(np.arange(n), nblocks)
        first_of_row = np.cumsum(nblocks) - nblocks
        col_of_block = np.arange(total_blocks) - np.repeat(first_of_row, nblocks)
        bt = buf["block_tables"]
        bt[row_of_block, col_of_block] = flat_blocks
        # per-token arrays
        buf["input_ids"][:num_tokens] = np.fromiter(chain.from_iterable(r.token_ids for r in reqs),
                                                    dtype=np.int64, count=num_tokens)
        req_idx = np.repeat(np.arange(n), query_lens)
        positions = buf["positions"][:num_tokens]
        np.subtract(np.arange(num_tokens, dtype=np.int64), (qsl[:-1] - starts)[req_idx], out=positions)
        buf["slot_mapping"][:num_tokens] = bt[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
        if padded > num_tokens:
            buf["input_ids"][num_tokens:padded] = 0
            buf["positions"][num_tokens:padded] = 0
            buf["slot_mapping"][num_tokens:padded] = self.scratch_block * bs
        sample_mask = np.fromiter((r.sample for r in reqs), dtype=bool, count=n)
        logits_indices = (qsl[1:] - 1)[sample_mask]
        if self.spec_decode is not None:
            # k drafts: the last k + 1 rows of the request (its last real token, then each draft)
            nlog = np.fromiter((len(r.spec_token_ids) + 1 for r in reqs), dtype=np.int64, count=n)[sample_mask]
            if int(nlog.sum()) > len(nlog):
                first = np.repeat(logits_indices - nlog + 1, nlog)
                logits_indices = first + np.arange(int(nlog.sum())) - np.repeat(np.cumsum(nlog) - nlog, nlog)

        b = self.buffers
        md = AttentionMetadata(
            slot_mapping=b.to_device("slot_mapping", padded),
            query_start_loc=b.to_device("query_start_loc", n + 1),
            seq_lens=b.to_device("seq_lens", n),
            block_tables=b.to_device("block_tables", n, max_blocks),
            query_lens=query_lens.tolist(),
            seq_lens_list=seq_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
        )
        return b.to_device("input_ids", padded), b.to_device("positions", padded), md, logits_indices

    def release_requests(self, req_ids) -> None:
        """Drop per-request state of finished requests (called when a step had nothing to run)."""
        if self.spec_decode is not None:
            self.spec_decode.forget(req_ids)

    # -- the step ----------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward pass over every scheduled token and sample where asked.

        With ``--enable-eplb`` the step ends with the expert-load bookkeeping
        (:meth:`EplbController.after_step`): every ``step_interval`` steps it
        re-places the experts before the next step starts.

        Returns:
            one sampled token (and optional logprobs) per request whose
            ``sample`` flag is set, in batch order.
        """
        out = self._execute_model(so)
        if self.eplb is not None and not so.is_empty:
            self.eplb.after_step()
        return out

    @property
    def eplb_stats(self):
        """The EPLB state for metrics (:class:`~tokenmill.metrics.stats.EplbStats`; None without EPLB)."""
        return self.eplb.stats() if self.eplb is not None else None

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.is_empty:
            return ModelRunnerOutput()
        t0 = time.perf_counter()
        input_ids, positions, md, logits_indices = self.prepare_inputs(so)
        if self.lora_manager is not None:   # each row's adapter slot (the LoRA layers read it in the forward)
            self.lora_manager.set_batch([r.lora_request for r in so.scheduled],
                                        np.fromiter((len(r.token_ids) for r in so.scheduled), dtype=np.int64,
                                                    count=len(so.scheduled)), input_ids.shape[0])
        t1 = time.perf_counter()
        if so.grammar_bitmask is not None:      # structured outputs: the mask fills beside the forward
            so.grammar_bitmask.start()
        graph = self.step_graph
        if graph is not None and graph.accepts(md.num_tokens, md.max_query_len, input_ids.shape[0], md.query_lens,
                                               md.seq_lens_list):
            # decode steps, and verify steps (each request's last token + its drafts) as one row per token
            hidden = graph.run(input_ids, positions, md.slot_mapping, md.block_tables, md.seq_lens,
                               md.query_lens if md.max_query_len > 1 else None)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, md)
        if self.spec_decode is not None:
            self.spec_decode.after_forward(input_ids, positions, md)
        t2 = time.perf_counter()
        if hidden is None:      # a pipeline stage before the last one: its output went to the next stage
            self.last_timings = {"prepare": t1 - t0, "forward": t2 - t1, "sample": 0.0}
            return ModelRunnerOutput()
        sampling = [r for r in so.scheduled if r.sample]
        out = ModelRunnerOutput()
        mask_t = None
        if sampling:
            n = len(logits_indices)
            self.buffers.np["logits_indices"][:n] = logits_indices
            idx = self.buffers.to_device("logits_indices", n)
            logits = self.model.compute_logits(hidden.index_select(0, idx)).float()
            verify = self.spec_decode is not None and (self.config.speculative is not None
                                                       or any(r.spec_token_ids for r in sampling))
            deferred = None
            if so.grammar_bitmask is not None:      # structured outputs: disallowed tokens -> -inf
                t_mask = time.perf_counter()
                # greedy rows without logprobs (the sampler's argmax): a row that allows few tokens is not
                # written, the sampler takes the argmax over its allowed ids (same token, no [rows, V] write)
                defer = not verify and all(r.sampling_params.greedy and r.sampling_params.logprobs is None
                                           for r in sampling)
                deferred = so.grammar_bitmask.apply(logits, defer_sparse=defer)   # waits for the fill
                mask_t = time.perf_counter() - t_mask
            if verify:
                out = self.spec_decode.sample_and_verify(logits, sampling)
            else:
                token_ids, logprobs = (self.sampler(logits, sampling) if deferred is None
                                       else self.sampler(logits, sampling, deferred=deferred))
                out = ModelRunnerOutput(req_ids=[r.req_id for r in sampling], sampled_token_ids=token_ids,
                                        logprobs=logprobs)
        if any(r.prompt_logprobs is not None for r in so.scheduled):
            out.prompt_logprobs = self._prompt_logprobs(so, hidden)
        t3 = time.perf_counter()
        if self.spec_decode is not None:
            emitted = [out.verified_token_ids.get(r.req_id) or [t] for r, t in zip(sampling, out.sampled_token_ids)]
            out.draft_token_ids = self.spec_decode.propose(so, sampling, emitted)
        self.last_timings = {"prepare": t1 - t0, "forward": t2 - t1, "sample": t3 - t2}
        if mask_t is not None:
            self.last_timings["grammar_mask"] = mask_t
        if self.config.speculative is not None:
            self.last_timings["propose"] = time.perf_counter() - t3
        return out

    PROMPT_LOGPROBS_ROWS = 256  # logits rows per slice: 256 x vocab float32 (48 MiB at a 49k vocab)

    @torch.inference_mode()
    def _prompt_logprobs(self, so: SchedulerOutput, hidden: torch.Tensor) -> dict[str, tuple[int, list]]:
        """Logprobs of the prompt tokens each asking request's chunk predicts.

        Row ``r`` of a chunk (position ``p = num_computed_tokens + r``)
        predicts prompt token ``p + 1``; rows whose next token is not a
        prompt token (the last prompt position, decode rows) are skipped.
        The distribution is the model's raw softmax (no temperature or
        penalties), as vLLM reports prompt logprobs. Logits are computed in
        slices of :attr:`PROMPT_LOGPROBS_ROWS` rows to bound memory.

        Returns:
            req id -> ``(first prompt index predicted, [TokenLogprobs, ...])``.
        """
        result: dict[str, tuple[int, list]] = {}
        row = 0
        for r in so.scheduled:
            n, start = len(r.token_ids), r.num_computed_tokens
            if r.prompt_logprobs is not None:
                m = min(start + n, len(r.prompt_token_ids) - 1) - start  # rows whose next token is in the prompt
                entries: list = []
                for s0 in range(0, max(m, 0), self.PROMPT_LOGPROBS_ROWS):
                    s1 = min(m, s0 + self.PROMPT_LOGPROBS_ROWS)
                    logits = self.model.compute_logits(hidden[row + s0:row + s1]).float()
                    targets = torch.tensor(r.prompt_token_ids[start + 1 + s0:start + 1 + s1], device=logits.device)
                    entries += self.sampler.token_logprobs(logits, targets, r.prompt_logprobs)
                result[r.req_id] = (start + 1, entries)
            row += n
        return result


def parse_buckets(spec: str | None, max_num_batched_tokens: int) -> list[int]:
    """Token-count buckets of the compiled step.

    Args:
        spec: comma-separated sizes (``"1,2,4,8"``) or None for
            :data:`DEFAULT_COMPILE_BUCKETS`.
        max_num_batched_tokens: sizes above the step budget are dropped.

    Raises:
        ValueError: a size that is not a positive integer.
    """
    sizes = DEFAULT_COMPILE_BUCKETS if spec is None else [int(x) for x in str(spec).split(",") if x.strip()]
    if any(s <= 0 for s in sizes):
        raise ValueError(f"compile sizes must be positive integers, got {spec!r}")
    return sorted({s for s in sizes if s <= max_num_batched_tokens})
