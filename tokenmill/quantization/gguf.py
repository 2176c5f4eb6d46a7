"""GGUF block formats as group-wise codes (no dequantisation to float).

Each supported ggml block type maps exactly onto ``w = scale * q + min`` per
group of 16 or 32 weights along a row (:class:`~tokenmill.quantization.lowbit.LowBitWeight`);
scales and mins are computed in float32 from the block's float16 fields
exactly as ggml's reference dequantisation computes them, so the dense weight
rebuilt from the codes equals :func:`gguf.quants.dequantize` (tested):

=======  =====  =====  ====================================================
type     bits   group  codes / scale / min
=======  =====  =====  ====================================================
Q4_0     4      32     q in 0..15; d; -8 d
Q4_1     4      32     q in 0..15; d; m
Q4_K     4      32     q in 0..15; d * sc (6-bit); -dmin * m (6-bit)
Q5_0     8      32     q - 16 in -16..15; d; none
Q5_1     8      32     q in 0..31; d; m
Q8_0     8      32     q in -128..127; d; none
Q6_K     8      16     q - 32 in -32..31; d * sc (int8); none
=======  =====  =====  ====================================================

5- and 6-bit codes travel in the 8-bit container (one byte per weight); Q4
codes keep 4 bits. Block layouts follow ggml's ``ggml-common.h`` (QK4_0 ...,
``block_q4_K``: super-blocks of 256 with 12 bytes of packed 6-bit scales).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from tokenmill.quantization.lowbit import LowBitWeight

SUPPORTED = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q8_0", "Q6_K")


class GroupCodes(NamedTuple):
    """Row-major group-wise codes of one tensor: ``w = scale * codes + min`` per group.

    codes: ``[N, K]`` uint8 (4-bit, 0..15) or int8 (8-bit); scale/min: ``[N, K / group]`` float32 (min None = 0); bits 4 or 8; fmt the GGUF type.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    bits: int
    fmt: str

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The dense ``[N, K]`` float32 weight."""
        n, k = self.codes.shape
        w = self.codes.float().reshape(n, -1, self.group) * self.scale.unsqueeze(-1)
        if self.min is not None:
            w = w + self.min.unsqueeze(-1)
        return w.reshape(n, k)


def _f16(b: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 -> ``[...]`` float32 (little-endian float16)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]``: low nibbles are elements 0..15, high nibbles 16..31 (Q4_0/Q4_1/Q5_x)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K packed 6-bit scales ``[..., 12]`` -> (sc, m) ``[..., 8]`` (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


def block_codes(raw: np.ndarray, qtype: str, rows: int, cols: int) -> GroupCodes:
    """Decode a tensor's raw blocks into :class:`GroupCodes`.

    Args:
        raw: the tensor's bytes (any shape; ``rows * cols / block * block_bytes`` uint8).
        qtype: one of :data:`SUPPORTED`.
        rows, cols: the logical ``[N, K]`` shape (GGUF's ``ne[1], ne[0]``).

    Raises:
        ValueError: an unsupported type or a size that does not match.
    """
    raw = np.asarray(raw).view(np.uint8).reshape(-1)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        bs = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[qtype]
        if raw.size != rows * cols // 32 * bs or cols % 32:
            raise ValueError(f"{qtype}: {raw.size} bytes do not hold a [{rows}, {cols}] tensor")
        b = raw.reshape(rows, cols // 32, bs)
        d = _f16(b[..., 0:2])
        if qtype == "Q8_0":
            return _gc(b[..., 2:].view(np.int8), d, None, 8, qtype, rows, cols)
        if qtype == "Q4_0":
            return _gc(_nibbles(b[..., 2:]), d, -8.0 * d, 4, qtype, rows, cols)
        if qtype == "Q4_1":
            return _gc(_nibbles(b[..., 4:]), d, _f16(b[..., 2:4]), 4, qtype, rows, cols)
        head = 2 if qtype == "Q5_0" else 4
        qh = np.ascontiguousarray(b[..., head:head + 4]).view(np.uint32)[..., 0]          # [rows, blocks]
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)   # bit j -> element j
        q = _nibbles(b[..., head + 4:]) | (high << 4)
        if qtype == "Q5_0":
            return _gc(q.astype(np.int8) - np.int8(16), d, None, 8, qtype, rows, cols)
        return _gc(q, d, _f16(b[..., 2:4]), 8, qtype, rows, cols)
    if qtype == "Q4_K":
        if raw.size != rows * cols // 256 * 144 or cols % 256:
            raise ValueError(f"{qtype}: {raw.size} bytes do not hold a [{rows}, {cols}] tensor")
        b = raw.reshape(rows, cols // 256, 144)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, m = _k_scales(b[..., 4:16])
        qs = b[..., 16:].reshape(rows, cols // 256, 4, 32)                  # 4 chunks of 64 weights
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols // 256, 8, 32)
        scale = d[..., None] * sc.astype(np.float32)
        mn = -(dmin[..., None] * m.astype(np.float32))
        return _gc(q, scale, mn, 4, qtype, rows, cols)
    if qtype == "Q6_K":
        if raw.size != rows * cols // 256 * 210 or cols % 256:
            raise ValueError(f"{qtype}: {raw.size} bytes do not hold a [{rows}, {cols}] tensor")
        b = raw.reshape(rows, cols // 256, 210)
        ql = b[..., 0:128].reshape(rows, -1, 2, 64)                          # two halves of 128 weights
        qh = b[..., 128:192].reshape(rows, -1, 2, 32)
        sc = b[..., 192:208].view(np.int8).astype(np.float32)                # [rows, blocks, 16]
        d = _f16(b[..., 208:210])
        lo = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], -1)
        hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], -1)
        q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)                          # [rows, blocks, 2, 128]
        return _gc(q, d[..., None] * sc, None, 8, qtype, rows, cols)
    raise ValueError(f"GGUF type {qtype} has no low-bit kernel format (supported: {', '.join(SUPPORTED)})")


def _gc(q: np.ndarray, scale: np.ndarray, mn: np.ndarray | None, bits: int, fmt: str, rows: int,
        cols: int) -> GroupCodes:
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(rows, -1))
    codes = torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8 if bits == 4 else np.int8).reshape(rows, cols))
    return GroupCodes(codes, t(scale), None if mn is None else t(mn), bits, fmt)


def tensor_codes(t) -> GroupCodes | None:
    """:class:`GroupCodes` of a 2-D :class:`gguf.ReaderTensor` in a supported type, else None."""
    from gguf import GGMLQuantizationType as Q

    qtype = Q(t.tensor_type).name
    if qtype not in SUPPORTED or len(t.shape) != 2:
        return None
    return block_codes(t.data, qtype, int(t.shape[1]), int(t.shape[0]))


def merge_shards(parts: list[GroupCodes]) -> GroupCodes:
    """Concatenate shards (q/k/v, gate/up) along rows, in one common format.

    Shards of different formats meet in the widest one: 8-bit when any shard
    is 8-bit (4-bit codes fit), the smallest group (larger groups' scales
    repeat), zero mins where a shard has none. Exact.

    Raises:
        ValueError: groups that do not divide each other or different widths.
    """
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts) or len({p.codes.shape[1] for p in parts}) != 1:
        raise ValueError("shards with incompatible groups or widths")
    any_min = any(p.min is not None for p in parts)
    codes, scales, mins = [], [], []
    for p in parts:
        r = p.group // group
        codes.append(p.codes.to(torch.int8) if bits == 8 else p.codes)
        scales.append(p.scale.repeat_interleave(r, dim=1))
        if any_min:
            mins.append(p.min.repeat_interleave(r, dim=1) if p.min is not None else torch.zeros_like(scales[-1]))
    fmts = "+".join(dict.fromkeys(p.fmt for p in parts))
    return GroupCodes(torch.cat(codes), torch.cat(scales), torch.cat(mins) if any_min else None, bits, fmts)


def gguf_lowbit_weights(reader, arch, stacked: dict[str, tuple[str, int]]) -> dict:
    """Every supported low-bit linear weight (and the token embedding) of a GGUF, packed per model module.

    q/k rows are un-permuted like the dense loader (llama GGUFs), and
    checkpoint shards are fused the way the model fuses its layers.

    Args:
        reader: an open :class:`gguf.GGUFReader`.
        arch: the :class:`~tokenmill.model.arch_config.ModelArchConfig`.
        stacked: the model's shard map (``LlamaForCausalLM._STACKED``: checkpoint part -> (fused part, index)).

    Returns:
        module name (``model.layers.0.self_attn.qkv_proj``, ``lm_head``,
        ``model.embed_tokens``) -> :class:`~tokenmill.quantization.lowbit.LowBitWeight`.
        Modules with any shard in an unsupported type are left out (they keep the dense path).
    """
    from tokenmill.model.gguf_loader import _PERMUTED_ARCHS, get_field, gguf_to_hf_name, unpermute_qk

    permuted = get_field(reader, "general.architecture") in _PERMUTED_ARCHS
    need: dict[str, int] = {}
    for fused, _ in stacked.values():
        need[fused] = need.get(fused, 0) + 1
    shards: dict[str, dict[int, GroupCodes | None]] = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None or not name.endswith(".weight") or len(t.shape) != 2:
            continue
        gc = tensor_codes(t)
        if gc is not None and permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = arch.num_attention_heads if name.endswith("q_proj.weight") else arch.num_key_value_heads
            gc = GroupCodes(*(None if a is None else unpermute_qk(a, heads).contiguous() for a in gc[:3]),
                            gc.bits, gc.fmt)
        target, shard, n = name[: -len(".weight")], 0, 1
        for part, (fused, idx) in stacked.items():
            if f".{part}." in name:
                target, shard, n = name.replace(part, fused)[: -len(".weight")], idx, need[fused]
                break
        shards.setdefault(target, {})[shard] = gc
        shards[target]["n"] = n  # type: ignore[index]
    out = {}
    for target, parts in shards.items():
        n = parts.pop("n")  # type: ignore[call-overload]
        got = [parts.get(i) for i in range(n)]
        if any(p is None for p in got):
            continue
        m = merge_shards(got)  # type: ignore[arg-type]
        out[target] = LowBitWeight.from_codes(m.codes, m.scale, m.min, m.bits, m.fmt, check=False)
    return out
