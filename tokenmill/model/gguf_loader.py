"""Read GGUF checkpoints: metadata -> :class:`ModelArchConfig`, tensors -> dense torch weights.

Uses the ``gguf`` package (the format's reference Python reader, from
llama.cpp): :class:`gguf.GGUFReader` memory-maps the file and
:func:`gguf.quants.dequantize` turns block-quantised tensors (Q8_0, Q4_0,
Q4_1, Q4_K, Q6_K, ...) into float32. GGUF names are mapped to Hugging Face
names so one ``load_weights`` serves both checkpoint formats.

llama.cpp's converter stores the q/k projections of ``llama`` models with the
rows of each head interleaved for its RoPE (pairs ``(2i, 2i+1)`` rotate
together); Hugging Face code rotates ``(i, i + head_dim/2)``. We undo the
permutation at load time (:func:`unpermute_qk`). ``qwen2``/``qwen3`` GGUFs use
the NeoX layout already and are not permuted.
"""

from __future__ import annotations

import os
import re
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import torch

from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.model.registry import normalize_architecture

# Quant types we test; gguf.quants may dequantize more (Q5_0, Q5_K, ...), which we also accept.
TESTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

# Architectures whose q/k weights llama.cpp permutes for its interleaved RoPE.
_PERMUTED_ARCHS = {"llama"}

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts: the router and the experts stacked [E, ...] (see tokenmill.model.mixtral)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# older Mixtral GGUFs store one tensor per expert: blk.N.ffn_gate.E.weight
_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def open_gguf(path: str):
    """Memory-map a GGUF file: :class:`FastGGUFReader` (same ``fields`` / ``tensors`` interface as
    :class:`gguf.GGUFReader`, which stays the fallback for a file it cannot parse).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file.
    """
    import gguf

    if not os.path.exists(path):
        raise FileNotFoundError(path)
    try:
        return FastGGUFReader(path)
    except (ValueError, KeyError, struct.error):
        pass
    try:
        return gguf.GGUFReader(path, "r")
    except FileNotFoundError:
        raise
    except Exception as e:  # gguf raises ValueError/struct errors on bad magic
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


_GGUF_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                    12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Field:
    """A metadata entry: ``contents()`` decodes it; ``data`` has one entry per array item (len only)."""

    __slots__ = ("_decode", "data")

    def __init__(self, decode, count: int) -> None:
        self._decode = decode
        self.data = range(count)

    def contents(self) -> Any:
        return self._decode()


class _Tensor:
    __slots__ = ("name", "tensor_type", "shape", "n_elements", "n_bytes", "data_offset", "data")


