"""Batched, vectorised sampling, shaped like vLLM v1's sampler: the :class:`Sampler` itself
and prompt logprobs. Its inputs, the per-request :class:`SamplingState` and the per-step
:class:`SamplingMetadata` (tensors only for the features some row uses), live in
:mod:`tokenloom.core.sampling_metadata` and are re-exported here.

Order of processing: logits processors (``--logits-processors``, then the request's own),
structured-output masks, allowed tokens, bad words, min_tokens, logit
bias, presence/frequency penalties, repetition penalty; then greedy rows take the argmax and
the others go through temperature, min-p, top-k, top-p and an exponential race
(``probs / Exponential(1)``, argmax) whose noise comes from the row's own generator when it
has a seed, and otherwise from the sampler's generator, seeded once from ``--seed`` (vLLM's
meaning: two engines started with the same seed sample the same tokens for the same sequence
of steps).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenloom.core.batch import TokenLogprobs
from tokenloom.core.sampling_metadata import SamplingMetadata, SamplingState, tokenize_bad_words
from tokenloom.errors import ConfigError

__all__ = [
    "LOGPROBS_MODES",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "compute_prompt_logprobs",
    "row_argmax",
    "tokenize_bad_words",
    "unpack_bitmask",
]

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


@dataclass
class SamplerOutput:
    """Per row: the sampled token, and its logprobs when the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # rows that could not be sampled (every token banned, or non-finite logits): row -> why;
    # their token id is -1
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Turns a step's ``[num_rows, vocab]`` float32 logits into one token per row."""

    def __init__(self, logprobs_mode: str = "raw_logprobs", seed: int | None = None):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(
                f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}",
                param="logprobs_mode",
            )
        self.logprobs_mode = logprobs_mode
        # the noise of unseeded random rows: its own generator rather than torch's global one,
        # so that nothing else drawing random numbers in the process shifts the sampled tokens
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The unseeded rows' generator on ``device``: seeded with ``--seed``, or from the OS's
        entropy when the seed is None."""
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[device] = generator
        return generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        mode = self.logprobs_mode
        wants_logprobs = bool(metadata.logprob_rows)
        logprobs_source = None
        if wants_logprobs and mode.startswith("raw"):
            logprobs_source = logits[metadata.logprob_rows]

        processor_errors: dict[int, str] = {}
        if metadata.modifies_logits:
            processed = logits.clone()
            processor_errors = _apply_request_processors(processed, metadata)
            processed = _apply_logits_processors(processed, metadata)
            errors = {**_failed_rows(processed), **processor_errors}
        else:
            processed, errors = logits, {}
        if metadata.all_greedy:
            token_ids = row_argmax(processed)
        else:
            random_rows = metadata.random_rows
            random_logits = processed if random_rows is None else processed[random_rows]
            random_logits = _apply_temperature_and_truncation(random_logits, metadata)
            random_tokens = _sample_exponential_race(
                random_logits, metadata.generators, self.generator(random_logits.device)
            )
            if random_rows is None:
                token_ids = random_tokens
            else:
                token_ids = row_argmax(processed)
                token_ids[random_rows] = random_tokens
            if wants_logprobs and mode.startswith("processed"):
                # processed logprobs of a random row are taken after temperature and truncation
                if random_rows is None:
                    processed = random_logits
                else:
                    processed = processed.clone() if processed is logits else processed
                    processed[random_rows] = random_logits

        sampled = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * metadata.num_rows
        if wants_logprobs:
            if logprobs_source is None:
                logprobs_source = processed[metadata.logprob_rows]
            if mode.endswith("logprobs"):
                logprobs_source = torch.log_softmax(logprobs_source, dim=-1)
            chosen = token_ids[metadata.logprob_rows]
            entries = _token_logprobs(logprobs_source, chosen, metadata.num_logprobs)
            for row, entry in zip(metadata.logprob_rows, entries):
                logprobs[row] = entry
        for row in errors:
            sampled[row] = -1
            logprobs[row] = None
        return SamplerOutput(token_ids=sampled, logprobs=logprobs, errors=errors)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 rows (bit ``t % 32`` of word ``t // 32`` = token t allowed) -> bool
    ``[rows, vocab_size]``; tokens past the mask's width are not allowed."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        # numpy unpacks bits much faster than torch's shifts on the CPU, and needs no threads
        # (figures: docs/design.md, "Sampling")
        packed = bitmask.contiguous().numpy().view(np.uint8)
        allowed = torch.from_numpy(np.unpackbits(packed, axis=-1, bitorder="little").view(np.bool_))
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def _apply_request_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> dict[int, str]:
    """Run each row's logits processors on its row, in place; a processor that raises, or
    returns something other than a row of the same shape, fails that row alone (row -> why)."""
    errors: dict[int, str] = {}
    for row, state in metadata.processor_rows:
        try:
            row_logits = logits[row]
            for processor in state.logits_processors():
                result = processor(state.prompt_token_ids, state.output_token_ids, row_logits)
                if not isinstance(result, torch.Tensor) or result.shape != row_logits.shape:
                    raise TypeError(
                        f"a logits processor returned {type(result).__name__} "
                        f"{tuple(getattr(result, 'shape', ()))}, not a tensor of shape {tuple(row_logits.shape)}"
                    )
                row_logits = result
            logits[row] = row_logits
        except Exception as exc:  # the processor is user code: fail this request, not the step
            errors[row] = f"a logits processor failed: {type(exc).__name__}: {exc}"
            logits[row] = float("-inf")
    return errors


def _apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Masks, bias and penalties, in place on the (cloned) logits."""
    neg_inf = float("-inf")
    if metadata.grammar is not None:
        rows = metadata.grammar.rows
        allowed = unpack_bitmask(metadata.grammar.masks, logits.shape[-1])
        logits[rows] = logits[rows].masked_fill(~allowed, neg_inf)
    if metadata.allowed is not None:
        rows = metadata.allowed.rows
        logits[rows] = logits[rows].masked_fill(~metadata.allowed.masks, neg_inf)
    if metadata.banned is not None:
        logits[metadata.banned.rows, metadata.banned.token_ids] = neg_inf
    if metadata.bias is not None:
        bias = metadata.bias
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if metadata.penalties is not None:
        penalties = metadata.penalties
        penalized = logits[penalties.rows]
        counts = penalties.output_counts
        occurred = counts > 0
        penalized -= penalties.frequency[:, None] * counts
        penalized -= penalties.presence[:, None] * occurred
        if penalties.repetition is not None and penalties.prompt_mask is not None:
            seen = occurred | penalties.prompt_mask
            factors = torch.where(seen, penalties.repetition[:, None], 1.0)
            penalized = torch.where(penalized > 0, penalized / factors, penalized * factors)
        logits[penalties.rows] = penalized
    return logits


