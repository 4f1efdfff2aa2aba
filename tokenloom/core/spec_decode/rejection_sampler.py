"""Verification of draft tokens in one target step, keeping the target distribution exactly.

Each verified sequence brings ``k`` draft tokens and ``k + 1`` rows of target logits (row
``j`` predicts the token after the ``j``-th draft). Row ``j`` is processed with every sampling
parameter as if the first ``j`` drafts were already output (penalties count them, min_tokens
and bad words see them, the grammar mask was computed after accepting them): see
:class:`DraftPrefixState`. Then, position by position:

- greedy: the target's argmax; drafts are accepted while they equal it, and the first
  mismatch is replaced by the argmax, so the tokens are exactly those of plain decoding;
- random: draft ``d`` drawn from ``q`` is accepted with probability ``min(1, p(d) / q(d))``;
  on rejection a token is drawn from the residual ``max(0, p - q)`` (normalised), which makes
  every emitted token distributed exactly as ``p`` (Leviathan et al. 2023, Chen et al. 2023).
  A proposer without a distribution (n-gram lookup) is a point mass: ``q(d) = 1``.

If every draft is accepted, a bonus token is sampled from row ``k``. So a sequence gets
between 1 and ``k + 1`` tokens per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.core.batch import TokenLogprobs
from tokenloom.core.sampler import (
    LOGPROBS_MODES,
    _apply_logits_processors,
    _apply_request_processors,
    _apply_temperature_and_truncation,
    _failed_rows,
    _token_logprobs,
    row_argmax,
)
from tokenloom.core.sampling_metadata import SamplingMetadata, SamplingState
from tokenloom.errors import ConfigError


class DraftPrefixState:
    """A request's :class:`SamplingState` as it stands once ``draft_prefix`` is appended to its
    output: what sampling row ``j`` of a verified sequence sees. Everything else is the
    request's own state (seeded generator, cached masks)."""

    def __init__(self, base: SamplingState, draft_prefix: list[int]):
        self._base = base
        self._draft_prefix = list(draft_prefix)
        self.output_token_ids = base.output_token_ids + self._draft_prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def output_counts(self, vocab_size: int) -> torch.Tensor:
        counts = self._base.output_counts(vocab_size)
        if not self._draft_prefix:
            return counts
        token_ids = torch.tensor(self._draft_prefix, dtype=torch.long, device=counts.device)
        return counts.clone().index_add_(0, token_ids, torch.ones_like(token_ids, dtype=counts.dtype))

    def banned_token_ids(self) -> list[int]:
        # the same rules, over the output with the drafts appended
        return SamplingState.banned_token_ids(self)  # type: ignore[arg-type]