class FastGGUFReader:
    """GGUF v2/v3 reader that decodes metadata lazily.

    :class:`gguf.GGUFReader` builds numpy views for every item of every array, the ~100k
    vocabulary and merge strings included, which took ~8 s of the default model's start-up; this
    reader only walks past them (their values are decoded when asked for) and maps tensor data
    the same way (same ``name``, ``tensor_type``, ``shape`` (GGUF ``ne`` order), ``data`` views).

    Raises:
        ValueError: not a GGUF file, unsupported version, truncated header or unknown type.
    """

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(self.data)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} not supported by the fast reader")
        pos = 24

        def string_at(p: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, p)
            return bytes(buf[p + 8:p + 8 + n]).decode("utf-8", errors="replace"), p + 8 + n

        def skip_value(vtype: int, p: int) -> int:
            if vtype in _GGUF_SCALAR_FMT:
                return p + struct.calcsize(_GGUF_SCALAR_FMT[vtype])
            if vtype == _GGUF_STRING:
                return p + 8 + struct.unpack_from("<Q", buf, p)[0]
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, p)
                p += 12
                if etype in _GGUF_SCALAR_FMT:
                    return p + count * struct.calcsize(_GGUF_SCALAR_FMT[etype])
                for _ in range(count):
                    p = skip_value(etype, p)
                return p
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")

        def decoder(vtype: int, p: int):
            def decode() -> Any:
                if vtype in _GGUF_SCALAR_FMT:
                    v = struct.unpack_from(_GGUF_SCALAR_FMT[vtype], buf, p)[0]
                    return bool(v) if vtype == 7 else v
                if vtype == _GGUF_STRING:
                    return string_at(p)[0]
                etype, count = struct.unpack_from("<IQ", buf, p)
                q, out = p + 12, []
                for _ in range(count):
                    out.append(decoder(etype, q)())
                    q = skip_value(etype, q)
                return out
            return decode

        self.fields: dict[str, _Field] = {}
        for _ in range(n_kv):
            key, pos = string_at(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            count = struct.unpack_from("<IQ", buf, pos)[1] if vtype == _GGUF_ARRAY else 1
            self.fields[key] = _Field(decoder(vtype, pos), count)
            pos = skip_value(vtype, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = string_at(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ggml_type, offset))
        align = int(self.fields["general.alignment"].contents()) if "general.alignment" in self.fields else 32
        start = -(-pos // align) * align
        plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}
        self.tensors: list[_Tensor] = []
        for name, dims, ggml_type, offset in infos:
            qt = GGMLQuantizationType(ggml_type)
            n_elems = int(np.prod(dims)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[qt]
            n_bytes = n_elems * type_size // block
            np_dims = tuple(reversed(dims))
            begin = start + offset
            if qt in plain:
                data = self.data[begin:begin + n_bytes].view(plain[qt]).reshape(np_dims)
            else:
                byte_dims = (*np_dims[:-1], np_dims[-1] // block * type_size)
                data = self.data[begin:begin + n_bytes].reshape(byte_dims)
            t = _Tensor()
            t.name, t.tensor_type, t.shape, t.n_elements, t.n_bytes, t.data_offset, t.data = (
                name, qt, np.array(dims, dtype=np.uint64), n_elems, n_bytes, begin, data)
            self.tensors.append(t)


def get_field(reader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata ``key`` (scalar, string or list), or ``default`` if absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_metadata(reader, max_array_len: int = 64) -> dict[str, Any]:
    """All metadata as a dict, skipping arrays longer than ``max_array_len`` (the vocabulary)."""
    out = {}
    for k, f in reader.fields.items():
        if len(f.data) > max_array_len:
            continue
        try:
            out[k] = f.contents()
        except Exception:  # pragma: no cover - exotic field types
            continue
    return out


def read_arch_config(reader) -> ModelArchConfig:
    """Build a :class:`ModelArchConfig` from GGUF metadata and tensor names.

    Raises:
        ValueError: unsupported ``general.architecture`` (message lists the
            supported ones), unsupported RoPE scaling, or missing keys.
    """
    arch = get_field(reader, "general.architecture")
    if arch is None:
        raise ValueError("GGUF file has no general.architecture")
    hf_arch = normalize_architecture(arch)

    def key(name: str, default: Any = KeyError) -> Any:
        v = get_field(reader, f"{arch}.{name}")
        if v is None:
            if default is KeyError:
                raise ValueError(f"GGUF metadata is missing {arch}.{name}")
            return default
        return v

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files
        kv_heads = kv_heads[0]
    head_dim = int(key("attention.key_length", hidden // heads))
    emb = tensors.get("token_embd.weight")
    vocab = key("vocab_size", None)
    if vocab is None:
        vocab = int(emb.shape[-1]) if emb is not None else len(reader.fields["tokenizer.ggml.tokens"].data)

    rope_scaling = None
    stype = key("rope.scaling.type", None)
    if stype not in (None, "none"):
        if stype != "linear":
            raise ValueError(f"unsupported GGUF rope scaling type {stype!r}; supported: none, linear, "
                             f"llama3 (rope_freqs tensor)")
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        freq_factors = dequantize_tensor(tensors["rope_freqs.weight"]).flatten().tolist()

    eos = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = get_field(reader, k)
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    bos = get_field(reader, "tokenizer.ggml.bos_token_id")
    moe = {}
    num_experts = int(key("expert_count", 0) or 0)
    if num_experts:
        # llama.cpp stores Mixtral as a "llama" with experts; qwen3moe names its expert width separately
        if hf_arch == "LlamaForCausalLM":
            hf_arch = "MixtralForCausalLM"
        layers = int(key("block_count"))
        sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)]
        moe = dict(num_experts=num_experts, num_experts_per_tok=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length", 0) or key("feed_forward_length")),
                   # Mixtral always renormalises; llama.cpp's qwen3moe graph does too unless the file says otherwise
                   norm_topk_prob=True if hf_arch == "MixtralForCausalLM" else bool(key("expert_weights_norm", True)),
                   moe_layer_mask=None if all(sparse) else sparse)
    return ModelArchConfig(
        architecture=hf_arch,
        num_hidden_layers=int(key("block_count")),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        vocab_size=int(vocab),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        rope_freq_factors=freq_factors,
        **moe,
    )


def dequantize_tensor(t) -> torch.Tensor:
    """Dequantize one :class:`gguf.ReaderTensor` to a float32 torch tensor.

    The result has numpy (row-major) shape, i.e. GGUF's ``ne`` reversed:
    a weight of a ``Linear(in, out)`` comes back ``[out, in]``.

    Raises:
        ValueError: ``gguf`` cannot dequantize this tensor type.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q

    qtype = Q(t.tensor_type)
    data = t.data
    if qtype == Q.F32:
        arr = np.array(data, dtype=np.float32)  # copy out of the read-only mmap
    elif qtype == Q.F16:
        arr = np.asarray(data).astype(np.float32)
    else:
        try:
            arr = gguf.quants.dequantize(data, qtype)
        except NotImplementedError as e:
            raise ValueError(f"tensor {t.name}: GGUF type {qtype.name} cannot be dequantized "
                             f"(tested types: {', '.join(TESTED_QUANT_TYPES)})") from e
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: interleaved RoPE pairs -> rotate_half layout.

    llama.cpp's converter maps HF row ``h*D + r*(D/2) + j`` to ``h*D + 2j + r``
    (``D`` = head dim, ``r`` in {0, 1}); this is the inverse.

    Args:
        w: ``[n_head * head_dim, ...]`` weight (or bias) as stored in the GGUF.
        n_head: query heads for q, KV heads for k.
    """
    rows = w.shape[0]
    rest = tuple(w.shape[1:])
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def gguf_to_hf_name(name: str) -> str | None:
    """Map a GGUF tensor name to its Hugging Face name (None for tensors with no weight role, e.g. ``rope_freqs``)."""
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = _BLK_RE.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    e = _EXPERT_RE.match(m.group(2)) if m else None
    if e:
        return f"model.layers.{m.group(1)}.mlp.experts.{e.group(2)}.{e.group(1)}_proj.weight"
    if name == "rope_freqs.weight":
        return None
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def iter_gguf_weights(reader, arch: ModelArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every weight, q/k un-permuted for ``llama`` GGUFs.

    Raises:
        ValueError: an unexpected tensor name or an unsupported quant type.
    """
    gguf_arch = get_field(reader, "general.architecture")
    permuted = gguf_arch in _PERMUTED_ARCHS
    todo = [(name, t) for t in reader.tensors if (name := gguf_to_hf_name(t.name)) is not None]

    def work(item: tuple[str, Any]) -> tuple[str, torch.Tensor]:
        name, t = item
        w = dequantize_tensor(t)
        if permuted and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, arch.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, arch.num_key_value_heads)
        return name, w

    # numpy releases the GIL in the bulk of dequantization: overlap tensors on
    # a few threads, keeping at most ``2 * workers`` results alive at once.
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        pending: deque = deque()
        for item in todo:
            pending.append(pool.submit(work, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def chat_template(reader) -> str | None:
    """The GGUF's ``tokenizer.chat_template`` (a Jinja string) or None."""
    return get_field(reader, "tokenizer.chat_template")
