"""Multi-LoRA serving: many low-rank adapters on one base model, mixed in one batch.

* :mod:`tokenmill.lora.request` — :class:`LoRARequest` / ``--lora-modules`` parsing (torch-free).
* :mod:`tokenmill.lora.adapter` — PEFT adapter folders: loading and validation.
* :mod:`tokenmill.lora.manager` — the runner's adapter manager: CPU cache (LRU), slots, async loads.
* the grouped delta op lives in :mod:`tokenmill.model.layers.lora`.

Guide: ``docs/guide/lora.md``.
"""

from tokenmill.lora.request import LoRAModule, LoRARequest, parse_lora_modules

__all__ = ["LoRAModule", "LoRARequest", "parse_lora_modules"]
