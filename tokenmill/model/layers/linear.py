"""CPU linear layers with oneDNN-prepacked weights.

``F.linear`` on CPU hands a plain row-major ``[out, in]`` weight to the GEMM
library, which re-blocks (packs) it into its cache-friendly layout on every
call. For decode-sized inputs (a few to a few dozen rows) that repacking
costs as much as the multiply itself, and for the ``[vocab, hidden]`` LM head
it dominates the step. oneDNN can do the packing once, ahead of time: the
weight is reordered into the blocked layout its inner-product primitive
wants (``torch.ops.mkldnn._reorder_linear_weight``) and every call then runs
``torch.ops.mkldnn._linear_pointwise`` on it. These are the same two ops
PyTorch's Inductor emits when it freezes a CPU model's linear weights.

Measured on the 2-core AVX-512 development machine (``benchmarks/roofline.py``
and a per-layer micro-benchmark, plain vs packed side by side): 1.3-1.7x on
SmolLM2's q/k/v, gate/up and down GEMMs at 8-64 rows, 2-3x on its LM head,
in float32 and (less) in bfloat16; results equal ``F.linear`` to float
rounding (max abs difference ~1e-4 in float32, bit-equal in bfloat16).

The packed weight is opaque (only ``_linear_pointwise`` reads it), so
packing happens after the checkpoint is loaded, in the model runner. Set
``TOKENMILL_CPU_PACKED_LINEAR=0`` to keep plain ``nn.Linear`` layers.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

ENV_SWITCH = "TOKENMILL_CPU_PACKED_LINEAR"


def packed_linear_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True when oneDNN prepacking can serve ``dtype`` weights on ``device``.

    Needs a CPU device, a PyTorch built with oneDNN (mkldnn) and float32 or
    bfloat16 weights (bfloat16 only where oneDNN supports it on this CPU);
    ``TOKENMILL_CPU_PACKED_LINEAR=0`` turns it off.
    """
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` prepacked for oneDNN's inner product.

    Args:
        weight: ``[out_features, in_features]`` float32 or bfloat16 (CPU).
        bias: ``[out_features]`` or None.

    Raises:
        ValueError: the weight is not a 2-D CPU float32/bfloat16 tensor.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"PackedLinear needs a 2-D CPU float32/bfloat16 weight, got "
                             f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

        self.int4_max_rows = 0
        self.int4_group_size = 0
        self.int4_weight: torch.Tensor | None = None
        self.int4_scale_zero: torch.Tensor | None = None

    def attach_int4(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    max_rows: int) -> int:
        """Also keep the weight as 4-bit codes, used for inputs of at most ``max_rows`` rows.

        Small-batch decode steps are memory-bound: they read every weight
        for a few rows of activations. torch's int4 CPU GEMM
        (``aten._weight_int4pack_mm_for_cpu``, the kernel behind torchao's
        int4 weight-only CPU layout) reads a quarter of the bfloat16 bytes;
        measured on the 2-core machine over SmolLM2's 120 block GEMMs: 4x the
        oneDNN bfloat16 GEMM at 1 row, 2x at 4, even at 6-8, slower above
        (``benchmarks/roofline.py`` times the whole step). Weight
        ``w = (codes - 8) * scale + zero`` per group of ``group_size`` input
        columns; scale and zero are held in bfloat16 (the kernel's format),
        so results match the bfloat16 GEMM to bfloat16 rounding, not bit for
        bit.

        Args:
            codes: ``[out_features, in_features]`` integers in 0..15.
            scale, zero: ``[out_features, in_features / group_size]`` (float32).
            group_size: input columns per scale (32 for GGUF Q4_0/Q4_1).
            max_rows: use the int4 path for inputs of at most this many rows.

        Returns:
            bytes held by the int4 copy.

        Raises:
            ValueError: not a bfloat16 layer (the kernel has no vectorised
                float32 path), shapes that do not match, or an output size
                that is not a multiple of :data:`INT4_N_MULTIPLE`.
        """
        if self.dtype != torch.bfloat16:
            raise ValueError(f"int4 weights need a bfloat16 layer, this one is {self.dtype}")
        n, k = self.out_features, self.in_features
        groups = k // group_size if group_size > 0 else 0
        if (tuple(codes.shape) != (n, k) or k % max(group_size, 1) or tuple(scale.shape) != (n, groups)
                or tuple(zero.shape) != (n, groups)):
            raise ValueError(f"int4 codes {tuple(codes.shape)} / scales {tuple(scale.shape)} do not fit a "
                             f"[{n}, {k}] weight with groups of {group_size}")
        if n % INT4_N_MULTIPLE:
            raise ValueError(f"int4 weights need out_features divisible by {INT4_N_MULTIPLE}, got {n}")
        with torch.no_grad():
            self.int4_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).contiguous(), 1)
            self.int4_scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.int4_group_size, self.int4_max_rows = group_size, max_rows
        return self.int4_weight.numel() * self.int4_weight.element_size() + \
            self.int4_scale_zero.numel() * self.int4_scale_zero.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` (weight dtype) -> ``[..., out_features]``."""
        if self.int4_max_rows and x.dim() == 2 and x.shape[0] <= self.int4_max_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.int4_weight, self.int4_group_size,
                                                            self.int4_scale_zero)
            return y if self.bias is None else y + self.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        extra = f", int4 rows<={self.int4_max_rows}" if self.int4_max_rows else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, "
                f"packed=oneDNN{extra}")


def pack_linear_weights(model: nn.Module, include_layers: bool = True) -> int:
    """Replace every CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place.

    ``include_layers=False`` packs only the LM head: the compiled step
    (``torch.compile`` of the decoder blocks) passes weights as graph inputs,
    and Inductor lowers ``_linear_pointwise`` only for frozen (constant)
    weights.

    The original weights are released. A model with a tied LM head (which
    reads the embedding table, so it is no ``nn.Linear``) gets a packed copy
    through its ``set_logits_head`` method, if it has one. Does nothing (and
    returns 0) where :func:`packed_linear_available` is False.

    Returns:
        The number of layers packed (the LM head included).
    """
    params = list(model.parameters())
    if not params:
        return 0
    p0 = params[0]
    if not packed_linear_available(p0.device, p0.dtype):
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (include_layers or child is getattr(model, "lm_head", None)):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                count += 1
    tied = getattr(model, "tied_logits_weight", None)
    head = tied() if tied is not None else None
    if head is not None and hasattr(model, "set_logits_head"):
        model.set_logits_head(PackedLinear(head))
        count += 1
    logger.info("packed %d linear layers for oneDNN (%s)", count, p0.dtype)
    return count


def int4_max_tokens(device: torch.device | str, dtype: torch.dtype) -> int:
    """Largest step (tokens) whose linears use 4-bit weights; 0 when the int4 path is off.

    On for bfloat16 CPU models with oneDNN packing; ``TOKENMILL_CPU_INT4_MAX_TOKENS``
    sets the limit (default 8, ``0`` turns it off; see
    :func:`tokenmill.config.int4_max_tokens_from_env`).

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    from tokenmill.config import int4_max_tokens_from_env

    limit = int4_max_tokens_from_env()
    if dtype != torch.bfloat16 or not packed_linear_available(device, dtype):
        return 0
    return limit


