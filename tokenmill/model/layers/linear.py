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
``TOKENMILL_CPU_PACKED_LINEAR=0`` to keep plain ``nn.Linear`` layers (the engine reads it through its
config's kernel plan, tokenmill/kernel_plan.py).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

import torch
from torch import nn

from tokenmill import envs, kernel_plan
from tokenmill.kernel_plan import CpuFacts, CpuKernelSwitches
from tokenmill.model.layers.cpu_build import cpu_isa
from tokenmill.quantization.lowbit import LowBitWeight, kernel_available, lowbit_linear

logger = logging.getLogger(__name__)

ENV_SWITCH = "TOKENMILL_CPU_PACKED_LINEAR"
_PACK_LOCK = threading.Lock()
_PACKING_THREADS: dict[int, threading.Thread] = {}   # id(model) -> background packing thread


def packed_linear_available(device: torch.device | str, dtype: torch.dtype,
                            switches: CpuKernelSwitches | None = None) -> bool:
    """True when oneDNN prepacking can serve ``dtype`` weights on ``device``.

    Needs a CPU device, a PyTorch built with oneDNN (mkldnn) and float32 or
    bfloat16 weights (bfloat16 only where oneDNN supports it on this CPU);
    ``switches.packed_linear`` (``TOKENMILL_CPU_PACKED_LINEAR=0``) turns it off. The rule is
    :func:`tokenmill.kernel_plan.packed_linear_on`; ``switches`` None: the environment's (outside an engine,
    whose runner reads its :class:`~tokenmill.kernel_plan.KernelPlan` instead).
    """
    sw = switches if switches is not None else CpuKernelSwitches.from_env()
    dev = torch.device(device).type
    if not sw.packed_linear or dev != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    name = str(dtype).removeprefix("torch.")
    facts = CpuFacts(onednn=True, onednn_bf16=name == "bfloat16" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    return kernel_plan.packed_linear_on(dev, name, sw, facts)


def plain_bf16_wrap(device: torch.device | str, dtype: torch.dtype, switches: CpuKernelSwitches | None = None) -> bool:
    """True when a bfloat16 model's linears are wrapped in :class:`PackedLinear` without oneDNN packing
    (``onednn=False``: plain weights, ``F.linear`` for the dense path) so they can carry low-bit codes:
    oneDNN has no bfloat16 on this CPU (AVX2). The rule is :func:`tokenmill.kernel_plan.plain_bf16_linear`;
    ``switches`` None: the environment's."""
    sw = switches if switches is not None else CpuKernelSwitches.from_env()
    dev = torch.device(device).type
    if dtype != torch.bfloat16 or dev != "cpu":
        return False
    onednn = torch.backends.mkldnn.is_available()
    facts = CpuFacts(onednn=onednn, onednn_bf16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    return kernel_plan.plain_bf16_linear(dev, "bfloat16", sw, facts)


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` prepacked for oneDNN's inner product.

    Args:
        weight: ``[out_features, in_features]`` float32 or bfloat16 (CPU).
        bias: ``[out_features]`` or None.
        defer: pack on first use (or in :func:`pack_linear_weights`' background thread) instead of now.
        onednn: False keeps the plain weight and runs the dense path as ``F.linear`` (a bfloat16 weight on a
            CPU where oneDNN has no bfloat16: :func:`plain_bf16_wrap`); the layer exists to carry low-bit
            codes (:meth:`attach_lowbit`).

    Raises:
        ValueError: the weight is not a 2-D CPU float32/bfloat16 tensor.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, defer: bool = False,
                 onednn: bool = True) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"PackedLinear needs a 2-D CPU float32/bfloat16 weight, got "
                             f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.register_buffer("packed_weight", None, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        # The plain weight until it is packed (a plain attribute: never moved or saved), then None.
        self.weight_unpacked: torch.Tensor | None = weight.detach()
        self.lowbit_max_rows = 0
        self.lowbit_i8_max_rows = 0
        self.lowbit_i8_min_rows = 1   # set by attach_lowbit: the integer path serves lowbit_i8_min_rows..i8_max_rows
        self.lowbit_invariant = False
        self.lowbit: LowBitWeight | None = None
        self.onednn = onednn
        if not defer and onednn:
            self.ensure_packed()

    def ensure_packed(self) -> torch.Tensor:
        """The oneDNN-packed weight, packing it now if that has not happened yet (thread-safe).

        With ``defer=True`` the packing runs on first use of the packed path or in
        :func:`pack_linear_weights`' background thread, whichever comes first; the
        result is the same either way, so outputs do not depend on the timing.
        """
        packed = self.packed_weight
        if packed is not None:
            return packed
        if not self.onednn:
            raise RuntimeError("this layer keeps a plain weight (no oneDNN bfloat16 here): use dense()")
        with _PACK_LOCK:
            if self.packed_weight is None:
                with torch.no_grad():
                    self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight_unpacked.contiguous())
                self.weight_unpacked = None
            return self.packed_weight

    def attach_lowbit(self, weight: LowBitWeight, max_rows: int, i8_max_rows: int = 0,
                      invariant: bool = False, invariant_kernel: str | None = None) -> int:
        """Also keep the weight as low-bit codes, used for inputs of at most ``max_rows`` rows.

        Small-batch decode steps are memory-bound: they read every weight
        for a few rows of activations. The low-bit kernel
        (:func:`tokenmill.quantization.lowbit.lowbit_linear`) reads the
        checkpoint's own codes (4.5-8.5 bits per weight instead of 16 or 32)
        and computes in float32, so for a GGUF it gives the dequantised
        weight's product up to summation order, in float32 and bfloat16 models
        alike (measured: ``benchmarks/lowbit_gemm.py``).

        Args:
            weight: ``[out_features, in_features]`` codes (:class:`LowBitWeight`).
            max_rows: use it for inputs of at most this many rows (float32 path).
            i8_max_rows: inputs of more than ``max_rows`` and at most this many rows run the integer
                path (activations quantised to int8 per 32 columns; see
                :func:`tokenmill.quantization.lowbit.lowbit_linear`); 0: they run the dense oneDNN GEMM.
            invariant: batch-invariant mode (``--batch-invariant``, the default): every 2-D input, whatever
                its number of rows, runs ONE kernel over the codes, chosen per layer at load time, never per
                step (:func:`invariant_kernel_from_env`): by default the integer path (each row's activations
                quantised to int8 per 32-column block on their own, exact integer sums with the codes, a
                fixed float epilogue per block: invariant by construction, VNNI/AVX-512BW/AVX2 multiply-adds,
                llama.cpp's Q8 activation scheme), or with ``TOKENMILL_CPU_INVARIANT_KERNEL=float32`` (or a
                weight the integer path cannot serve) the float32 low-bit path, whose summation order per
                output element is also fixed. In both the rows of a pass and the threads only split the
                work (:file:`csrc/lowbit_gemm.c`), so a row's result depends only on that row, never on the
                step's size. ``i8_max_rows`` is ignored.
            invariant_kernel: ``int8`` or ``float32`` (the engine config's ``cpu_kernels.invariant_kernel``);
                None: :func:`invariant_kernel_from_env` (the environment's).

        Returns:
            bytes held by the low-bit copy.

        Raises:
            ValueError: the shapes do not match.
        """
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"low-bit weight [{weight.out_features}, {weight.in_features}] does not fit a "
                             f"[{self.out_features}, {self.in_features}] layer")
        self.lowbit, self.lowbit_max_rows = weight, max_rows
        self.lowbit_invariant = invariant
        if invariant:       # one path at every size: the integer low-bit kernel where it serves the weight
            kernel = invariant_kernel if invariant_kernel is not None else invariant_kernel_from_env()
            use_i8 = kernel == "int8" and weight.prepare_i8()
            self.lowbit_i8_min_rows, self.lowbit_i8_max_rows = 1, (1 << 62) if use_i8 else 0
            return weight.nbytes
        self.lowbit_i8_min_rows = max_rows + 1
        self.lowbit_i8_max_rows = i8_max_rows if i8_max_rows > max_rows and weight.prepare_i8() else 0
        return weight.nbytes

    def lowbit_path(self, m: int) -> str:
        """Which kernel an ``m``-row 2-D input runs: ``i8`` (integer low-bit path), ``f32`` (float low-bit
        path) or ``dense`` (oneDNN's packed GEMM). The step graph asks the same question."""
        if self.lowbit is None or not self.lowbit_max_rows:
            return "dense"
        if self.lowbit_i8_min_rows <= m <= self.lowbit_i8_max_rows:
            return "i8"
        if m <= self.lowbit_max_rows or self.lowbit_invariant:
            return "f32"
        return "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` (weight dtype) -> ``[..., out_features]``."""
        if self.lowbit_max_rows and x.dim() == 2:
            path = self.lowbit_path(x.shape[0])
            if path == "i8":
                return lowbit_linear(x, self.lowbit, self.bias, int8_act=True)
            if path == "f32":
                return lowbit_linear(x, self.lowbit, self.bias)
        return self.dense(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The dense product ``x Wᵀ + b`` (``x`` ``[..., in_features]``): oneDNN's packed GEMM, or ``F.linear``
        on the plain weight where the layer has no oneDNN packing (``onednn=False``)."""
        if not self.onednn:
            return nn.functional.linear(x, self.weight_unpacked, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.ensure_packed(), self.bias, "none", [], "")

    def extra_repr(self) -> str:
        extra = f", {self.lowbit.fmt} codes for rows<={self.lowbit_max_rows}" if self.lowbit_max_rows else ""
        if self.lowbit_invariant:
            kernel = "integer" if self.lowbit_i8_max_rows else "float32"
            extra = f", batch-invariant: {self.lowbit.fmt} codes ({kernel} low-bit kernel) for every step size"
        elif self.lowbit_i8_max_rows:
            extra += f", int8 activations x {self.lowbit.fmt} codes for rows<={self.lowbit_i8_max_rows}"
        state = "plain (no oneDNN bfloat16)" if not self.onednn else \
            "oneDNN" if self.packed_weight is not None else "oneDNN (pending)"
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, "
                f"packed={state}{extra}")


def pack_linear_weights(model: nn.Module, include_layers: bool = True, background: bool = False) -> int:
    """Replace every CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place.

    ``background=True`` returns at once and packs the layers in a daemon thread (oneDNN's reorder
    releases the GIL): the start-up does not wait for it (~1 s for SmolLM2-135M on the 2-core
    machine). A layer that is needed on the packed path before the thread reached it is packed
    right then by the caller (:meth:`PackedLinear.ensure_packed`), so results never depend on the
    timing; small steps that run on the low-bit codes do not need the packed weight at all.
    :func:`wait_for_packing` joins the thread.

    ``include_layers=False`` packs only the LM head: the compiled step
    (``torch.compile`` of the decoder blocks) passes weights as graph inputs,
    and Inductor lowers ``_linear_pointwise`` only for frozen (constant)
    weights.

    The original weights are released. A model with a tied LM head (which
    reads the embedding table, so it is no ``nn.Linear``) gets a packed copy
    through its ``set_logits_head`` method, if it has one. Does nothing (and
    returns 0) where :func:`packed_linear_available` is False, except for a
    bfloat16 model where oneDNN has no bfloat16 (:func:`plain_bf16_wrap`): its
    layers are wrapped with their plain weights (``onednn=False``, nothing to
    pack) so that low-bit codes can be attached.

    Returns:
        The number of layers packed (the LM head included).
    """
    params = list(model.parameters())
    if not params:
        return 0
    p0 = params[0]
    onednn = packed_linear_available(p0.device, p0.dtype)
    if not onednn and not plain_bf16_wrap(p0.device, p0.dtype):
        return 0
    if not onednn:
        background = False          # nothing to pack
    count, layers = 0, []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (include_layers or child is getattr(model, "lm_head", None)):
                layers.append(PackedLinear(child.weight, child.bias, defer=background, onednn=onednn))
                setattr(parent, name, layers[-1])
                count += 1
    tied = getattr(model, "tied_logits_weight", None)
    head = tied() if tied is not None else None
    if head is not None and hasattr(model, "set_logits_head") and getattr(model, "_logits_head", None) is None:
        layers.append(PackedLinear(head, defer=background, onednn=onednn))
        model.set_logits_head(layers[-1])
        count += 1
    if not onednn:
        logger.info("wrapped %d bfloat16 linear layers with their plain weights (oneDNN has no bfloat16 on this "
                    "CPU): they run the low-bit codes where the checkpoint has them, else F.linear", count)
        return count
    if not background:
        logger.info("packed %d linear layers for oneDNN (%s)", count, p0.dtype)
        return count

    def pack_all() -> None:
        t0 = time.perf_counter()
        for layer in layers:
            layer.ensure_packed()
        logger.info("packed %d linear layers for oneDNN (%s) in the background in %.1f s", len(layers), p0.dtype,
                    time.perf_counter() - t0)

    thread = threading.Thread(target=pack_all, name="tokenmill-onednn-pack", daemon=True)
    _PACKING_THREADS[id(model)] = thread
    logger.info("packing %d linear layers for oneDNN (%s) in the background", count, p0.dtype)
    thread.start()
    return count


def _join_packing_threads() -> None:
    """At interpreter exit, let background packing finish first: a daemon thread still inside a oneDNN
    reorder while Python finalizes aborts the process ("terminate called without an active exception",
    exit status 134 after a short ``tokenmill generate``). Packing is seconds at most."""
    for thread in list(_PACKING_THREADS.values()):
        thread.join()


atexit.register(_join_packing_threads)


def wait_for_packing(model: nn.Module, timeout: float | None = None) -> bool:
    """Wait until :func:`pack_linear_weights` (``background=True``) has packed every layer of ``model``.

    Returns:
        True when no packing is running for ``model`` any more.
    """
    thread = _PACKING_THREADS.get(id(model))
    if thread is None:
        return True
    thread.join(timeout)
    if thread.is_alive():
        return False
    _PACKING_THREADS.pop(id(model), None)
    return True


def lowbit_max_tokens(device: torch.device | str, dtype: torch.dtype, switches: CpuKernelSwitches | None = None) -> int:
    """Largest step (tokens) whose linears use the checkpoint's low-bit codes; 0 when that path is off.

    On for float32 and bfloat16 CPU models with oneDNN packing (or a bfloat16 model's plain wrapped
    linears where oneDNN has no bfloat16: :func:`plain_bf16_wrap`) and the low-bit kernel available;
    ``switches.int4_max_tokens`` (``TOKENMILL_CPU_INT4_MAX_TOKENS``, default 8, ``0`` off) sets the limit.
    The rule is :func:`tokenmill.kernel_plan.lowbit_limit`, which the engine's kernel plan applies; this is
    it for one device and dtype, ``switches`` None meaning the environment's.

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    sw = switches if switches is not None else CpuKernelSwitches.from_env()
    wrapped = packed_linear_available(device, dtype, sw) or plain_bf16_wrap(device, dtype, sw)
    if not sw.int4_max_tokens or not wrapped:
        return 0
    facts = CpuFacts(lowbit_kernel=sw.lowbit_kernel and kernel_available())
    return kernel_plan.lowbit_limit("cpu", str(dtype).removeprefix("torch."), sw, facts)


INVARIANT_KERNEL_ENV = "TOKENMILL_CPU_INVARIANT_KERNEL"


def invariant_kernel_from_env() -> str:
    """The low-bit kernel every step size runs in batch-invariant mode: ``int8`` (default) or ``float32``.

    ``int8``: the integer path (activations quantised to int8 per row and 32-column block, exact integer
    dot products with the codes; llama.cpp's scheme for its Q8 activations). Fastest at every step size
    (VNNI/AVX-512BW/AVX2 byte multiply-adds reach 2-4x the float32 FMA rate) and invariant by construction;
    its error against the dequantised float32 GEMM is the activations' rounding (the real model's logits
    within 0.2 of their range, ``tests/model/test_gguf.py::test_integer_lowbit_path_logits_on_smollm2``).
    ``float32``: the float32 low-bit path (within 1e-4 of the dequantised reference, slower from ~16 rows).
    Set by ``TOKENMILL_CPU_INVARIANT_KERNEL``.
    """
    return envs.get(INVARIANT_KERNEL_ENV)


INT8_ACT_ENV = "TOKENMILL_CPU_INT8_ACT_MAX_TOKENS"
#: Per kernel ISA variant, what ``TOKENMILL_CPU_INT8_ACT_MAX_TOKENS=auto`` means (tokenmill/kernel_plan.py).
INT8_ACT_AUTO = kernel_plan.INT8_ACT_AUTO


def int8_act_max_tokens(lowbit_limit: int, switches: CpuKernelSwitches | None = None) -> int:
    """Largest step (tokens) whose linears run the integer low-bit path (int8 activations x the codes).

    Steps of ``lowbit_limit + 1`` up to this many tokens use it; 0: off (they run the dense GEMM).
    ``switches.int8_act_max_tokens`` (``TOKENMILL_CPU_INT8_ACT_MAX_TOKENS``): ``auto`` (default:
    :data:`INT8_ACT_AUTO` for the kernel ISA in use: on for AVX2), a token count, or ``0``. Needs the
    low-bit path (``lowbit_limit > 0``). The rule is :func:`tokenmill.kernel_plan.int8_act_limit`;
    ``switches`` None: the environment's.

    Raises:
        ValueError: the variable is neither ``auto`` nor a non-negative integer.
    """
    sw = switches if switches is not None else CpuKernelSwitches.from_env()
    if not lowbit_limit:
        return 0
    try:
        isa = cpu_isa()
    except ValueError:
        isa = None
    return kernel_plan.int8_act_limit(lowbit_limit, isa, sw)


def attach_lowbit_weights(model: nn.Module, weights: dict[str, LowBitWeight], max_rows: int,
                          i8_max_rows: int | None = None, invariant: bool = False,
                          invariant_kernel: str | None = None) -> tuple[int, dict[str, int]]:
    """Give every :class:`PackedLinear` of ``model`` named in ``weights`` its low-bit copy.

    ``model.embed_tokens`` codes serve a tied logits head (``_logits_head``).
    Logs the layers and bytes per format.

    Args:
        weights: module name -> :class:`LowBitWeight` (e.g. from
            :func:`tokenmill.quantization.gguf.gguf_lowbit_weights`).
        max_rows: inputs of at most this many rows use the codes (float32 path).
        i8_max_rows: larger inputs up to this many rows use the integer path; None:
            :func:`int8_act_max_tokens`.
        invariant: batch-invariant mode (see :meth:`PackedLinear.attach_lowbit`): one kernel over the
            codes for every step size.

    Returns:
        ``(layers, bytes per format)`` attached.
    """
    weights = dict(weights)
    if isinstance(getattr(model, "_logits_head", None), PackedLinear) and "model.embed_tokens" in weights:
        weights.setdefault("_logits_head", weights["model.embed_tokens"])
    if i8_max_rows is None:
        i8_max_rows = int8_act_max_tokens(max_rows)
    count, i8_count, by_fmt = 0, 0, {}
    for name, mod in model.named_modules():
        if name in weights and isinstance(mod, PackedLinear):
            w = weights[name]
            by_fmt[w.fmt] = by_fmt.get(w.fmt, 0) + mod.attach_lowbit(w, max_rows, i8_max_rows, invariant,
                                                                           invariant_kernel)
            count += 1
            i8_count += bool(mod.lowbit_i8_max_rows)
    if count:
        logger.info("low-bit weights for %d linear layers (steps of <= %d tokens): %s", count, max_rows,
                    ", ".join(f"{f} {b / 2**20:.1f} MiB" for f, b in sorted(by_fmt.items())))
    if invariant and count:
        logger.info("batch-invariant linears: %d layers on the low-bit codes at every step size (%d on the integer "
                    "low-bit kernel, the others on the float32 one; %s=%s; --no-batch-invariant: steps over %d "
                    "tokens on the %s)", count, i8_count, INVARIANT_KERNEL_ENV,
                    invariant_kernel if invariant_kernel is not None else invariant_kernel_from_env(), max_rows,
                    "integer low-bit path" if i8_max_rows else "dense oneDNN GEMM")
    elif i8_count:
        logger.info("integer low-bit path (int8 activations per 32 columns x the codes) for %d linear layers, "
                    "steps of %d..%d tokens (%s)", i8_count, max_rows + 1, i8_max_rows, INT8_ACT_ENV)
    return count, by_fmt
