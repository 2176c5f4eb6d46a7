"""Offline batch inference: ``LLM(...).generate(prompts, params)``.

Runs the same :class:`~tokenmill.engine.engine_core.EngineCore` as the server,
in-process, so the scheduler, KV cache and batching are identical.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tokenmill.config import EngineConfig, bound_gemm_shape_caches
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
from tokenmill.engine.output_processor import OutputProcessor, child_params
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

PromptType = str | list[int]


class LLM:
    """An engine for offline generation.

    Args:
        model: GGUF file or Hugging Face folder; None for the packaged
            SmolLM2-135M-Instruct.
        **engine_kwargs: any field of the config sections, by vLLM's names
            (``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
            ``num_kv_blocks``, ``kv_cache_memory``, ``enable_prefix_caching``,
            ``dtype``, ``device``, ``max_model_len``, ``seed``, ...).

    Raises:
        TypeError: an unknown keyword argument.
        ValueError, FileNotFoundError: bad config or model path.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
        bound_gemm_shape_caches()   # as `tokenmill serve` does: bounded RSS under mixed step shapes
        self.engine_core = EngineCore(self.config)
        loaded = self.engine_core.executor.loaded
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor/pipeline parallel executors); idempotent.

        They also stop when the ``LLM`` is garbage-collected or the interpreter exits.
        """
        self.engine_core.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def get_tokenizer(self):
        """The checkpoint's Hugging Face tokenizer."""
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched continuously.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt
                (default: ``SamplingParams()``).
            priority: per-prompt priority (priority policy only).
            cache_salt: prefix-cache salt applied to every prompt.
            lora_request: a :class:`tokenmill.lora.request.LoRARequest` for every prompt, or one per
                prompt (None entries: the base model); needs ``enable_lora=True``.

        Returns:
            one :class:`RequestOutput` per prompt, in order, with full texts,
            token ids, finish reasons and timings. A prompt that can never fit
            gets ``finish_reason == 'error'`` and ``error`` set; the others
            still run.

        Raises:
            ValueError: mismatched lengths, an empty prompt, or token ids
                outside the vocabulary.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        prio = list(priority) if priority is not None else [0] * len(prompts)
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        ids: list[str] = []
        for prompt, params, p, lr in zip(prompts, params_list, prio, loras):
            ids.append(self._add(prompt, params, p, cache_salt, lr))
        self._run_until_done(ids)
        results = [self.processor.final_output(rid) for rid in ids]
        for rid in ids:
            self.processor.remove_request(rid)
        return results

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.chat_template) for c in convs]
        return self.generate([self.tokenizer.encode(p, add_special_tokens=False) for p in prompts], sampling_params)

    # -- internals ---------------------------------------------------------------
    def _add(self, prompt: PromptType, params: SamplingParams, priority: int, cache_salt: str | None,
             lora_request: Any = None) -> str:
        rid = str(next(self._counter))
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            vocab = self.engine_core.executor.arch.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        child_ids = self.processor.add_request(rid, text, token_ids, params)
        for i, cid in enumerate(child_ids):
            self.engine_core.add_request(EngineCoreRequest(cid, token_ids, child_params(params, i),
                                                           priority=priority, cache_salt=cache_salt,
                                                           lora_request=lora_request))
        return rid

    def _run_until_done(self, ids: list[str]) -> None:
        pending = set(ids)
        while pending:
            if not self.engine_core.has_unfinished_requests():
                raise RuntimeError("engine idle while requests are unfinished")  # a bug, never expected
            deltas, stop_ids = self.processor.process_outputs(self.engine_core.step())
            if stop_ids:
                self.engine_core.stop_requests(stop_ids)
            for d in deltas:
                if d.finished:
                    pending.discard(d.request_id)


__all__ = ["LLM", "CompletionOutput", "RequestOutput"]