# torch's int4 CPU packing (aten._convert_weight_to_int4pack_for_cpu) needs the output size to be a multiple of this.
INT4_N_MULTIPLE = 16


def attach_int4_weights(model: nn.Module, int4: dict[str, tuple[torch.Tensor, ...]], group_size: int,
                        max_rows: int) -> tuple[int, int]:
    """Give every :class:`PackedLinear` of ``model`` named in ``int4`` its 4-bit copy (:meth:`PackedLinear.attach_int4`).

    Layers whose output size is not a multiple of :data:`INT4_N_MULTIPLE`
    (e.g. an untied LM head over a 32001-token vocabulary) keep only the
    bfloat16 path.

    Args:
        int4: module name -> ``(codes, scale, zero)`` (e.g. from
            :func:`tokenmill.model.gguf_loader.iter_gguf_int4` through the
            model's ``stack_row_shards``).

    Returns:
        ``(layers, bytes)`` attached.
    """
    count = nbytes = 0
    for name, mod in model.named_modules():
        if name in int4 and isinstance(mod, PackedLinear) and mod.dtype == torch.bfloat16:
            if mod.out_features % INT4_N_MULTIPLE:
                logger.info("no int4 copy for %s: %d output features, not a multiple of %d (torch's int4 "
                            "CPU packing)", name, mod.out_features, INT4_N_MULTIPLE)
                continue
            codes, scale, zero = int4[name]
            nbytes += mod.attach_int4(codes, scale, zero, group_size, max_rows)
            count += 1
    if count:
        logger.info("int4 weights for %d linear layers (steps of <= %d tokens): %.1f MiB extra",
                    count, max_rows, nbytes / 2**20)
    return count, nbytes
