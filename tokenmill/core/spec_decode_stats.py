"""Speculative-decoding counters (vLLM's ``spec_decode_*`` metrics, cumulative since start), kept by the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative counts of drafts and accepted draft tokens.

    Attributes:
        num_drafts: request-steps that verified at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: accepted draft tokens by position in the
            draft (index 0 = first draft token); as long as the largest γ seen.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one request's verification: ``num_accepted`` of ``num_draft_tokens`` drafts kept."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, in [0, 1] (0 with no drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying request-step: 1 + accepted / drafts (vLLM's definition; 0 with none)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
