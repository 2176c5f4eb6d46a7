"""Checkpoints on disk: which kind a path is, its architecture, and whether a quantisation method fits it.

Public and light (no weights read, no model built), so that the loader, the executors, the
tensor-parallel shard loader and the CLI's start-up checks share one reader; the quantisation
package stays below the loader (it never imports :mod:`tokenmill.model.loader`).
"""

from __future__ import annotations

import glob
import os

from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.model.default_model import default_model_path
from tokenmill.quantization.registry import get_method

__all__ = ["resolve_checkpoint", "load_arch_config", "check_quantization"]


def resolve_checkpoint(path: str | None) -> tuple[str, str]:
    """``(kind, path)`` of a checkpoint: kind ``"gguf"`` (a ``.gguf`` file, or a folder holding exactly one) or
    ``"hf"`` (a folder with ``config.json``); ``path`` None is the packaged default model.

    Raises:
        ValueError: a file that is not ``.gguf``, or a folder with neither ``config.json`` nor exactly one GGUF.
        FileNotFoundError: the path does not exist.
    """
    if path is None:
        path = default_model_path()
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"{path}: expected a .gguf file or a Hugging Face checkpoint folder")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ValueError(f"{path}: folder has no config.json and {len(ggufs)} .gguf files; pass one file")
    raise FileNotFoundError(f"model path {path!r} does not exist")


def load_arch_config(path: str | None) -> ModelArchConfig:
    """Read only the architecture of a checkpoint (no weights). Raises like :func:`resolve_checkpoint`, or
    ``ValueError`` for an architecture the readers do not know."""
    kind, path = resolve_checkpoint(path)
    if kind == "gguf":
        from tokenmill.model.gguf_loader import open_gguf, read_arch_config

        return read_arch_config(open_gguf(path))
    from tokenmill.model.hf_loader import read_hf_config

    return read_hf_config(path)


def check_quantization(method: str | None, device: str, model_path: str | None = None, *,
                       check_model: bool = False, int4_group: int | None = None) -> None:
    """:func:`tokenmill.quantization.methods.check_method` for a config's device setting (``auto`` -> cuda when
    available), for the CLI; with ``check_model``, also the checkpoint ``model_path`` (None: the default model)
    against the method, reading only its config (no weights), so that a bad combination is one line at
    start-up rather than an engine-core traceback: ``int4`` on layers whose inputs no group of 32..128
    divides, ``awq``/``gptq`` on a checkpoint without that ``quantization_config``, a weight method on an
    AWQ/GPTQ checkpoint.

    Raises:
        ValueError: as ``check_method``, or one of the mismatches above.
    """
    if method is None:
        return
    import torch

    from tokenmill.quantization.methods import check_method, int4_group_for
    from tokenmill.quantization.prequantized import check_quant_config, read_quant_config

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    check_method(method, dev)
    if not check_model:
        return
    try:
        kind, path = resolve_checkpoint(model_path)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    qcfg = read_quant_config(path) if kind == "hf" else None
    ckpt_method = check_quant_config(qcfg) if qcfg is not None else None
    if get_method(method).from_checkpoint and ckpt_method != method:
        raise ValueError(f"--quantization {method} needs a checkpoint with a {method} quantization_config; "
                         f"{path} has " + (f"a {ckpt_method} one" if ckpt_method else "none"))
    if ckpt_method is not None and method != ckpt_method:
        raise ValueError(f"{path} is a {ckpt_method} checkpoint; --quantization {method} cannot apply to it")
    if method == "int4":
        arch = load_arch_config(path)
        inputs = {arch.hidden_size, arch.num_attention_heads * arch.head_dim}
        if arch.num_experts == 0:
            inputs.add(arch.intermediate_size)
        for k in sorted(inputs):
            int4_group_for(k, int4_group)
