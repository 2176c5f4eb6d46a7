"""Architecture registry: checkpoint architecture names -> model classes.

Hugging Face checkpoints name their class in ``config.json["architectures"]``;
GGUF files name theirs in ``general.architecture``. Both resolve here, and
anything else fails with a ValueError listing what is supported.
"""

from __future__ import annotations

from torch import nn

from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.mixtral import MixtralForCausalLM
from tokenmill.model.qwen3_moe import Qwen3MoeForCausalLM

# Hugging Face architecture name -> model class.
_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# Mixture-of-experts architectures (their configs carry num_experts > 0).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")

# GGUF ``general.architecture`` / HF ``model_type`` -> Hugging Face architecture name.
_ALIASES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",       # GGUF general.architecture
}


def supported_architectures() -> list[str]:
    """Every accepted name (HF class names and GGUF/model_type aliases), sorted."""
    return sorted(set(_MODELS) | set(_ALIASES))


def normalize_architecture(name: str) -> str:
    """Map a GGUF architecture / ``model_type`` or HF class name to the HF class name.

    Raises:
        ValueError: the name is not supported; the message lists the supported ones.
    """
    if name in _MODELS:
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    raise ValueError(f"unsupported model architecture {name!r}; tokenmill supports: "
                     f"{', '.join(supported_architectures())}")


def get_model_class(name: str) -> type[nn.Module]:
    """The model class for an architecture name (HF class name or GGUF alias).

    Raises:
        ValueError: the architecture is not supported.
    """
    return _MODELS[normalize_architecture(name)]


def register_model(hf_name: str, cls: type[nn.Module], alias: str | None = None) -> None:
    """Add an architecture (e.g. from a plug-in); ``alias`` is its GGUF/model_type name."""
    _MODELS[hf_name] = cls
    if alias:
        _ALIASES[alias] = hf_name
