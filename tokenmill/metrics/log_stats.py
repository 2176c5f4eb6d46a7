"""A periodic one-line summary of the server's throughput and state.

Example::

    prompt 412.3 tok/s, generation 96.1 tok/s | running 8, waiting 3 | KV cache 41.2% | prefix cache hit rate 37.5% | preemptions 0

With speculative decoding the line ends with ``| spec decode: acceptance rate
62.5%, mean acceptance length 3.50, drafts 120`` (over the interval).

Throughputs are averages over the interval since the previous line; the prefix
cache hit rate is over the same interval (hits / queries in tokens).
"""

from __future__ import annotations

import logging
import time

from tokenmill.metrics.stats import EngineStats
from tokenmill.metrics.stats import IterationStats

logger = logging.getLogger("tokenmill.stats")


class LoggingStatLogger:
    """Accumulates stats and emits a summary line every ``interval`` seconds.

    Args:
        interval: seconds between lines; <= 0 disables logging.
    """

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._stats: EngineStats | None = None
        self._base_queries = 0
        self._base_hits = 0
        self._base_spec = (0, 0, 0)      # drafts, draft tokens, accepted tokens at the last line
        self._idle_logged = False

    def record(self, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Accumulate (cheap; called after every output batch)."""
        if engine_stats is not None:
            self._stats = engine_stats
        if iteration is not None:
            self._prompt_tokens += iteration.num_prompt_tokens
            self._gen_tokens += iteration.num_generation_tokens

    def summary(self, now: float | None = None) -> str:
        """The line for the interval ending ``now`` (monotonic seconds); resets the interval."""
        now = time.monotonic() if now is None else now
        dt = max(1e-9, now - self._last_time)
        s = self._stats or EngineStats()
        dq = s.prefix_cache_queries - self._base_queries
        dh = s.prefix_cache_hits - self._base_hits
        hit_rate = (dh / dq) if dq > 0 else 0.0
        line = (f"prompt {self._prompt_tokens / dt:.1f} tok/s, generation {self._gen_tokens / dt:.1f} tok/s | "
                f"running {s.num_running}, waiting {s.num_waiting} | KV cache {100 * s.kv_cache_usage:.1f}% | "
                f"prefix cache hit rate {100 * hit_rate:.1f}% | preemptions {s.num_preemptions_total}")
        t = s.step_timing
        if t is not None and t.ready and t.prefill_tokens_per_second:
            b = max(1, s.queue.num_decoding if s.queue is not None else 1)
            line += (f" | measured: prefill {t.prefill_tokens_per_second:.0f} tok/s, decode step "
                     f"{1000 * (t.decode_step_time(b) or 0.0):.1f} ms at batch {b}")
        sd = s.spec_decoding
        if sd is not None:
            # over the interval, as vLLM's spec-decoding log line: accepted / drafted tokens, and
            # tokens per verifying request-step (1 + accepted / drafts)
            d = sd.num_drafts - self._base_spec[0]
            dt_tok = sd.num_draft_tokens - self._base_spec[1]
            acc = sd.num_accepted_tokens - self._base_spec[2]
            line += (f" | spec decode: acceptance rate {100 * acc / dt_tok if dt_tok else 0.0:.1f}%, "
                     f"mean acceptance length {1 + acc / d if d else 0.0:.2f}, drafts {d}")
            self._base_spec = (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens)
        self._last_time = now
        self._prompt_tokens = self._gen_tokens = 0
        self._base_queries, self._base_hits = s.prefix_cache_queries, s.prefix_cache_hits
        return line

    @property
    def _idle(self) -> bool:
        s = self._stats or EngineStats()
        return self._prompt_tokens == 0 and self._gen_tokens == 0 and s.num_running == 0 and s.num_waiting == 0

    def maybe_log(self) -> None:
        """Log the summary when the interval has elapsed (call it periodically).

        An idle server logs one idle line, then stays quiet until there is work.
        """
        if self.interval <= 0 or time.monotonic() - self._last_time < self.interval:
            return
        idle = self._idle
        if idle and self._idle_logged:
            self.summary()  # restart the interval silently
            return
        self._idle_logged = idle
        logger.info(self.summary())
