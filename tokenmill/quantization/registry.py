"""The ``--quantization`` methods, registered once: name, where the codes come from, a one-line summary.

The loader queries this registry (``get_method(name).from_checkpoint``, ``.at_load``) instead of naming
methods; it imports nothing of tokenmill's, so every layer may read it. The weight formats themselves
are in :mod:`tokenmill.quantization.methods` (load-time methods) and
:mod:`tokenmill.quantization.prequantized` (AWQ/GPTQ checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantMethod:
    """One ``--quantization`` value.

    Attributes:
        name: the flag's value (``int8``, ``awq``, ...).
        source: ``"load"`` (dense checkpoint weights quantised when the model loads) or ``"checkpoint"``
            (the checkpoint's own pre-quantised tensors, detected from its ``quantization_config``).
        summary: weights and compute in one line (``docs/guide/quantization.md`` has the detail).
    """

    name: str
    source: str
    summary: str

    @property
    def at_load(self) -> bool:
        """True for methods applied to dense weights at load time."""
        return self.source == "load"

    @property
    def from_checkpoint(self) -> bool:
        """True for methods that read a pre-quantised checkpoint's own codes."""
        return self.source == "checkpoint"


_REGISTERED = (
    QuantMethod("int8", "load", "int8 weights, one scale per output channel; float activations"),
    QuantMethod("w8a8", "load", "int8 weights per channel and per-token int8 activations (needs VNNI on CPU)"),
    QuantMethod("int4", "load", "4-bit codes with a scale and minimum per group of 32 inputs (or larger)"),
    QuantMethod("awq", "checkpoint", "an AutoAWQ checkpoint's 4-bit tensors, kept as codes"),
    QuantMethod("gptq", "checkpoint", "a GPTQ checkpoint's 4-bit tensors, kept as codes"),
)
#: name -> method, in flag order.
REGISTRY: dict[str, QuantMethod] = {m.name: m for m in _REGISTERED}
#: every ``--quantization`` value.
METHODS: tuple[str, ...] = tuple(REGISTRY)


def get_method(name: str) -> QuantMethod:
    """The registered method ``name``.

    Raises:
        ValueError: ``name`` is not a registered method (the message lists them).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown quantization {name!r}; choose one of {', '.join(METHODS)}") from None
