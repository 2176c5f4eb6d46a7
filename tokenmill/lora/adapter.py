"""Loading and validating a PEFT LoRA adapter folder for a tokenmill base model.

LoRA (Hu et al., arXiv 2106.09685, §4.1): a frozen linear ``y = x Wᵀ`` gains a low-rank
update ``y += s · (x Aᵀ) Bᵀ`` with ``A`` ``[r, in]``, ``B`` ``[out, r]`` and the scale
``s = lora_alpha / r``; rsLoRA (Kalajdzievski, arXiv 2312.03732, §3) uses
``s = lora_alpha / sqrt(r)``. PEFT writes an adapter as ``adapter_config.json`` plus
``adapter_model.safetensors`` with tensors named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``.

What is served: ``q/k/v/o_proj`` and ``gate/up/down_proj`` of every decoder layer, any rank
up to ``--max-lora-rank`` (per module, PEFT's ``rank_pattern``/``alpha_pattern`` included).
What is refused, by name, never silently ignored: DoRA (``use_dora``, magnitude vectors),
trained biases (``bias`` other than ``"none"``, ``lora_bias``), ``modules_to_save`` (full
copies of e.g. ``embed_tokens``/``lm_head``), embedding or LM-head adapters
(``lora_embedding_A``, ``lm_head``), other PEFT types, and any tensor this loader does not
know. Validation names the file and the tensor: a missing or corrupt file, a rank above the
limit, a target the base lacks (a layer index past the model, a module it does not have), a
shape that does not match the base (an adapter trained for another base model).

Torch and safetensors only; the runner's :class:`~tokenmill.lora.manager.LoRAManager` calls
:func:`load_adapter` off the engine loop.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

#: the targets this engine serves, PEFT module name -> (block, the fused layer it lives in, slice index)
TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
#: module names refused by name when an adapter targets them
UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head", "embed", "wte", "norm")

_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+?)\."
                     r"lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter folder that cannot be served; the message names the file and what is wrong."""


@dataclass
class LoRAWeights:
    """One target module's update: ``delta = (x @ a.T) @ b.T`` (the scale is folded into ``b``).

    Attributes:
        a: ``[rank, in_features]``.
        b: ``[out_features, rank]``, already multiplied by the scale.
        scale: the ``lora_alpha / r`` (or rsLoRA ``/ sqrt(r)``) factor that was folded in.
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """A validated adapter in CPU memory, in the base model's dtype.

    Attributes:
        path: the folder it came from.
        rank: the largest module rank.
        modules: ``(layer index, PEFT module name)`` -> :class:`LoRAWeights`.
        base_model_name: ``base_model_name_or_path`` from its config (informational).
    """

    path: str
    rank: int
    modules: dict[tuple[int, str], LoRAWeights] = field(default_factory=dict)
    base_model_name: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held by the A and B matrices."""
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
                   for w in self.modules.values())


