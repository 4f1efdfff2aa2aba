"""``SchedulerConfig``: continuous batching's token budget, sequence cap, chunked prefill and
policy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int | None = None
    """Token budget per step (prefill and decode tokens together); default 2048."""
    max_num_seqs: int = 256
    """Maximum number of sequences in a step."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so prefill and decode share each step."""
    max_num_partial_prefills: int = 1
    """Maximum number of prompts being prefilled in chunks at once."""
    long_prefill_token_threshold: int = 0
    """Tokens above which a prompt counts as long (0: derived from the model length)."""
    scheduling_policy: str = "fcfs"
    """fcfs (first come, first served) or priority (lower ``priority`` value first, then
    arrival)."""
    max_waiting_requests: int | None = 1024
    """Refuse new requests with 429 (and Retry-After) when this many sequences wait to be
    scheduled (an ``n`` > 1 request counts ``n``); bounds the memory a burst can take.
    0 or less: unlimited."""
