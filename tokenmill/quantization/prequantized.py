"""Pre-quantised 4-bit safetensors checkpoints (AutoAWQ, GPTQ) loaded as codes, never as dense float weights.

``config.json``'s ``quantization_config`` names the method:

- ``awq`` (AutoAWQ GEMM layout, arXiv 2306.00978): per layer ``qweight``
  ``[K, N/8]`` int32 (8 output columns per word, nibble ``i`` holding column
  ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``qzeros`` ``[K/G, N/8]`` packed the
  same way, ``scales`` ``[K/G, N]``; ``w = (q - z) * s``.
- ``gptq`` (arXiv 2210.17323): ``qweight`` ``[K/8, N]`` int32 (8 consecutive
  input rows per word, row ``8r + j`` in nibble ``j``), ``qzeros`` ``[K/G, N/8]``
  (column ``8c + j`` in nibble ``j``; stored as ``z - 1`` unless
  ``checkpoint_format`` is ``gptq_v2``), ``scales`` ``[K/G, N]``, ``g_idx`` ``[K]``
  (group of each input row; a non-sorted one — act-order — becomes an input
  permutation applied to the activations).

Both become ``scale * q + min`` with ``min = -z * s`` (exact in float32) in
:class:`~tokenmill.quantization.methods.QuantizedLinear` layers; q/k/v and
gate/up shards are fused like the model's dense layers. Only ``bits: 4`` is
supported (a clear error otherwise).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from tokenmill.quantization.gguf import GroupCodes, merge_shards
from tokenmill.quantization.methods import QuantizedLinear
from tokenmill.quantization.lowbit import LowBitWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".bias")


def read_quant_config(folder: str) -> dict | None:
    """``quantization_config`` of ``folder/config.json`` (lower-cased ``quant_method``), or None."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        q = json.load(f).get("quantization_config")
    if not q:
        return None
    q = dict(q)
    q["quant_method"] = str(q.get("quant_method", "")).lower()
    return q


def check_quant_config(q: dict) -> str:
    """The method of a checkpoint's quantization_config.

    Raises:
        ValueError: a method other than awq/gptq, or bits other than 4.
    """
    method = q["quant_method"]
    if method not in ("awq", "gptq"):
        raise ValueError(f"checkpoint quantization_config method {method!r} is not supported (supported: awq, gptq)")
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{method} checkpoint with {bits}-bit weights is not supported (4-bit only)")
    if method == "awq" and str(q.get("version", "gemm")).lower() not in ("gemm", "gemv_fast", ""):
        if str(q.get("version")).lower() != "gemm":
            raise ValueError(f"AWQ version {q.get('version')!r} is not supported (GEMM layout only)")
    return method


