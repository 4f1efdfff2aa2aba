"""The inputs of batched sampling: each request's :class:`SamplingState` (kept by the model
runner for the request's life: seeded generator, cached masks and counts) and one step's
:class:`SamplingMetadata`, gathered from the batch's states with tensors only for the
features some row uses. :mod:`tokenloom.core.sampler` consumes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.core.logits_processors import LogitsProcessorSpec, ProcessorFn, build_processor
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import InvalidRequestError


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
        engine_logits_processors: list[LogitsProcessorSpec] | tuple[LogitsProcessorSpec, ...] = (),
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
        # --logits-processors (every request) first, then the request's own; built on first use
        self._processor_specs: list[Any] = list(engine_logits_processors) + list(params.logits_processors or [])
        self._processors: list[ProcessorFn] | None = None
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

        def check(param: str, token_ids: Iterable[int]) -> None:
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

    @property
    def uses_logits_processors(self) -> bool:
        return bool(self._processor_specs)

    def logits_processors(self) -> list[ProcessorFn]:
        """This request's processor instances, built once (in the worker) on first use."""
        if self._processors is None:
            self._processors = [build_processor(spec) for spec in self._processor_specs]
        return self._processors

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
class RowTokens:
    """(row, token) pairs: ``rows[i]`` may not produce ``token_ids[i]`` (banned tokens)."""

    rows: torch.Tensor
    token_ids: torch.Tensor


@dataclass
class LogitBias:
    """(row, token, bias) triples added to the logits."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    values: torch.Tensor


@dataclass
class RowMasks:
    """Per listed row, a mask over the vocabulary: ``[len(rows), vocab]`` bool (True =
    allowed), or for a grammar packed int32 bit rows (bit ``t % 32`` of word ``t // 32`` =
    token t allowed)."""

    rows: torch.Tensor
    masks: torch.Tensor


@dataclass
class Penalties:
    """Presence, frequency and (optionally) repetition penalties of the listed rows."""

    rows: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    output_counts: torch.Tensor  # [len(rows), vocab]
    repetition: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None  # [len(rows), vocab], with a repetition penalty


@dataclass
class RowValues:
    """A value for some of the random rows (``rows`` index the random rows): top-k, top-p."""

    rows: torch.Tensor
    values: torch.Tensor


@dataclass
class SamplingMetadata:
    """One step's sampling inputs. Row-subset features hold the row indices they apply to;
    a feature no row uses is None and costs nothing."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    # rows sampled at random; None when every row is random (or none is: see all_greedy)
    random_rows: torch.Tensor | None = None
    # per random row: temperature (set unless all_greedy), and top-k / top-p / min-p when
    # some random row uses them
    temperature: torch.Tensor | None = None
    top_k: RowValues | None = None
    max_top_k: int = 0
    top_p: RowValues | None = None
    min_p: torch.Tensor | None = None
    # position among the random rows -> that request's generator
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    allowed: RowMasks | None = None
    grammar: RowMasks | None = None  # structured outputs: packed bitmask rows
    banned: RowTokens | None = None  # bad words and min_tokens
    bias: LogitBias | None = None
    penalties: Penalties | None = None
    # rows that asked for logprobs, and how many alternatives each wants
    logprob_rows: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)
    # rows with logits processors (--logits-processors, or the request's logits_processors)
    processor_rows: list[tuple[int, SamplingState]] = field(default_factory=list)

    @property
    def modifies_logits(self) -> bool:
        return bool(self.processor_rows) or any(
            feature is not None for feature in (self.grammar, self.allowed, self.banned, self.bias, self.penalties)
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
    ) -> SamplingMetadata:
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
            if grammar_bitmask is None:
                raise ValueError("grammar_rows need their grammar_bitmask")
            metadata.grammar = RowMasks(_long(grammar_rows, device), grammar_bitmask.to(device))

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
            if state.uses_logits_processors:
                metadata.processor_rows.append((row, state))
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
                metadata.top_k = RowValues(_long(top_k_rows, device), _long(top_k, device))
                metadata.max_top_k = max(top_k)
            if top_p_rows:
                metadata.top_p = RowValues(_long(top_p_rows, device), _float(top_p, device))
            if any(value > 0.0 for value in min_p):
                metadata.min_p = _float(min_p, device)
        if allowed_rows:
            metadata.allowed = RowMasks(_long(allowed_rows, device), torch.stack(allowed_masks))
        if banned_rows:
            metadata.banned = RowTokens(_long(banned_rows, device), _long(banned_token_ids, device))
        if bias_rows:
            metadata.bias = LogitBias(
                _long(bias_rows, device), _long(bias_token_ids, device), _float(bias_values, device)
            )
        if penalty_states:
            penalized = [state for _, state in penalty_states]
            metadata.penalties = Penalties(
                rows=_long([row for row, _ in penalty_states], device),
                presence=_float([s.sampling_params.presence_penalty for s in penalized], device),
                frequency=_float([s.sampling_params.frequency_penalty for s in penalized], device),
                output_counts=torch.stack([s.output_counts(vocab_size) for s in penalized]).to(device),
            )
            if any(s.sampling_params.repetition_penalty != 1.0 for s in penalized):
                metadata.penalties.repetition = _float(
                    [s.sampling_params.repetition_penalty for s in penalized], device
                )
                metadata.penalties.prompt_mask = torch.stack([s.prompt_mask(vocab_size) for s in penalized]).to(device)
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
