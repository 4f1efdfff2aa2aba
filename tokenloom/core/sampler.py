"""Batched, vectorised sampling, shaped like vLLM v1's sampler: the per-request
:class:`SamplingState`, the per-step :class:`SamplingMetadata` (tensors only for the features
some row uses), the :class:`Sampler` itself and prompt logprobs.

Order of processing: structured-output masks, allowed tokens, bad words, min_tokens, logit
bias, presence/frequency penalties, repetition penalty; then greedy rows take the argmax and
the others go through temperature, min-p, top-k, top-p and an exponential race
(``probs / Exponential(1)``, argmax) whose noise comes from the row's own generator when it
has a seed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenloom.core.batch import TokenLogprobs
from tokenloom.core.request import SamplingParams
from tokenloom.errors import ConfigError, InvalidRequestError

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def tokenize_bad_words(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """Token sequences to ban for ``bad_words``: each word as it appears at the start of a text
    and, when it tokenizes differently, after a space (as it does mid-sentence)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        stripped = word.lstrip()
        for text in (stripped, " " + stripped):
            token_ids = list(tokenizer.encode(text, add_special_tokens=False))
            if token_ids and token_ids not in sequences:
                sequences.append(token_ids)
    return sequences


class SamplingState:
    """One request's sampling state, kept by the model runner for the request's life.

    The runner appends each sampled token to :attr:`output_token_ids`. A seeded request owns
    a ``torch.Generator`` seeded once here, so its tokens depend only on its seed and logits,
    never on the rest of the batch. Call :meth:`validate` when the request arrives so a bad
    token id fails that request alone.
    """

    def __init__(
        self,
        sampling_params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int] | None = None,
        *,
        bad_words_token_ids: list[list[int]] | None = None,
        eos_token_ids: set[int] | list[int] | tuple[int, ...] = (),
        device: torch.device | str = "cpu",
    ):
        params = sampling_params
        self.sampling_params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = list(output_token_ids or [])
        self.bad_words_token_ids = [list(sequence) for sequence in bad_words_token_ids or [] if sequence]
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.device = torch.device(device)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
        # tokens banned while fewer than min_tokens were generated
        min_tokens_banned = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            min_tokens_banned.update(self.eos_token_ids)
        self.min_tokens_banned_ids = sorted(min_tokens_banned) if params.min_tokens > 0 else []
        self.is_greedy = params.greedy
        self.uses_penalties = (
            params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
        )
        # built lazily on the first step that needs them, then reused every step
        self._validated_vocab_size: int | None = None
        self._allowed_mask: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._output_counts: torch.Tensor | None = None
        self._num_counted_tokens = 0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError when a token id in the parameters is outside the vocabulary."""
        if self._validated_vocab_size == vocab_size:
            return
        params = self.sampling_params

        def check(param: str, token_ids) -> None:
            for token_id in token_ids:
                if not 0 <= token_id < vocab_size:
                    raise InvalidRequestError(
                        f"{param} holds token id {token_id}, outside the vocabulary [0, {vocab_size})",
                        param=param,
                    )

        check("allowed_token_ids", params.allowed_token_ids or [])
        check("logit_bias", (params.logit_bias or {}).keys())
        check("bad_words", (token_id for sequence in self.bad_words_token_ids for token_id in sequence))
        check("stop_token_ids", params.stop_token_ids or [])
        # eos ids come from model files, not from the request: drop the unusable ones
        self.min_tokens_banned_ids = [token_id for token_id in self.min_tokens_banned_ids if token_id < vocab_size]
        self._validated_vocab_size = vocab_size

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        if self._allowed_mask is None:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            mask[torch.tensor(self.sampling_params.allowed_token_ids, device=self.device)] = True
            self._allowed_mask = mask
        return self._allowed_mask

    def prompt_mask(self, vocab_size: int) -> torch.Tensor:
        if self._prompt_mask is None:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            prompt = torch.tensor(self.prompt_token_ids, dtype=torch.long, device=self.device)
            mask[prompt[prompt < vocab_size]] = True
            self._prompt_mask = mask
        return self._prompt_mask

    def output_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token occurs in the output, counted incrementally across steps."""
        if self._output_counts is None or len(self.output_token_ids) < self._num_counted_tokens:
            self._output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)
            self._num_counted_tokens = 0
        new_tokens = self.output_token_ids[self._num_counted_tokens :]
        if new_tokens:
            token_ids = torch.tensor(new_tokens, dtype=torch.long, device=self.device)
            self._output_counts.index_add_(0, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
            self._num_counted_tokens = len(self.output_token_ids)
        return self._output_counts

    def banned_token_ids(self) -> list[int]:
        """Tokens this step may not produce: bad-words endings whose preceding tokens end the
        output, and eos/stop tokens while min_tokens is not reached."""
        output = self.output_token_ids
        banned = list(self.min_tokens_banned_ids) if len(output) < self.sampling_params.min_tokens else []
        for sequence in self.bad_words_token_ids:
            prefix_len = len(sequence) - 1
            if prefix_len == 0 or (len(output) >= prefix_len and output[-prefix_len:] == sequence[:-1]):
                banned.append(sequence[-1])
        return banned


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass
class SamplingMetadata:
    """One step's sampling inputs. Row-subset features hold the row indices they apply to;
    a feature no row uses is None and costs nothing."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    # rows sampled at random; None when every row is random (or none is: see all_greedy)
    random_rows: torch.Tensor | None = None
    # per random row: temperature, and top-k / top-p / min-p when some random row uses them
    temperature: torch.Tensor | None = None
    top_k_rows: torch.Tensor | None = None  # indices into the random rows
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p_rows: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    # position among the random rows -> that request's generator
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    allowed_rows: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None  # [len(allowed_rows), vocab] True = allowed
    # structured outputs: packed int32 bitmask rows ([len(grammar_rows), ceil(vocab / 32)], bit = allowed)
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None  # bad words and min_tokens: (row, token) pairs
    banned_token_ids: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    penalty_rows: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # [len(penalty_rows), vocab]
    prompt_mask: torch.Tensor | None = None  # [len(penalty_rows), vocab], with a repetition penalty
    # rows that asked for logprobs, and how many alternatives each wants
    logprob_rows: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)

    @property
    def modifies_logits(self) -> bool:
        return any(
            rows is not None
            for rows in (self.grammar_rows, self.allowed_rows, self.banned_rows, self.bias_rows, self.penalty_rows)
        )

    @classmethod
    def build(
        cls,
        states: list[SamplingState],
        vocab_size: int,
        device: torch.device | str = "cpu",
        step_allowed_token_ids: list[list[int] | None] | None = None,
        grammar_rows: list[int] | None = None,
        grammar_bitmask: torch.Tensor | None = None,
    ) -> "SamplingMetadata":
        """Gather the step's inputs from the batch's states (row i of the logits is states[i]).

        ``step_allowed_token_ids`` optionally gives, per row, this step's allowed tokens from a
        structured-output matcher; they are intersected with ``allowed_token_ids``.
        ``grammar_bitmask`` row j (packed int32 bits, 1 = allowed) constrains ``grammar_rows[j]``.
        """
        device = torch.device(device)
        random_rows: list[int] = []
        temperature: list[float] = []
        top_k_rows: list[int] = []
        top_k: list[int] = []
        top_p_rows: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        generators: dict[int, torch.Generator] = {}
        allowed_rows: list[int] = []
        allowed_masks: list[torch.Tensor] = []
        banned_rows: list[int] = []
        banned_token_ids: list[int] = []
        bias_rows: list[int] = []
        bias_token_ids: list[int] = []
        bias_values: list[float] = []
        penalty_states: list[tuple[int, SamplingState]] = []
        metadata = cls(num_rows=len(states), vocab_size=vocab_size, all_greedy=False)
        if grammar_rows:
            metadata.grammar_rows = _long(grammar_rows, device)
            metadata.grammar_bitmask = grammar_bitmask.to(device)

        for row, state in enumerate(states):
            state.validate(vocab_size)
            params = state.sampling_params
            if not state.is_greedy:
                position = len(random_rows)
                random_rows.append(row)
                temperature.append(params.temperature)
                if 0 < params.top_k < vocab_size:
                    top_k_rows.append(position)
                    top_k.append(params.top_k)
                if params.top_p < 1.0:
                    top_p_rows.append(position)
                    top_p.append(params.top_p)
                min_p.append(params.min_p)
                if state.generator is not None:
                    generators[position] = state.generator
            step_allowed = step_allowed_token_ids[row] if step_allowed_token_ids else None
            if params.allowed_token_ids or step_allowed is not None:
                allowed_rows.append(row)
                allowed_masks.append(_allowed_mask(state, step_allowed, vocab_size, device))
            banned = state.banned_token_ids()
            if banned:
                banned_rows.extend([row] * len(banned))
                banned_token_ids.extend(banned)
            if params.logit_bias:
                bias_rows.extend([row] * len(params.logit_bias))
                bias_token_ids.extend(params.logit_bias.keys())
                bias_values.extend(params.logit_bias.values())
            if state.uses_penalties:
                penalty_states.append((row, state))
            if params.logprobs is not None:
                metadata.logprob_rows.append(row)
                metadata.num_logprobs.append(params.logprobs)

        metadata.all_greedy = not random_rows
        if random_rows:
            if len(random_rows) < len(states):
                metadata.random_rows = _long(random_rows, device)
            metadata.temperature = _float(temperature, device)
            metadata.generators = generators
            if top_k_rows:
                metadata.top_k_rows, metadata.top_k = _long(top_k_rows, device), _long(top_k, device)
                metadata.max_top_k = max(top_k)
            if top_p_rows:
                metadata.top_p_rows, metadata.top_p = _long(top_p_rows, device), _float(top_p, device)
            if any(value > 0.0 for value in min_p):
                metadata.min_p = _float(min_p, device)
        if allowed_rows:
            metadata.allowed_rows = _long(allowed_rows, device)
            metadata.allowed_mask = torch.stack(allowed_masks)
        if banned_rows:
            metadata.banned_rows = _long(banned_rows, device)
            metadata.banned_token_ids = _long(banned_token_ids, device)
        if bias_rows:
            metadata.bias_rows = _long(bias_rows, device)
            metadata.bias_token_ids = _long(bias_token_ids, device)
            metadata.bias_values = _float(bias_values, device)
        if penalty_states:
            rows = [row for row, _ in penalty_states]
            penalized = [state for _, state in penalty_states]
            metadata.penalty_rows = _long(rows, device)
            metadata.presence_penalties = _float([s.sampling_params.presence_penalty for s in penalized], device)
            metadata.frequency_penalties = _float([s.sampling_params.frequency_penalty for s in penalized], device)
            metadata.output_counts = torch.stack([s.output_counts(vocab_size) for s in penalized]).to(device)
            if any(s.sampling_params.repetition_penalty != 1.0 for s in penalized):
                metadata.repetition_penalties = _float(
                    [s.sampling_params.repetition_penalty for s in penalized], device
                )
                metadata.prompt_mask = torch.stack([s.prompt_mask(vocab_size) for s in penalized]).to(device)
        return metadata


def _allowed_mask(
    state: SamplingState, step_allowed: list[int] | None, vocab_size: int, device: torch.device
) -> torch.Tensor:
    if step_allowed is None:
        return state.allowed_mask(vocab_size).to(device)
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    step_ids = _long(step_allowed, device)
    mask[step_ids[(step_ids >= 0) & (step_ids < vocab_size)]] = True
    if state.sampling_params.allowed_token_ids:
        mask &= state.allowed_mask(vocab_size).to(device)
    return mask


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

    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(
                f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}",
                param="logprobs_mode",
            )
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        mode = self.logprobs_mode
        wants_logprobs = bool(metadata.logprob_rows)
        logprobs_source = None
        if wants_logprobs and mode.startswith("raw"):
            logprobs_source = logits[metadata.logprob_rows]

        processed = _apply_logits_processors(logits.clone(), metadata) if metadata.modifies_logits else logits
        errors = _failed_rows(processed) if metadata.modifies_logits else {}
        if metadata.all_greedy:
            token_ids = processed.argmax(dim=-1)
        else:
            random_rows = metadata.random_rows
            random_logits = processed if random_rows is None else processed[random_rows]
            random_logits = _apply_temperature_and_truncation(random_logits, metadata)
            random_tokens = _sample_exponential_race(random_logits, metadata.generators)
            if random_rows is None:
                token_ids = random_tokens
            else:
                token_ids = processed.argmax(dim=-1)
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
        # numpy unpacks bits ~10x faster than torch's shifts on the CPU (and needs no threads)
        packed = bitmask.contiguous().numpy().view(np.uint8)
        allowed = torch.from_numpy(np.unpackbits(packed, axis=-1, bitorder="little").view(np.bool_))
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def _apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Masks, bias and penalties, in place on the (cloned) logits."""
    neg_inf = float("-inf")
    if metadata.grammar_rows is not None:
        rows = metadata.grammar_rows
        allowed = unpack_bitmask(metadata.grammar_bitmask, logits.shape[-1])
        logits[rows] = logits[rows].masked_fill(~allowed, neg_inf)
    if metadata.allowed_rows is not None:
        rows = metadata.allowed_rows
        logits[rows] = logits[rows].masked_fill(~metadata.allowed_mask, neg_inf)
    if metadata.banned_rows is not None:
        logits[metadata.banned_rows, metadata.banned_token_ids] = neg_inf
    if metadata.bias_rows is not None:
        logits.index_put_((metadata.bias_rows, metadata.bias_token_ids), metadata.bias_values, accumulate=True)
    if metadata.penalty_rows is not None:
        rows = metadata.penalty_rows
        penalized = logits[rows]
        counts = metadata.output_counts
        occurred = counts > 0
        penalized -= metadata.frequency_penalties[:, None] * counts
        penalized -= metadata.presence_penalties[:, None] * occurred
        if metadata.repetition_penalties is not None:
            seen = occurred | metadata.prompt_mask
            penalties = torch.where(seen, metadata.repetition_penalties[:, None], 1.0)
            penalized = torch.where(penalized > 0, penalized / penalties, penalized * penalties)
        logits[rows] = penalized
    return logits


def _apply_temperature_and_truncation(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p for the random rows (a new tensor)."""
    neg_inf = float("-inf")
    logits = logits / metadata.temperature[:, None]
    if metadata.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * metadata.min_p[:, None]
        logits.masked_fill_(probs < threshold, neg_inf)
    if metadata.top_k_rows is not None:
        rows, top_k = metadata.top_k_rows, metadata.top_k
        subset = logits[rows]
        # keep exactly k tokens (ties broken by topk), not every token tied with the k-th
        top_indices = subset.topk(metadata.max_top_k, dim=-1).indices
        within_k = torch.arange(top_indices.shape[1], device=logits.device)[None, :] < top_k[:, None]
        keep = torch.zeros_like(subset, dtype=torch.bool).scatter_(1, top_indices, within_k)
        logits[rows] = subset.masked_fill(~keep, neg_inf)
    if metadata.top_p_rows is not None:
        rows = metadata.top_p_rows
        subset = logits[rows]
        sorted_logits, sorted_indices = subset.sort(dim=-1, descending=False)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop the least likely tokens while what remains still holds at least top_p
        drop = cumulative <= 1.0 - metadata.top_p[:, None]
        drop[:, -1] = False
        drop = torch.zeros_like(drop).scatter_(1, sorted_indices, drop)
        logits[rows] = subset.masked_fill(drop, neg_inf)
    return logits


def _sample_exponential_race(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exponential(1) picks token i with probability p_i; a seeded row
    draws its q from its own generator, so its tokens do not depend on the batch."""
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for position, generator in generators.items():
        noise[position].exponential_(generator=generator)
    # a zero draw would turn 0/0 into NaN, which argmax would pick
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


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
