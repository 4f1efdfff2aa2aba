"""Beam search on top of the engine, as vLLM does it: every step asks the engine for one token of
each live beam with the top ``2 * beam_width`` logprobs, keeps the ``beam_width`` most likely
extensions, and sets beams that end in EOS aside. Prefix caching makes re-sending a beam's
prompt cheap: only the new token is computed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenloom.core.request import Logprob, RequestOutput, SamplingParams
from tokenloom.errors import InvalidRequestError


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be at least 1, got {self.beam_width}", param="beam_width")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt first), their logprobs, and the running score."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(sequence: BeamSearchSequence, eos_token_ids: set[int], length_penalty: float) -> float:
    """Cumulative logprob over length ** length_penalty (a final EOS does not count in the length)."""
    length = len(sequence.tokens)
    if sequence.tokens and sequence.tokens[-1] in eos_token_ids:
        length -= 1
    return sequence.cum_logprob / math.pow(length, length_penalty)


def beam_search(
    generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]],
    prompts_token_ids: list[list[int]],
    params: BeamSearchParams,
    eos_token_ids: set[int],
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """Run beam search for each prompt; ``generate`` runs one engine pass over token-id prompts."""
    step_params = SamplingParams(
        max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature, ignore_eos=True, detokenize=False
    )
    live = [[BeamSearchSequence(list(ids), len(ids))] for ids in prompts_token_ids]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompts_token_ids]
    for _ in range(params.max_tokens):
        beams = list(itertools.chain.from_iterable(live))
        if not beams:
            break
        outputs = generate([beam.tokens for beam in beams], step_params)
        candidates_by_prompt: dict[int, list[BeamSearchSequence]] = {}
        cursor = 0
        for prompt_index, prompt_beams in enumerate(live):
            candidates = candidates_by_prompt.setdefault(prompt_index, [])
            for beam in prompt_beams:
                sample_logprobs = outputs[cursor].outputs[0].logprobs
                if not sample_logprobs:  # every step asks for them: the engine broke its contract
                    raise RuntimeError("beam search asked for logprobs and the engine returned none")
                logprobs = sample_logprobs[0]
                cursor += 1
                for token_id, logprob in logprobs.items():
                    candidate = BeamSearchSequence(
                        tokens=beam.tokens + [token_id],
                        num_prompt_tokens=beam.num_prompt_tokens,
                        cum_logprob=beam.cum_logprob + logprob.logprob,
                        logprobs=beam.logprobs + [logprobs],
                    )
                    if token_id in eos_token_ids and not params.ignore_eos:
                        candidate.finish_reason = "stop"
                        completed[prompt_index].append(candidate)
                    else:
                        candidates.append(candidate)
        live = [
            sorted(candidates_by_prompt.get(i, []), key=lambda s: s.cum_logprob, reverse=True)[: params.beam_width]
            for i in range(len(live))
        ]
    results = []
    for prompt_index in range(len(prompts_token_ids)):
        for beam in live[prompt_index]:
            beam.finish_reason = "length"
        finished = completed[prompt_index] + live[prompt_index]
        best = sorted(finished, key=lambda s: beam_search_score(s, eos_token_ids, params.length_penalty), reverse=True)[
            : params.beam_width
        ]
        if decode is not None:
            for sequence in best:
                sequence.text = decode(sequence.output_token_ids)
        results.append(BeamSearchOutput(best))
    return results
