"""What the scheduler reports: :class:`SchedulerStats` each time the engine asks, and
:class:`SpecDecodingStats`, speculative decoding's running counts since start."""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.core.kv_connector import KVConnectorStats


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decoding: SpecDecodingStats | None = None
    kv_connector: KVConnectorStats | None = None


@dataclass
class SpecDecodingStats:
    """Speculative decoding since start, counted like vLLM's ``spec_decode_*`` metrics."""

    num_spec_tokens: int
    num_drafts: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [position] how often the draft at that position was accepted
    num_accepted_tokens_per_pos: list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_accepted_tokens_per_pos is None:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_position = self.num_accepted_tokens_per_pos
        assert per_position is not None  # set in __post_init__
        for position in range(num_accepted_tokens):
            per_position[position] += 1

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos or []),
        )
