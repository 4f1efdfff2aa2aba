"""How many tokens each request computes in one step, under the step's token budget: the
chunked-prefill rules (:class:`PrefillChunking`), the chunk end kept outside an image that
attends both ways (:func:`keep_items_whole`), and how many draft tokens a decoding request
may have verified (:func:`max_draft_tokens`).

Chunked prefill disabled means a prompt is never split: one that does not fit the step's
remaining budget waits (head of line), and one longer than the whole budget (possible for a
resumed request with its output) runs whole, alone in a step, once nothing else is scheduled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenloom.core.config import SchedulerConfig
from tokenloom.core.multimodal.inputs import MultiModalItem
from tokenloom.core.sequence import EngineSequence
from tokenloom.errors import InvalidRequestError

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# share of the model length above which a prompt's chunk is capped when several prompts may
# prefill at once and no --long-prefill-token-threshold is given (vLLM's default)
LONG_PREFILL_SHARE = 0.04


@dataclass(frozen=True)
class PrefillChunking:
    """The step's token budget and how a prompt is cut to fit it."""

    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    # prompts that may be mid-prefill at once
    max_num_partial_prefills: int
    # the largest chunk of one prompt in a step (0: no cap)
    long_prefill_token_threshold: int

    @classmethod
    def from_config(cls, scheduler_config: SchedulerConfig, max_model_len: int) -> PrefillChunking:
        max_num_partial_prefills = max(1, scheduler_config.max_num_partial_prefills)
        long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        if not long_prefill_token_threshold and max_num_partial_prefills > 1:
            long_prefill_token_threshold = max(1, int(max_model_len * LONG_PREFILL_SHARE))
        return cls(
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            enable_chunked_prefill=scheduler_config.enable_chunked_prefill,
            max_num_partial_prefills=max_num_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )

    def running_chunk(self, num_uncomputed: int, token_budget: int) -> int:
        """Tokens a running request computes next (0: it waits for a later step)."""
        if not self.enable_chunked_prefill:
            return num_uncomputed if num_uncomputed <= token_budget else 0
        num_new_tokens = min(num_uncomputed, token_budget)
        if self.long_prefill_token_threshold:
            num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
        return num_new_tokens

    def waiting_chunk(
        self, num_uncomputed: int, token_budget: int, *, chunkable: bool, num_partial_prefills: int, step_is_empty: bool
    ) -> int | None:
        """Tokens a waiting request computes in its first step, or None when it cannot start
        in this one (and, head of line, neither can the requests behind it).

        :param chunkable: False for a request that must run its prompt whole (pooling).
        :param num_partial_prefills: prompts already mid-prefill in this step.
        :param step_is_empty: nothing is scheduled in this step yet."""
        if self.enable_chunked_prefill and chunkable:
            num_new_tokens = min(num_uncomputed, token_budget)
            if self.long_prefill_token_threshold:
                num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
            if num_new_tokens < num_uncomputed and num_partial_prefills >= self.max_num_partial_prefills:
                return None
            return num_new_tokens
        if num_uncomputed <= token_budget:
            return num_uncomputed
        if num_uncomputed > self.max_num_batched_tokens and step_is_empty:
            return num_uncomputed  # can never fit the budget: runs whole, alone
        return None


def keep_items_whole(items: Sequence[MultiModalItem], num_computed: int, num_new_tokens: int) -> int:
    """``num_new_tokens`` from position ``num_computed``, cut back so the chunk ends outside every
    item whose tokens attend to each other both ways (``MultiModalItem.bidirectional``): such an
    item's tokens are computed in one step, or its first ones would miss its later ones. 0 when
    the chunk starts inside (or at) such an item and cannot reach its end in this step."""
    end = num_computed + num_new_tokens
    for item in items:
        if item.bidirectional and item.offset < end < item.end:
            # items are in prompt order and do not overlap: no later one reaches below this end
            end = max(item.offset, num_computed)
            break
    return end - num_computed


def check_items_fit_a_step(seq: EngineSequence, chunking: PrefillChunking) -> None:
    """Refuse a request holding an item that attends both ways and is longer than a chunked
    step's prompt tokens (it could never be computed whole)."""
    if not chunking.enable_chunked_prefill:
        return  # a prompt is never split
    largest_chunk = chunking.max_num_batched_tokens
    if chunking.long_prefill_token_threshold:
        largest_chunk = min(largest_chunk, chunking.long_prefill_token_threshold)
    for item in seq.mm_items:
        if item.bidirectional and item.length > largest_chunk:
            raise InvalidRequestError(
                f"the prompt's {item.modality} at position {item.offset} has {item.length} tokens that attend to each "
                f"other both ways, so it is computed in one step, but a step computes at most {largest_chunk} prompt "
                "tokens: raise "
                "--max-num-batched-tokens (and --long-prefill-token-threshold, if set) to at least "
                f"{item.length}",
                param="messages",
            )


def max_draft_tokens(seq: EngineSequence, token_budget: int, max_model_len: int) -> int:
    """Drafts worth verifying for a decoding request: within the step's token budget (after
    its pending token), and no more than its output may still grow (max_tokens, the model's
    context: a draft's position must stay inside it)."""
    limit = min(token_budget - 1, max_model_len - seq.num_tokens - 1)
    max_tokens = seq.sampling_params.max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - seq.num_output_tokens - 1)
    return max(0, limit)
