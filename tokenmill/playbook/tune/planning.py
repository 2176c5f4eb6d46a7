"""What the levers read besides measurements: the capacity plan (:mod:`tokenmill.playbook.plan`) and the
accuracy report."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenmill.playbook.tune.flags import serve_defaults, flags_to_argv
from tokenmill.playbook.tune.settings import TuneSettings
from tokenmill.config import parse_size
from tokenmill.playbook.plan import QUANTIZATIONS, PlanOptions, default_model_path, plan, load_shape


def load_accuracy_report(path: str | None) -> dict[str, dict[str, Any]]:
    """``benchmarks/quant_accuracy.py --json`` output (a list of per-format dicts) keyed by format label.

    Raises:
        ValueError: the file is not such a list.
    """
    if not path:
        return {}
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "format" in r for r in rows):
        raise ValueError(f"{path}: expected the JSON list written by benchmarks/quant_accuracy.py --json")
    return {str(r["format"]): r for r in rows}


def plan_capacity(settings: TuneSettings, flags: dict[str, Any], prompt_len: float | None,
                  output_len: float | None) -> dict[str, Any] | None:
    """:func:`tokenmill.playbook.plan.plan` for the trial's flags and the workload's mean lengths, as a dict.

    None when the model cannot be planned (e.g. a fake server in tests without a model path).
    """

    vals = serve_defaults(settings.base_serve_args + flags_to_argv(
        {k: v for k, v in flags.items() if k in ("kv_cache_memory", "max_num_seqs", "block_size", "kv_cache_dtype")}))
    path = settings.model or default_model_path()
    if path is None or prompt_len is None:
        return None
    try:
        shape = _cached_shape(path)
        dtype = vals.get("dtype", "auto")
        if dtype == "auto":
            dtype = _engine_auto_dtype()
        # the engine's KV dtype (auto: bfloat16 for a float32 model on the CPU low-bit path) and sharding
        device = str(vals.get("device") or "auto").split(":")[0]
        opts = PlanOptions(dtype=dtype, kv_cache_dtype=vals.get("kv_cache_dtype") or "auto",
                           device=_engine_device() if device == "auto" else device,
                           quantization=vals.get("quantization") if vals.get("quantization") in QUANTIZATIONS else None,
                           tensor_parallel_size=int(vals.get("tensor_parallel_size") or 1),
                           pipeline_parallel_size=int(vals.get("pipeline_parallel_size") or 1),
                           kv_cache_memory=parse_size(vals.get("kv_cache_memory")) or (1 << 30),
                           block_size=int(vals.get("block_size") or 16), max_model_len=vals.get("max_model_len"),
                           prompt_len=int(round(prompt_len)), output_len=int(round(output_len or 0)),
                           context_lengths=[])
        if vals.get("num_kv_blocks"):
            return None
        return plan(shape, opts).to_dict()
    except (ValueError, FileNotFoundError):
        return None


@functools.lru_cache(maxsize=4)
def _cached_shape(path: str):
    return load_shape(path)


@functools.lru_cache(maxsize=1)
def _engine_device() -> str:
    """What ``--device auto`` becomes in the engine on this machine (cuda when torch sees one, else cpu)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=1)
def _engine_auto_dtype() -> str:
    """What ``--dtype auto`` becomes in the engine on this machine (its own rule: bfloat16 on CUDA and on CPUs
    with native bfloat16, else float32)."""
    import torch

    from tokenmill.model.loader import resolve_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return str(resolve_dtype("auto", device)).replace("torch.", "")
