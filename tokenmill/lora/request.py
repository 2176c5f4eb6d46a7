"""What names an adapter across processes: :class:`LoRARequest` (torch-free, plain data).

The API process owns the name -> adapter table (``--lora-modules`` at start-up, ``POST
/v1/load_lora_adapter`` at run time) and gives every adapter a positive integer id that is never
reused in the server's life (vLLM's ``lora_int_id``). A request carries its adapter's
:class:`LoRARequest` to the engine core: the scheduler keys the step's adapter set, the prefix
cache's block hashes and the KV events by ``lora_int_id``; the model runner loads ``lora_path``
when the adapter is not resident (so an adapter evicted from the CPU cache, or unloaded while
requests of it were in flight, still serves them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter as requests refer to it.

    Attributes:
        lora_name: the model name clients send (``"model": "sql-lora"``).
        lora_int_id: ``>= 1``, unique per loaded adapter (0 means the base model everywhere).
        lora_path: folder with ``adapter_config.json`` and ``adapter_model.safetensors``.
        base_model_name: the base this adapter claims (vLLM's JSON form), for ``/v1/models``' ``parent``.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty name")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(text: str | None) -> list[LoRAModule]:
    """Parse ``--lora-modules`` (entries separated by newlines or spaces; JSON entries may hold spaces).

    Args:
        text: the flag's words joined by newlines (``name=path`` or one JSON object per word).

    Returns:
        the modules in order.

    Raises:
        ValueError: an entry is neither ``name=path`` nor a JSON object with ``name`` and ``path``,
            or two entries share a name.
    """
    if not text:
        return []
    out: list[LoRAModule] = []
    words: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        words.extend([line] if line.startswith("{") else line.split())
    for word in words:
        if word.startswith("{"):
            try:
                d = json.loads(word)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {word!r} is not valid JSON: {e}") from None
            if not isinstance(d, dict) or not d.get("name") or not d.get("path"):
                raise ValueError(f"--lora-modules: a JSON entry needs 'name' and 'path', got {word!r}")
            extra = set(d) - {"name", "path", "base_model_name"}
            if extra:
                raise ValueError(f"--lora-modules: unknown keys {sorted(extra)} in {word!r}")
            out.append(LoRAModule(str(d["name"]), str(d["path"]), d.get("base_model_name")))
        else:
            name, sep, path = word.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {word!r}")
            out.append(LoRAModule(name, path))
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules: adapter names given twice: {dup}")
    return out
