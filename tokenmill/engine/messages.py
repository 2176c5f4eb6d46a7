"""The messages between the API process and the engine core: typed msgspec structs, encoded as MessagePack.

Every message on the two ZMQ sockets of :mod:`tokenmill.engine.core_proc` is one of the structs below (a
tagged union per direction, so the receiver decodes straight into the right type and a message of an
unknown kind or with a field of the wrong type is refused with :class:`msgspec.ValidationError` instead of
being unpickled). Payloads are the engine's own plain dataclasses (:class:`EngineCoreRequest`,
:class:`EngineCoreOutput`, :class:`EngineStats` and what it holds), which msgspec encodes field by field
and decodes by their annotations (``__post_init__`` runs again on the receiving side, so a request's
:class:`SamplingParams` is validated there too). Both ends run the same code; nothing here is versioned.

API process -> engine core (:data:`CoreInput`)::

    AddRequest(request)            a tokenized request (one per choice when n > 1)
    AbortRequests(request_ids)     abort them wherever they are
    StopRequests(request_ids)      finish them as 'stop' (the front end matched a stop string)
    ReleaseKV(holds)               free KV kept for consumers that will not come: [(engine_id | None, request_id)]
    CheckInvariants(token)         answered at once with Invariants(token, report)
    LoadLoRA(token, lora_request)  answered with LoRALoaded(token, error | None) once loaded, off the step loop
    UnloadLoRA(lora_int_id)
    Wake(n)                        experts shared across data-parallel cores: the n-th request was added
    Shutdown()

engine core -> API process (:data:`CoreOutput`)::

    Ready(info)                              once, after the model loaded (:class:`CoreInfo`)
    Outputs(outputs, stats, num_adds)        after every step (and after inputs that change the idle state)
    Invariants(token, report)
    LoRALoaded(token, error)
    Error(message)                           right before the core exits because of an exception
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

from tokenmill.core.sched_output import EngineCoreOutput
from tokenmill.engine.engine_core import EngineCoreRequest
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import EngineStats


@dataclass
class CoreInfo:
    """What the core reports once it is ready (the start-up handshake).

    Attributes:
        max_model_len: context limit in tokens (prompt + output) the core resolved.
        num_kv_blocks: KV cache pool size in blocks.
        block_size: tokens per KV block.
        eos_token_ids: the model's end-of-sequence ids.
        pid: the core process id.
        num_threads: torch intra-op threads of the core (0 if torch is not loaded).
        load_time: seconds spent building the engine core (model load included).
        parallel: the executor's one-line layout (``describe()``; e.g. the experts a core holds
            when data-parallel cores share them), empty when it has none.
        stats: the idle core's first stats (queue state, and the step-time model seeded by the
            ``--slo`` start-up profile), so admission has a basis before any step ran; None: none.
        profile_time: seconds the start-up step-time profile took (0: none, or from the cache).
    """

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    pid: int = 0
    num_threads: int = 0
    load_time: float = 0.0
    parallel: str = ""
    stats: EngineStats | None = None
    profile_time: float = 0.0


# --- API process -> engine core ------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True, frozen=True):
    """Add a tokenized request."""

    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, frozen=True):
    """Abort these requests (their KV blocks return to the pool)."""

    request_ids: list[str]


class StopRequests(msgspec.Struct, tag="stop", array_like=True, frozen=True):
    """Finish these requests as 'stop'."""

    request_ids: list[str]


class ReleaseKV(msgspec.Struct, tag="release_kv", array_like=True, frozen=True):
    """Free the KV a producer keeps for consumers: ``(engine_id or None for any, request_id)`` pairs."""

    holds: list[tuple[Union[str, None], str]]


class CheckInvariants(msgspec.Struct, tag="check_invariants", array_like=True, frozen=True):
    """Check the core's bookkeeping; answered with :class:`Invariants` carrying ``token``."""

    token: int


class LoadLoRA(msgspec.Struct, tag="load_lora", array_like=True, frozen=True):
    """Load and validate an adapter off the step loop; answered with :class:`LoRALoaded` carrying ``token``."""

    token: int
    lora_request: LoRARequest


class UnloadLoRA(msgspec.Struct, tag="unload_lora", array_like=True, frozen=True):
    """Forget an adapter once no queued or running request uses it."""

    lora_int_id: int


class Wake(msgspec.Struct, tag="wake", array_like=True, frozen=True):
    """The API process's ``n``-th request was added (to this core or a peer): join the next wave."""

    n: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, frozen=True):
    """Exit the core loop."""


CoreInput = Union[AddRequest, AbortRequests, StopRequests, ReleaseKV, CheckInvariants, LoadLoRA, UnloadLoRA,
                  Wake, Shutdown]


# --- engine core -> API process ------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    """The core loaded the model and serves."""

    info: CoreInfo


class Outputs(msgspec.Struct, tag="outputs", array_like=True, frozen=True):
    """One step's outputs, the core's stats, and how many :class:`AddRequest` it has received so far."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    num_adds: int


class Invariants(msgspec.Struct, tag="invariants", array_like=True, frozen=True):
    """The answer to :class:`CheckInvariants` (``report``: :meth:`EngineCore.check_invariants`'s dict)."""

    token: int
    report: dict[str, Any]


class LoRALoaded(msgspec.Struct, tag="lora_loaded", array_like=True, frozen=True):
    """The answer to :class:`LoadLoRA`: None when the adapter loaded, else why not."""

    token: int
    error: Union[str, None]


class Error(msgspec.Struct, tag="error", array_like=True, frozen=True):
    """The core is exiting because of an exception."""

    message: str


CoreOutput = Union[Ready, Outputs, Invariants, LoRALoaded, Error]


def _enc_hook(obj: Any) -> Any:
    # numpy scalars (a stat or id computed with numpy) travel as the Python number they hold
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"cannot encode {type(obj).__name__} in an engine message")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode(msg: CoreInput | CoreOutput) -> bytes:
    """One message as MessagePack bytes.

    Raises:
        TypeError: ``msg`` holds a value msgspec cannot encode (an object that is neither a declared
            struct/dataclass, a builtin container or number, nor a numpy scalar).
    """
    return _encoder.encode(msg)


def decode_input(data: bytes) -> CoreInput:
    """A message the engine core received.

    Raises:
        msgspec.ValidationError: not one of :data:`CoreInput`, or a field of the wrong type.
        msgspec.DecodeError: not MessagePack.
    """
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> CoreOutput:
    """A message the API process received.

    Raises:
        msgspec.ValidationError: not one of :data:`CoreOutput`, or a field of the wrong type.
        msgspec.DecodeError: not MessagePack.
    """
    return _output_decoder.decode(data)