@dataclass
class VerifiedTokens:
    """Per verified sequence: the tokens it gets this step (accepted drafts, then the
    recovered or bonus token), their logprobs when asked for, and how many drafts passed."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    num_accepted: list[int]
    # sequences that could not be sampled (every token banned at a position reached): index -> why
    errors: dict[int, str] = field(default_factory=dict)


class RejectionSampler:
    """Turns ``[sum(k_i + 1), vocab]`` target logits and the drafts into each sequence's tokens."""

    def __init__(
        self,
        logprobs_mode: str = "raw_logprobs",
        unseeded_generator: Callable[[torch.device], torch.Generator] | None = None,
    ):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}", param="logprobs_mode")
        self.logprobs_mode = logprobs_mode
        # the generator of unseeded rows: the plain sampler's (seeded by --seed), so a server's
        # random draws follow its seed with speculation as without
        self.unseeded_generator = unseeded_generator

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> VerifiedTokens:
        """``metadata`` has one row per logits row: sequence ``i`` owns ``len(draft_token_ids[i])
        + 1`` consecutive rows, built from :class:`DraftPrefixState` views of its state."""
        logits = logits.float()
        num_rows = logits.shape[0]
        if num_rows != sum(len(drafts) + 1 for drafts in draft_token_ids):
            raise ValueError("the logits need one row per draft token plus one per sequence")
        failed: dict[int, str] = {}
        if metadata.modifies_logits:
            processed = logits.clone()
            # request logits processors see each position's output with the drafts before it
            processor_errors = _apply_request_processors(processed, metadata)
            processed = _apply_logits_processors(processed, metadata)
            failed = {**_failed_rows(processed), **processor_errors}
        else:
            processed = logits
        greedy_ids = row_argmax(processed).tolist()

        # random rows: their probabilities after temperature and truncation
        random_index = [-1] * num_rows
        random_probs = None
        random_logits = None
        generators: dict[int, torch.Generator] = {}
        if not metadata.all_greedy:
            rows = range(num_rows) if metadata.random_rows is None else metadata.random_rows.tolist()
            for position, row in enumerate(rows):
                random_index[row] = position
            subset = processed if metadata.random_rows is None else processed[metadata.random_rows]
            random_logits = _apply_temperature_and_truncation(subset, metadata)
            random_probs = torch.softmax(random_logits, dim=-1)
            generators = metadata.generators

        token_ids: list[list[int]] = []
        num_accepted: list[int] = []
        errors: dict[int, str] = {}
        first_row = 0
        for index, drafts in enumerate(draft_token_ids):
            probs_of_draft = draft_probs[index] if draft_probs is not None else None
            tokens: list[int] = []
            accepted = 0
            for position in range(len(drafts) + 1):
                row = first_row + position
                if row in failed:
                    errors[index] = failed[row]
                    break
                if random_index[row] < 0:
                    target = greedy_ids[row]
                    tokens.append(target)
                    if position < len(drafts) and drafts[position] == target:
                        accepted += 1
                        continue
                    break
                assert random_probs is not None  # a random row exists, so probabilities were computed
                probs = random_probs[random_index[row]]
                generator = generators.get(random_index[row])
                if generator is None and self.unseeded_generator is not None:
                    generator = self.unseeded_generator(probs.device)
                if position == len(drafts):  # every draft accepted: the bonus token
                    tokens.append(_draw(probs, generator))
                    break
                draft = drafts[position]
                draft_dist = probs_of_draft[position].float() if probs_of_draft is not None else None
                draft_p = float(draft_dist[draft]) if draft_dist is not None else 1.0
                target_p = float(probs[draft])
                uniform = float(torch.rand((), generator=generator, device=probs.device))
                if draft_p > 0 and uniform < min(1.0, target_p / draft_p):
                    tokens.append(draft)
                    accepted += 1
                    continue
                if draft_dist is None:
                    residual = probs.clone()
                    residual[draft] = 0.0
                else:
                    residual = (probs - draft_dist.to(probs.device)).clamp_(min=0.0)
                # p == q leaves nothing: then p itself (a rejection there has probability 0)
                tokens.append(_draw(residual if float(residual.sum()) > 0 else probs, generator))
                break
            token_ids.append(tokens if index not in errors else [])
            num_accepted.append(accepted if index not in errors else 0)
            first_row += len(drafts) + 1

        logprobs = self._logprobs(logits, processed, random_logits, metadata, draft_token_ids, token_ids)
        return VerifiedTokens(token_ids=token_ids, logprobs=logprobs, num_accepted=num_accepted, errors=errors)

    def _logprobs(
        self,
        logits: torch.Tensor,
        processed: torch.Tensor,
        random_logits: torch.Tensor | None,
        metadata: SamplingMetadata,
        draft_token_ids: list[list[int]],
        token_ids: list[list[int]],
    ) -> list[list[TokenLogprobs] | None]:
        """Logprobs of each emitted token at its position, as the plain sampler reports them."""
        result: list[list[TokenLogprobs] | None] = [None] * len(draft_token_ids)
        if not metadata.logprob_rows:
            return result
        num_top_by_row = dict(zip(metadata.logprob_rows, metadata.num_logprobs))
        mode = self.logprobs_mode
        if mode.startswith("raw"):
            source = logits
        else:
            source = processed
            if random_logits is not None:
                # processed values of a random row are taken after temperature and truncation
                source = processed.clone()
                if metadata.random_rows is None:
                    source = random_logits
                else:
                    source[metadata.random_rows] = random_logits
        rows: list[int] = []
        chosen: list[int] = []
        num_top: list[int] = []
        owners: list[int] = []
        first_row = 0
        for index, (drafts, tokens) in enumerate(zip(draft_token_ids, token_ids)):
            if first_row in num_top_by_row:
                result[index] = []
                for position, token_id in enumerate(tokens):
                    rows.append(first_row + position)
                    chosen.append(token_id)
                    num_top.append(num_top_by_row[first_row + position])
                    owners.append(index)
            first_row += len(drafts) + 1
        if not rows:
            return result
        selected = source[torch.tensor(rows, dtype=torch.long, device=source.device)]
        if mode.endswith("logprobs"):
            selected = torch.log_softmax(selected, dim=-1)
        entries = _token_logprobs(selected, torch.tensor(chosen, dtype=torch.long, device=source.device), num_top)
        for owner, entry in zip(owners, entries):
            owned = result[owner]
            assert owned is not None  # set above for every owner
            owned.append(entry)
        return result


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability ``probs[t] / sum(probs)``: the exponential race the plain
    sampler runs (so a sequence with no drafts draws from its generator exactly as it would)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return int(row_argmax(probs / noise))
