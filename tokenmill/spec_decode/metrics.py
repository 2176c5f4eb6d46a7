"""Speculative-decoding metrics.

The counters live in :mod:`tokenmill.core.spec_decode_stats` (the scheduler,
a pure-Python leaf, updates them when it applies a verification); the
Prometheus names are vLLM's under ``tokenmill:``: ``spec_decode_num_drafts``,
``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
``spec_decode_num_accepted_tokens_per_pos{position}``
(:mod:`tokenmill.metrics.prometheus`).
"""

from tokenmill.core.spec_decode_stats import SpecDecodingStats

__all__ = ["SpecDecodingStats"]
