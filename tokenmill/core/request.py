"""A request as the engine core sees it: token ids, progress and timestamps.

The one scheduling invariant (docs/architecture.md): every request has ``num_tokens``
(prompt + generated so far) and ``num_computed_tokens`` (how many of them have
K/V in the cache). Each step the scheduler hands out tokens so requests catch
up; a request samples a new token when a step brings ``num_computed_tokens``
to ``num_tokens``.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Life cycle of a request inside the engine core."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, stop token id, or stop string (set by the front end)
    FINISHED_LENGTH = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5  # client went away or asked to abort
    FINISHED_ERROR = 6  # rejected: can never fit, or failed
    WAITING_FOR_REMOTE_KVS = 7  # its prompt's KV is being loaded by a KV connector (P/D disaggregation)
    WAITING_FOR_FSM = 8  # its structured-output grammar is being compiled (off the engine loop)

    @property
    def finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason``: 'stop', 'length', 'abort', 'error', or None while unfinished."""
        return {3: "stop", 4: "length", 5: "abort", 6: "error"}.get(int(self))


class Request:
    """One sequence in the engine core.

    Args:
        request_id: unique id (the front end's).
        prompt_token_ids: prompt, ``[num_prompt_tokens]`` ints.
        sampling_params: validated :class:`SamplingParams` (``n`` is expanded
            by the front end; here every request yields one sequence).
        eos_token_id: the model's end-of-sequence id, or None.
        arrival_time: wall-clock seconds (``time.time()``) when it arrived.
        priority: lower is served sooner under the priority policy (ties by
            arrival); also orders preemption victims.
        cache_salt: extra key mixed into every block hash so that requests
            with different salts never share cached blocks.
        max_tokens: resolved cap on new tokens (sampling_params.max_tokens or
            what the context length leaves).
        batch: a batch-lane request (``service_tier: "batch"``): it is
            scheduled only with the capacity interactive requests leave and
            is preempted before any of them.
        lora_request: the LoRA adapter (:class:`tokenmill.lora.request.LoRARequest`, duck-typed:
            ``lora_int_id``, ``lora_name``, ``lora_path``), None for the base model. Its id joins
            the block hashes (adapters never share cached blocks) and the step's adapter set.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        batch: bool = False,
        lora_request: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.batch = batch
        self.lora_request = lora_request
        # LoRA: when the request first waited for an adapter slot or load (aging; None: never)
        self.lora_wait_since: float | None = None
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when first scheduled (-1: not yet scheduled).
        self.num_cached_tokens = -1
        # Chained hashes of the full blocks of all_token_ids, filled by the KV cache manager.
        self.block_hashes: list[Any] = []
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Timestamps (time.time() seconds).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # Prompt logprobs gathered chunk by chunk (entry j: prompt token j + 1), None when not asked
        # for or already sent with the first output.
        self.prompt_logprobs: list[Any] | None = [] if sampling_params.prompt_logprobs is not None else None
        # Draft tokens proposed for the next step (speculative decoding); never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        # True when spec_token_ids are grammar-forced tokens (structured outputs), not a proposer's drafts.
        self.spec_forced = False
        # KV connector (P/D disaggregation): prompt tokens whose K/V is being / was loaded from another
        # engine, whether that load already ran (success or not), and the params returned to the client.
        self.num_external_tokens = 0
        self.kv_load_attempted = False
        self.kv_transfer_params_out: dict[str, Any] | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt logprobs are asked for and not complete (the prompt must be computed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    # -- sizes ---------------------------------------------------------------
    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens so far."""
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append newly sampled token id(s) to the output and the full sequence."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