def _unpack_cols(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """``[R, C/8]`` int32 -> ``[R, C]`` codes 0..15; nibble ``i`` of word ``c`` is column ``8c + order[i]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nib = (packed.to(torch.int32)[..., None] >> shifts) & 0xF                 # [R, C/8, 8] by nibble
    out = torch.empty_like(nib)
    out[..., list(order)] = nib
    return out.reshape(packed.shape[0], -1)


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> GroupCodes:
    """AutoAWQ GEMM tensors -> :class:`GroupCodes` ``[N, K]`` (exact)."""
    q = _unpack_cols(qweight, AWQ_ORDER).t()                                   # [N, K]
    z = _unpack_cols(qzeros, AWQ_ORDER).t().float()                           # [N, K/G]
    s = scales.float().t()
    return GroupCodes(q.to(torch.uint8).contiguous(), s.contiguous(), (-z * s).contiguous(), 4, "awq")


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
               v2: bool) -> tuple[GroupCodes, torch.Tensor | None]:
    """GPTQ tensors -> (:class:`GroupCodes` ``[N, K]`` with groups contiguous, input permutation or None).

    Raises:
        ValueError: an act-order ``g_idx`` whose groups are not all the same size.
    """
    kp, n = qweight.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((qweight.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(kp * 8, n)   # [K, N]
    z = _unpack_cols(qzeros).float() + (0.0 if v2 else 1.0)                  # [K/G, N]
    s = scales.float()
    k, ng = kp * 8, s.shape[0]
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // (k // ng)):
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(torch.bincount(g_idx.long(), minlength=ng), torch.full((ng,), k // ng)):
            raise ValueError("GPTQ g_idx with groups of unequal size is not supported")
        q = q[perm]
    st = s.t().contiguous()
    return GroupCodes(q.t().to(torch.uint8).contiguous(), st, (-z.t() * st).contiguous(), 4, "gptq"), perm


def load_prequantized(model: nn.Module, tensors, method: str, qcfg: dict) -> dict[str, int]:
    """Load an AWQ/GPTQ checkpoint into ``model`` (its dense tensors too), quantised layers as codes.

    Args:
        model: the instantiated model (dense linears are replaced).
        tensors: iterable of ``(name, tensor)`` over the whole checkpoint.
        method: ``awq`` or ``gptq``.
        qcfg: the ``quantization_config``.

    Returns:
        bytes per weight format of the quantised layers.

    Raises:
        ValueError: a quantised layer the model does not have, or shards that cannot be fused.
    """
    stacked = getattr(model, "_STACKED", {})
    parts: dict[str, dict[str, torch.Tensor]] = {}
    dense: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors:
        for suf in _SUFFIXES:
            if name.endswith(suf) and (suf != ".bias"):
                parts.setdefault(name[: -len(suf)], {})[suf[1:]] = t
                break
        else:
            dense.append((name, t))
    # biases of quantised layers belong to them, not to the dense loader
    qbias = [(n, t) for n, t in dense if n.endswith(".bias") and n[: -len(".bias")] in parts]
    for n, t in qbias:
        parts[n[: -len(".bias")]]["bias"] = t
    dense = [(n, t) for n, t in dense if not (n.endswith(".bias") and n[: -len(".bias")] in parts)]

    v2 = str(qcfg.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    fused: dict[str, dict[int, tuple]] = {}
    need: dict[str, int] = {}
    for fz, _ in stacked.values():
        need[fz] = need.get(fz, 0) + 1
    for mod_name, p in parts.items():
        if "qweight" not in p:
            raise ValueError(f"{method} layer {mod_name} has no qweight")
        if method == "awq":
            gc, perm = awq_codes(p["qweight"], p["qzeros"], p["scales"]), None
        else:
            gc, perm = gptq_codes(p["qweight"], p["qzeros"], p["scales"], p.get("g_idx"), v2)
        target, shard, n = mod_name, 0, 1
        for part, (fz, idx) in stacked.items():
            if mod_name.endswith("." + part) or f".{part}." in mod_name + ".":
                target, shard, n = mod_name[: -len(part)] + fz, idx, need[fz]
                break
        fused.setdefault(target, {})[shard] = (gc, perm, p.get("bias"), n)
    by_fmt: dict[str, int] = {}
    for target, shards in fused.items():
        n = next(iter(shards.values()))[3]
        if len(shards) != n:
            raise ValueError(f"{method} checkpoint quantises only some shards of {target}")
        got = [shards[i] for i in range(n)]
        perms = [g[1] for g in got]
        if any(p is not None for p in perms) and not all(p is not None and torch.equal(p, perms[0]) for p in perms):
            raise ValueError(f"{target}: shards with different GPTQ act-order permutations cannot be fused")
        gc = merge_shards([g[0] for g in got])
        biases = [g[2] for g in got]
        bias = torch.cat([b.float() for b in biases]) if all(b is not None for b in biases) else None

        lw = LowBitWeight.from_codes(gc.codes, gc.scale, gc.min, 4, fmt=f"{method}-g{gc.group}", check=False)
        parent_name, _, attr = target.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            old = getattr(parent, attr)
        except AttributeError as e:
            raise ValueError(f"{method} layer {target} has no place in {type(model).__name__}") from e
        if (getattr(old, "out_features", None), getattr(old, "in_features", None)) != (lw.out_features, lw.in_features):
            raise ValueError(f"{target}: quantised shape [{lw.out_features}, {lw.in_features}] does not match the model")
        device = next((p.device for p in old.parameters()), torch.device("cpu"))
        setattr(parent, attr, QuantizedLinear(lw, bias, perms[0]).to(device))
        by_fmt[lw.fmt] = by_fmt.get(lw.fmt, 0) + lw.nbytes
    model.load_weights(iter(dense))
    return by_fmt
