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


from tokenmill.config import LoRAModule, parse_lora_modules  # noqa: E402,F401 - re-export (config owns the flag)