def module_shapes(arch) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each target for a :class:`ModelArchConfig` ``arch``."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv, inter = arch.num_key_value_heads * arch.head_dim, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _pattern_value(pattern: dict, module_key: str, default):
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: the first key that matches the module's full name
    as a regular expression anchored at a dot boundary and the end, else ``default``."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_key):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    """The folder's ``adapter_config.json`` checked for what this engine serves.

    Raises:
        LoRAAdapterError: missing folder or file, invalid JSON, or an unsupported option (named).
    """
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter folder {path!r} does not exist")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAAdapterError(f"{cfg_path}: missing (a PEFT adapter folder has adapter_config.json and "
                               "adapter_model.safetensors)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{cfg_path}: not a readable JSON file ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{cfg_path}: expected a JSON object")
    ptype = str(cfg.get("peft_type", "LORA")).upper()
    if ptype != "LORA":
        raise LoRAAdapterError(f"{cfg_path}: peft_type {ptype} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"{cfg_path}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in ("none", None) or cfg.get("lora_bias"):
        raise LoRAAdapterError(f"{cfg_path}: trained biases (bias={cfg.get('bias')!r}, lora_bias="
                               f"{cfg.get('lora_bias')!r}) are not supported; only bias='none'")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"{cfg_path}: modules_to_save {cfg['modules_to_save']} (full trained copies of "
                               "base modules) are not supported")
    if cfg.get("layer_replication"):
        raise LoRAAdapterError(f"{cfg_path}: layer_replication is not supported")
    if cfg.get("target_parameters"):
        raise LoRAAdapterError(f"{cfg_path}: target_parameters {cfg['target_parameters']} are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        bad = [t for t in targets if t not in TARGETS]
        if bad:
            kind = ("embeddings / LM head are" if any(b in UNSUPPORTED_TARGETS for b in bad)
                    else "they are not")
            raise LoRAAdapterError(f"{cfg_path}: target_modules {bad} are not supported ({kind} not served; "
                                   f"supported: {', '.join(TARGETS)})")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if v is not None and (not isinstance(v, (int, float)) or v <= 0):
            raise LoRAAdapterError(f"{cfg_path}: {key} must be a positive number, got {v!r}")
    return cfg


def load_adapter(path: str, arch, max_rank: int, dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read, validate and convert a PEFT LoRA adapter for the base model described by ``arch``.

    Args:
        path: adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
        arch: the base's :class:`~tokenmill.model.arch_config.ModelArchConfig` (layers and shapes).
        max_rank: ``--max-lora-rank``: every module's rank must be at most this.
        dtype: the base model's dtype; A and the scaled B are stored in it.

    Returns:
        the :class:`LoRAAdapter` (CPU tensors).

    Raises:
        LoRAAdapterError: see the module docstring; the message names the file (and the tensor).
    """
    cfg = read_adapter_config(path)
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st_path):
        alt = os.path.join(path, "adapter_model.bin")
        hint = " (adapter_model.bin found: re-save with safe_serialization=True)" if os.path.isfile(alt) else ""
        raise LoRAAdapterError(f"{st_path}: missing{hint}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(st_path, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAAdapterError(f"{st_path}: not a readable safetensors file ({e})") from None
    if not tensors:
        raise LoRAAdapterError(f"{st_path}: holds no tensors")
    shapes = module_shapes(arch)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if "lora_embedding" in name or "embed_tokens" in name:
            raise LoRAAdapterError(f"{st_path}: tensor {name!r}: embedding adapters are not supported")
        if "lm_head" in name:
            raise LoRAAdapterError(f"{st_path}: tensor {name!r}: LM head adapters are not supported")
        if "lora_magnitude_vector" in name:
            raise LoRAAdapterError(f"{st_path}: tensor {name!r}: DoRA adapters are not supported")
        m = _KEY_RE.match(name)
        if m is None:
            raise LoRAAdapterError(f"{st_path}: tensor {name!r} is not a LoRA A/B weight of a decoder layer "
                                   f"target ({', '.join(TARGETS)})")
        layer, block, mod, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if mod not in TARGETS or TARGETS[mod][0] != block:
            raise LoRAAdapterError(f"{st_path}: tensor {name!r}: target {block}.{mod} is not supported "
                                   f"(supported: {', '.join(TARGETS)})")
        if layer >= arch.num_hidden_layers:
            raise LoRAAdapterError(f"{st_path}: tensor {name!r}: layer {layer} does not exist in the base model "
                                   f"({arch.num_hidden_layers} layers); is this an adapter for another base?")
        if t.dim() != 2 or not t.is_floating_point():
            raise LoRAAdapterError(f"{st_path}: tensor {name!r} must be a 2-D floating-point matrix, got "
                                   f"{tuple(t.shape)} {t.dtype}")
        pairs.setdefault((layer, mod), {})[which] = t
    alpha0 = cfg.get("lora_alpha", cfg.get("r", 8))
    rslora = bool(cfg.get("use_rslora"))
    adapter = LoRAAdapter(path=path, rank=0, base_model_name=cfg.get("base_model_name_or_path"))
    for (layer, mod), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise LoRAAdapterError(f"{st_path}: layers.{layer}.{mod} has no lora_{missing} weight")
        a, b = ab["A"], ab["B"]
        r, fan_in = a.shape
        fan_out = b.shape[0]
        want_in, want_out = shapes[mod]
        if b.shape[1] != r:
            raise LoRAAdapterError(f"{st_path}: layers.{layer}.{mod}: lora_A is {tuple(a.shape)} but lora_B is "
                                   f"{tuple(b.shape)} (ranks differ)")
        if (fan_in, fan_out) != (want_in, want_out):
            raise LoRAAdapterError(
                f"{st_path}: layers.{layer}.{mod}: the adapter maps {fan_in} -> {fan_out} features but the base "
                f"model's {mod} maps {want_in} -> {want_out}; this adapter was trained for another base model"
                + (f" ({adapter.base_model_name})" if adapter.base_model_name else ""))
        if r > max_rank:
            raise LoRAAdapterError(f"{st_path}: layers.{layer}.{mod} has rank {r}, above --max-lora-rank "
                                   f"{max_rank}")
        key = f"model.layers.{layer}.{block_of(mod)}.{mod}"
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), key, alpha0))
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        adapter.modules[(layer, mod)] = LoRAWeights(a=a.to(dtype).contiguous(), b=(b.float() * scale).to(dtype),
                                                    scale=scale)
        adapter.rank = max(adapter.rank, r)
    return adapter


def block_of(mod: str) -> str:
    """``self_attn`` or ``mlp`` for a PEFT target name."""
    return TARGETS[mod][0]