def _apply_temperature_and_truncation(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p for the random rows (a new tensor)."""
    neg_inf = float("-inf")
    # set whenever some row is random (the only rows this sees)
    logits = logits / metadata.temperature[:, None] if metadata.temperature is not None else logits.clone()
    if metadata.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * metadata.min_p[:, None]
        logits.masked_fill_(probs < threshold, neg_inf)
    if metadata.top_k is not None:
        rows, top_k = metadata.top_k.rows, metadata.top_k.values
        subset = logits[rows]
        # keep exactly k tokens (ties broken by topk), not every token tied with the k-th
        top_indices = subset.topk(metadata.max_top_k, dim=-1).indices
        within_k = torch.arange(top_indices.shape[1], device=logits.device)[None, :] < top_k[:, None]
        keep = torch.zeros_like(subset, dtype=torch.bool).scatter_(1, top_indices, within_k)
        logits[rows] = subset.masked_fill(~keep, neg_inf)
    if metadata.top_p is not None:
        rows = metadata.top_p.rows
        subset = logits[rows]
        sorted_logits, sorted_indices = subset.sort(dim=-1, descending=False)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop the least likely tokens while what remains still holds at least top_p
        drop = cumulative <= 1.0 - metadata.top_p.values[:, None]
        drop[:, -1] = False
        drop = torch.zeros_like(drop).scatter_(1, sorted_indices, drop)
        logits[rows] = subset.masked_fill(drop, neg_inf)
    return logits


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equal ones, as ``torch.argmax``).
    On the CPU through numpy: torch's argmax over a vocabulary-wide row takes about 60 us a
    row, numpy's 4, and a verifying step takes it over every draft's row."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(np.asarray(values.numpy().argmax(axis=-1)))
    return values.argmax(dim=-1)


def _sample_exponential_race(
    logits: torch.Tensor, generators: dict[int, torch.Generator], shared_generator: torch.Generator | None = None
) -> torch.Tensor:
    """argmax(p / q) with q ~ Exponential(1) picks token i with probability p_i; a seeded row
    draws its q from its own generator, so its tokens do not depend on the batch; the other
    rows draw theirs from ``shared_generator`` (the engine's ``--seed``)."""
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=shared_generator)
    for position, generator in generators.items():
        noise[position].exponential_(generator=generator)
    # a zero draw would turn 0/0 into NaN, which argmax would pick
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return row_argmax(probs / noise)


def _failed_rows(processed: torch.Tensor) -> dict[int, str]:
    row_max = processed.amax(dim=-1)
    bad = torch.isneginf(row_max) | torch.isnan(row_max)
    if not bool(bad.any()):
        return {}
    return {
        row: "no token can be sampled: allowed_token_ids, bad_words, min_tokens and the structured-output "
        "constraint together ban every token"
        for row in bad.nonzero().flatten().tolist()
    }


def _token_logprobs(source: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Per row of ``source`` ([n, vocab] logprobs or logits): the chosen token's value and
    rank (1 = best), then the row's ``num_top[i]`` best tokens."""
    chosen_values = source.gather(1, chosen[:, None]).squeeze(1)
    ranks = ((source > chosen_values[:, None]).sum(dim=-1) + 1).tolist()
    max_top = max(num_top, default=0)
    if max_top > 0:
        top = source.topk(min(max_top, source.shape[-1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    chosen_ids, chosen_list = chosen.tolist(), chosen_values.tolist()
    entries = []
    for i, count in enumerate(num_top):
        token_ids = [chosen_ids[i]]
        values = [chosen_list[i]]
        if count > 0:
            token_ids += top_ids[i][:count]
            values += top_values[i][:count]
        entries.append(TokenLogprobs(token_ids=token_ids, logprobs=values, rank=ranks[i]))
    return entries


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor | list[int], num_top: int
) -> list[TokenLogprobs]:
    """Logprobs of each actual next prompt token (row i of ``logits`` predicts
    ``next_token_ids[i]``) plus the ``num_top`` best alternatives at that position."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    next_ids = torch.as_tensor(next_token_ids, dtype=torch.long, device=logprobs.device)
    return _token_logprobs(logprobs, next_ids, [num_top] * logprobs.shape[0])
