"""The proposer interface: what a speculative-decoding method (``--speculative-config``'s
``method``) implements. Proposers are plugins (``register_proposers``); the core knows none by
name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloom.core.config import EngineConfig, SpeculativeConfig
    from tokenloom.core.model_loader import ModelInfo


@dataclass(frozen=True)
class ProposerSpec:
    """What a proposer is constructed with, in the worker: plain data."""

    speculative: SpeculativeConfig
    """The speculative-decoding settings (``num_speculative_tokens``, the method's own keys)."""
    config: EngineConfig
    """The engine config as the user gave it."""
    model_info: ModelInfo
    """The target model: vocabulary size, context length, files."""
    plugins: Any = None
    """The plugin registries (a :class:`~tokenloom.plugins.manager.PluginSet`): a proposer that
    runs a model resolves and builds it through them, as the target is."""
    platform: Any = None
    """The worker's device platform plugin instance (None in the main process)."""


@dataclass
class DraftRequest:
    """One sequence to draft for, after the step that sampled its newest token."""

    req_id: str
    token_ids: list[int]
    """Prompt and output so far; the last one is the token the next step computes."""
    num_prompt_tokens: int
    max_draft_tokens: int
    """Propose at most this many tokens: ``num_speculative_tokens``, or fewer where the request's
    drafts have seldom been accepted (``adaptive_num_speculative_tokens``, the runner's choice
    from its acceptance so far) or near the end. A proposer that runs steps per token (a draft
    model) runs only as many as the longest request asks for."""
    block_ids: list[int] = field(default_factory=list)
    """The request's KV block table: a proposer with its own KV cache (:meth:`Proposer.kv_cache_bytes_per_block`)
    writes position ``p`` into block ``block_ids[p // block_size]``. It covers the positions
    up to ``len(token_ids) - 1`` and the scheduler's lookahead slots after them."""
    temperature: float = 0.0
    """The request's sampling temperature (0: greedy): a proposer that samples drafts from a
    distribution may follow it (any distribution is exact, a closer one is accepted more)."""


@dataclass
class Draft:
    """A proposal: ``token_ids`` to verify, in order, and optionally the distribution each was
    drawn from (``probs``: float32 ``[len(token_ids), vocab]``). ``probs`` None means each
    draft token was chosen deterministically (a point mass), as n-gram lookup does."""

    token_ids: list[int]
    probs: Any = None


class Proposer:
    """Proposes draft tokens for decoding sequences. Registered with ``register_proposers``;
    constructed once per worker, in the worker, as ``Proposer(spec)`` with a
    :class:`ProposerSpec`. Called on the worker's thread, one step at a time."""

    def __init__(self, spec: ProposerSpec):
        self.spec = spec

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Called after every step that sampled tokens while speculation is on (the batch is
        at most ``disable_by_batch_size``), with the sequences that sampled.

        :returns: one :class:`Draft` per request, in order; an empty ``token_ids`` proposes
            nothing (the sequence then decodes one token next step). Never more than
            ``max_draft_tokens``; the scheduler may verify fewer (token budget, ``max_tokens``).
        """
        raise NotImplementedError

    def remove_requests(self, req_ids: set[str]) -> None:
        """The requests finished or were preempted: drop any state kept for them. Optional."""

    # -- optional: proposers that run a model with its own KV cache ------------------------

    @classmethod
    def check(cls, spec: ProposerSpec, tokenizer: Any) -> None:
        """Called once in the main process, after the target is resolved and before any worker
        starts (``spec.platform`` is None there): raise a ConfigError for settings the
        proposer cannot serve (e.g. a draft model whose vocabulary differs). Optional."""

    @classmethod
    def lookahead_slots(cls, speculative: SpeculativeConfig) -> int:
        """KV slots the scheduler allocates past a speculating request's scheduled tokens, so
        that the proposer can write KV for its drafts right after the step (a draft model:
        ``num_speculative_tokens``). Called in the main process; 0 by default."""
        return 0

    def load_model(self) -> None:
        """Called in the worker after the target model is loaded and before the KV cache is
        sized: load what the proposer runs. Optional."""

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes this proposer's KV cache needs per block: a block of the engine's pool then
        costs the target's bytes plus these, and the proposer's cache is indexed by the same
        block ids (so the block manager's tables and ref counts serve both). 0 by default."""
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate this proposer's KV cache of ``num_blocks`` blocks (called once in the
        worker, with the target's). Optional."""
