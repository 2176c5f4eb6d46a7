"""Incremental detokenization with stop strings, for streaming.

Two layers turn a growing list of output token ids into text deltas:

1. **Complete characters.** Byte-level BPE tokens can end in the middle of a
   multi-byte UTF-8 character (emoji, CJK); decoding such a sequence ends in
   U+FFFD. A small window of tokens ``ids[prefix:]`` is decoded each step and
   compared with the decode of ``ids[prefix:read]`` (the part already turned into
   text). The extra characters are accepted only when they do not end in
   U+FFFD; then the window slides (``prefix <- read``, ``read <- len(ids)``). The
   tokens before ``read`` give the decoder context (e.g. SentencePiece's leading
   space), so each step decodes a few tokens, not the whole output. The same
   scheme is used by Hugging Face's ``TextStreamer`` and vLLM.
2. **Stop strings.** Accepted text is held back while its end could still be
   the beginning of a stop string (the longest suffix that is a prefix of some
   stop string). When a stop string appears, the output is cut before it (or
   after it, with ``include_stop_str_in_output``) and nothing more is emitted.
"""

from __future__ import annotations

from typing import Any

from tokenmill.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


def _backend_decode(tokenizer: Any):
    """The Rust ``tokenizers.Tokenizer.decode`` behind a transformers fast tokenizer, where
    ``tokenizer.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)`` is exactly
    ``backend.decode(ids, skip_special_tokens=s)`` for a list of ints: the class uses transformers' own
    ``decode`` and ``_decode`` (no subclass override), which convert the ids (a no-op for a list), call the
    backend and, with the clean-up off, return its text. Else None (any other tokenizer keeps its ``decode``).

    Why: two decodes per output token; transformers' Python wrapper around each took ~3/4 of the API
    process's detokenisation time (in-process cProfile, 64 streams, AVX2 2-core: ~2.7 ms per step)."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, TokenizersBackend) and isinstance(backend, Tokenizer)
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode):
        return backend.decode
    return None


class IncrementalDetokenizer:
    """Stream the text of one completion, token by token.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with
            ``decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)``).
        prompt_token_ids: the prompt's ids. Not used for decoding: the text of a
            completion is defined as ``tokenizer.decode(output_ids)``, so the
            deltas join to exactly that.
        params: the request's sampling parameters (``stop``, ``min_tokens``,
            ``include_stop_str_in_output``, ``skip_special_tokens``).

    Attributes:
        stop_matched: the stop string that ended the text, else None. When set,
            the caller finishes the request with ``finish_reason='stop'`` and
            ``stop_reason`` = this string; later updates return "".
        num_tokens_at_stop: how many output ids had been fed when the stop
            string matched (the ids after it, e.g. accepted draft tokens of
            the same step, are not part of the output); None before.
        output_text: all text emitted so far (the concatenation of every
            returned delta).
        token_ids: every output token id fed so far.

    Invariant: the joined deltas (``update`` results plus ``finish()``) equal
    ``tokenizer.decode(token_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``,
    cut at the first stop string that ends in the text of output token number
    ``min_tokens`` or later (1-based).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._backend_decode = _backend_decode(tokenizer)
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_matched: str | None = None
        self.num_tokens_at_stop: int | None = None
        self.output_text = ""
        self.token_ids: list[int] = []
        self._stops: list[str] = list(params.stop)
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._min_tokens = params.min_tokens
        # Window over token_ids: [prefix, read) is already text; [read, len) is not yet.
        self._prefix = 0
        self._read = 0
        # Complete text not yet emitted (held back for stop strings); it starts
        # at absolute character offset len(self.output_text).
        self._pending = ""
        # Stop matches must end after this absolute offset (text present before
        # the min_tokens-th token was decoded).
        self._gate: int | None = 0 if self._min_tokens <= 1 else None
        self._finished = False

    # -- public API ----------------------------------------------------------------
    def update(self, new_token_ids: list[int], num_output_tokens_before: int | None = None) -> str:
        """Feed newly generated ids; return the text delta that is now safe to emit.

        Args:
            new_token_ids: ids generated since the last call, in order.
            num_output_tokens_before: optional, how many output tokens the
                request had before ``new_token_ids``. When given, ids this
                detokenizer has already seen (a re-delivery) are skipped.
        Returns:
            Text that can no longer change: no trailing partial character and
            no suffix that could still start a stop string. "" after a stop
            string matched or after :meth:`finish`.
        Raises:
            ValueError: ``num_output_tokens_before`` is larger than the number
                of ids fed so far (ids were lost).
        """
        if num_output_tokens_before is not None:
            seen = len(self.token_ids) - num_output_tokens_before
            if seen < 0:
                raise ValueError(
                    f"gap in output ids: caller had {num_output_tokens_before} before, detokenizer saw {len(self.token_ids)}"
                )
            new_token_ids = new_token_ids[seen:]
        if self.stop_matched is not None or self._finished:
            self.token_ids.extend(new_token_ids)
            return ""
        out: list[str] = []
        for tok in new_token_ids:
            self.token_ids.append(tok)
            if self._gate is None and len(self.token_ids) >= self._min_tokens:
                self._gate = len(self.output_text) + len(self._pending)
            if self.stop_matched is not None:
                continue  # keep recording ids after a stop, emit nothing
            text = self._decode_step(final=False)
            if text:
                out.append(self._accept(text))
                if self.stop_matched is not None:
                    self.num_tokens_at_stop = len(self.token_ids)
        return "".join(out)

    def finish(self) -> str:
        """Release everything held back; call once when the request ends for
        any reason other than a matched stop string.

        Returns:
            The remaining text: held-back stop-string prefixes and any
            characters still pending in the decode window. Trailing ids that
            never complete a character (the output was cut mid-character) are
            dropped, so the text never ends in U+FFFD. "" after a stop match or
            a second call.
        """
        if self.stop_matched is not None or self._finished:
            return ""
        self._finished = True
        self._pending += self._decode_step(final=True)
        tail, self._pending = self._pending, ""
        self.output_text += tail
        return tail

    # -- internals ------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_step(self, final: bool) -> str:
        """New complete text from the token window, sliding it when text is accepted."""
        if self._read >= len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix :]
        known = self._decode(self.token_ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = self._decode(window)
        if final:
            # The output ended inside a character (e.g. max_tokens cut an emoji): drop the
            # incomplete bytes rather than emit U+FFFD.
            text = text.rstrip(_REPLACEMENT)
        if len(text) <= len(known) or (text.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new, or a character is still incomplete
        self._prefix, self._read = self._read, len(self.token_ids)
        return text[len(known) :]

    def _accept(self, text: str) -> str:
        """Add complete text; check stop strings; return what may be emitted now."""
        base = len(self.output_text)  # absolute offset of self._pending[0]
        before = base + len(self._pending)
        self._pending += text
        if not self._stops:
            return self._emit(len(self._pending))
        if self._gate is not None:
            hit = self._find_stop(max(0, before - self._max_stop_len + 1 - base), self._gate - base)
            if hit is not None:
                pos, stop = hit
                self.stop_matched = stop
                cut = pos + len(stop) if self.params.include_stop_str_in_output else pos
                delta = self._pending[:cut]
                self._pending = ""
                self.output_text += delta
                return delta
        return self._emit(len(self._pending) - self._held_back())

    def _find_stop(self, start: int, min_end: int) -> tuple[int, str] | None:
        """Earliest stop string in ``_pending[start:]`` ending after ``min_end``
        (pending-relative); ties go to the one listed first."""
        best: tuple[int, str] | None = None
        for s in self._stops:
            pos = self._pending.find(s, start)
            while pos != -1 and pos + len(s) <= min_end:
                pos = self._pending.find(s, pos + 1)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of ``_pending`` that is a prefix of a stop string.

        O(len(pending) × number of stops) comparisons per call and no per-prefix
        tables, so a very long stop string costs memory linear in its length.
        """
        pending, best = self._pending, 0
        for s in self._stops:
            for n in range(min(len(pending), len(s)), best, -1):
                if s.startswith(pending[-n:]):
                    best = n
                    break
        return best

    def _emit(self, n: int) -> str:
        delta, self._pending = self._pending[:n], self._pending[n:]
        self.output_text += delta
        return delta
