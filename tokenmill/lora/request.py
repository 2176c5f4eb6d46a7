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

import hashlib
import os
from dataclasses import dataclass

#: the files of a PEFT folder whose bytes identify the adapter (:func:`adapter_content_hash`)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_content_hash(path: str) -> str | None:
    """SHA-256 (first 32 hex digits) of the folder's ``adapter_config.json`` and ``adapter_model.safetensors``
    bytes, each preceded by its name and length; None when a file cannot be read (the load will fail and
    say why). Reads the files once (~10 MB for a rank-16 adapter of a 135M model: tens of milliseconds)."""
    h = hashlib.sha256(b"tokenmill-lora-v1")
    try:
        for name in ADAPTER_FILES:
            fp = os.path.join(path, name)
            h.update(name.encode() + os.path.getsize(fp).to_bytes(8, "little"))
            with open(fp, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class LoRARequest:
    """One adapter as requests refer to it.

    Attributes:
        lora_name: the model name clients send (``"model": "sql-lora"``).
        lora_int_id: ``>= 1``, unique per loaded adapter (0 means the base model everywhere).
        lora_path: folder with ``adapter_config.json`` and ``adapter_model.safetensors``.
        base_model_name: the base this adapter claims (vLLM's JSON form), for ``/v1/models``' ``parent``.
        content_hash: :func:`adapter_content_hash` of its folder when it was registered (the server sets
            it), None when unknown (an offline ``LoRARequest`` built by hand).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
    content_hash: str | None = None

    @property
    def prefix_cache_key(self) -> str | int:
        """What block 0's hash carries for this adapter (:func:`tokenmill.core.prefix_cache.block_extra_keys`).

        ``"lora:<name>:<content hash>"`` when the content is known: the same on every server that serves
        the same adapter under the same name (a router can compute the hashes — vLLM keys by the name
        for that reason, vllm-project/vllm#27211 — and prefill/decode servers agree), yet different for a
        different adapter loaded under an old name, or after a server restart (the disk KV tier persists).
        Else the id: unique within this server's life, but known only to it.
        """
        if self.content_hash:
            return f"lora:{self.lora_name}:{self.content_hash}"
        return int(self.lora_int_id)

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty name")


from tokenmill.config import LoRAModule, parse_lora_modules  # noqa: E402,F401 - re-export (config owns the flag)
