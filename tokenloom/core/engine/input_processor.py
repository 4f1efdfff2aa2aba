"""The input side of the engine: a request's prompt tokenized and checked against the model's
limits, its sampling parameters checked, and the ``n`` sequences of a request built, before
anything reaches the scheduler. Everything here may raise
:class:`~tokenloom.errors.InvalidRequestError`; nothing here changes engine state, so a request
refused here leaves no trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tokenloom.core.multimodal.inputs import MultiModalItem, check_items
from tokenloom.core.pooling import check_pooling_params, prepare_pooling_prompt
from tokenloom.core.sampling_metadata import SamplingState, tokenize_bad_words
from tokenloom.core.sampling_params import PoolingParams, RequestOutputKind, SamplingParams, unwrap_prompt
from tokenloom.core.sequence import EngineSequence
from tokenloom.errors import ContextLengthError, InvalidRequestError


@dataclass(frozen=True)
class PreparedPrompt:
    """A validated prompt: its token ids (and text when it came as text)."""

    prompt_token_ids: list[int]
    prompt: str | None
    # the prompt's images, their placeholders expanded in prompt_token_ids (a dict prompt's "mm_items")
    mm_items: tuple[MultiModalItem, ...] = ()


@dataclass(frozen=True)
class ModelLimits:
    """What the input processor checks prompts and parameters against."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int  # KV-cache blocks: a prompt needing more can never run
    max_logprobs: int
    eos_token_ids: tuple[int, ...]


class InputProcessor:
    """Turns what a caller sends (a prompt, parameters) into what the scheduler takes."""

    def __init__(self, tokenizer: Any, limits: ModelLimits, hf_config: Any = None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.hf_config = hf_config  # pooling params are checked against it

    def prepare_prompt(self, prompt: Any, params: SamplingParams) -> PreparedPrompt:
        """Tokenize and validate a prompt: text, token ids, or vLLM's dict forms."""
        text: str | None = None
        mm_items = tuple(prompt.get("mm_items") or ()) if isinstance(prompt, dict) else ()
        prompt = unwrap_prompt(prompt, "prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "the tokenizer was skipped (--skip-tokenizer-init): send token ids", param="prompt"
                )
            text = prompt
            token_ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
            vocab_size = self.limits.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is out of the vocabulary [0, {vocab_size})", param="prompt"
                )
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if params.truncate_prompt_tokens is not None:
            if mm_items and params.truncate_prompt_tokens < len(token_ids):
                raise InvalidRequestError(
                    "truncate_prompt_tokens would cut into a prompt with images; drop it or send fewer tokens",
                    param="truncate_prompt_tokens",
                )
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        check_items(mm_items, len(token_ids))
        self.check_fits(len(token_ids), params)
        return PreparedPrompt(token_ids, text, mm_items)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise unless a prompt of this length, sampled with ``params``, can ever run."""
        max_model_len = self.limits.max_model_len
        if num_prompt_tokens + 1 > max_model_len:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens, but the model's context length is "
                f"{max_model_len}: shorten the prompt (or use truncate_prompt_tokens)",
                param="prompt",
            )
        block_size, num_blocks = self.limits.block_size, self.limits.num_blocks
        if -(-(num_prompt_tokens + 1) // block_size) > num_blocks:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, more than the whole KV cache holds "
                f"({num_blocks} blocks of {block_size})",
                param="prompt",
            )
        SamplingState(params, []).validate(self.limits.vocab_size)  # token ids in params are in range
        max_logprobs = self.limits.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise InvalidRequestError(f"{name} {value} is more than --max-logprobs {max_logprobs}", param=name)

    def prepare_pooling_prompt(self, prompt: Any, params: PoolingParams) -> PreparedPrompt:
        """Tokenize, truncate and validate a pooling prompt and its params."""
        check_pooling_params(params, self.hf_config)
        token_ids, text = prepare_pooling_prompt(
            prompt, params, self.tokenizer, self.limits.vocab_size, self.limits.max_model_len
        )
        return PreparedPrompt(token_ids, text)

    def with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """Tokenize ``bad_words`` once, here, so the worker needs no tokenizer."""
        if not params.bad_words or self.tokenizer is None:
            return params
        extra = dict(params.extra_args or {})
        extra["bad_words_token_ids"] = tokenize_bad_words(self.tokenizer, params.bad_words)
        return params.clone(extra_args=extra)

    def build_sequences(
        self,
        request_id: str,
        prepared: PreparedPrompt,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[EngineSequence]:
        """The ``params.n`` sequences of one request, ids ``request_id`` (n = 1) or
        ``request_id#index``; seeded requests give each sequence its own seed."""
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        sequences = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + index)  # distinct but reproducible
            sequences.append(
                EngineSequence(
                    seq_id=make_seq_id(request_id, index, params.n),
                    prompt_token_ids=list(prepared.prompt_token_ids),
                    sampling_params=child_params,
                    eos_token_ids=set(self.limits.eos_token_ids),
                    arrival_time=arrival_time,
                    priority=priority,
                    request_id=request_id,
                    index=index,
                    prompt=prepared.prompt,
                    mm_items=list(prepared.mm_items),
                )
            )
        return sequences

    def build_pooling_sequence(
        self,
        request_id: str,
        prepared: PreparedPrompt,
        params: PoolingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> EngineSequence:
        """The one prefill-only sequence of a pooling request."""
        # the sampling params are inert: the runner pools this request and never samples it
        sampling_params = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        return EngineSequence(
            seq_id=request_id,
            prompt_token_ids=list(prepared.prompt_token_ids),
            sampling_params=sampling_params,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            request_id=request_id,
            prompt=prepared.prompt,
            pooling_params=params,
        )


def make_seq_id(request_id: str, index: int, n: int) -> str:
    """The scheduler's id of sequence ``index`` of a request with ``n`` sequences."""
    return request_id if n == 1 else f"{request_id}#{index}"
