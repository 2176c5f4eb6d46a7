"""Read Hugging Face checkpoint folders: ``config.json`` and ``*.safetensors``."""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Iterator

import torch

from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.model.registry import normalize_architecture

logger = logging.getLogger(__name__)


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_hf_config(folder: str) -> ModelArchConfig:
    """Build a :class:`ModelArchConfig` from ``folder/config.json`` (and ``generation_config.json`` for EOS ids).

    Accepts both the classic ``rope_theta``/``rope_scaling`` keys and the
    newer ``rope_parameters`` dict.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: unsupported architecture (the message lists the supported ones).
    """
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)")
    c = _read_json(cfg_path)
    archs = c.get("architectures") or [c.get("model_type", "<missing>")]
    arch = normalize_architecture(archs[0])
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    rope_params = dict(c.get("rope_parameters") or {})
    theta = c.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None

    eos = c.get("eos_token_id")
    gen_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen_path):
        g = _read_json(gen_path).get("eos_token_id")
        if g is not None:
            ids = ([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
            for i in ([g] if isinstance(g, int) else g):
                if i not in ids:
                    ids.append(i)
            eos = ids[0] if len(ids) == 1 else ids

    moe = _moe_fields(c, arch, int(c["num_hidden_layers"]))
    max_pos = int(c.get("max_position_embeddings", 2048))
    window = c.get("sliding_window") if c.get("use_sliding_window", arch == "MixtralForCausalLM") else None
    if window and int(window) < max_pos:
        # no sliding-window attention here: cap the context at the window, where full attention is exact
        logger.warning("%s: sliding_window %d < max_position_embeddings %d; tokenmill attends to the whole "
                       "context, so the context is capped at %d tokens", folder, int(window), max_pos, int(window))
        max_pos = int(window)

    weight_names = set(_safetensors_index(folder))
    tie = bool(c.get("tie_word_embeddings", False)) or (bool(weight_names) and "lm_head.weight" not in weight_names)
    return ModelArchConfig(
        architecture=arch,
        num_hidden_layers=int(c["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        vocab_size=int(c["vocab_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        attention_bias=arch == "Qwen2ForCausalLM" or bool(c.get("attention_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=eos,
        **moe,
    )


def _moe_fields(c: dict, arch: str, num_layers: int) -> dict:
    """The mixture-of-experts fields of :class:`ModelArchConfig` from a Mixtral / Qwen3-MoE ``config.json``
    (empty for dense models).

    Mixtral: ``num_local_experts``, ``num_experts_per_tok``, experts of width ``intermediate_size``,
    always renormalised. Qwen3-MoE: ``num_experts`` (``num_local_experts`` as transformers 5 writes it), ``moe_intermediate_size``, ``norm_topk_prob``,
    sparse layers from ``decoder_sparse_step`` and ``mlp_only_layers``.
    """
    if arch == "MixtralForCausalLM":
        return dict(num_experts=int(c.get("num_local_experts", c.get("num_experts", 0))), num_experts_per_tok=int(c["num_experts_per_tok"]),
                    moe_intermediate_size=int(c["intermediate_size"]), norm_topk_prob=True)
    if arch == "Qwen3MoeForCausalLM":
        e = int(c.get("num_experts", c.get("num_local_experts", 0)))   # transformers 5 writes num_local_experts
        step = int(c.get("decoder_sparse_step") or 1)
        dense = set(c.get("mlp_only_layers") or [])
        mask = [i not in dense and e > 0 and (i + 1) % step == 0 for i in range(num_layers)]
        return dict(num_experts=e, num_experts_per_tok=int(c["num_experts_per_tok"]),
                    moe_intermediate_size=int(c["moe_intermediate_size"]),
                    norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                    moe_layer_mask=None if all(mask) else mask)
    return {}


def _safetensors_files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def _safetensors_index(folder: str) -> list[str]:
    """Tensor names across the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    names = []
    for f in _safetensors_files(folder):
        with safe_open(f, framework="pt") as st:
            names.extend(st.keys())
    return names


def iter_hf_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every ``*.safetensors`` file in ``folder`` (checkpoint dtype, CPU).

    Raises:
        FileNotFoundError: the folder has no safetensors file (``.bin``
            pickles are not loaded: they can run arbitrary code).
    """
    from safetensors import safe_open

    files = _safetensors_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights found")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)
