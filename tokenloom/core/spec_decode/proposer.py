"""The proposer interface: what a speculative-decoding method (``--speculative-config``'s
``method``) implements. Proposers are plugins (``register_proposers``); the core knows none by
name."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class DraftRequest:
    """One sequence to draft for, after the step that sampled its newest token."""

    req_id: str
    token_ids: list[int]
    """Prompt and output so far; the last one is the token the next step computes."""
    num_prompt_tokens: int
    max_draft_tokens: int
    """Propose at most this many tokens (``num_speculative_tokens``, or fewer near the end)."""


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
