"""Beam search on top of the engine, as vLLM does it: every step asks the engine for one token of
each live beam with the top ``2 * beam_width`` logprobs, keeps the ``beam_width`` most likely
extensions, and sets beams that end in EOS (or a stop token id) aside. Prefix caching makes
re-sending a beam's prompt cheap: only the new token is computed.

:class:`BeamSearch` holds the search and knows nothing of how a step runs:
:func:`beam_search` drives it with a blocking ``generate`` (``LLM.beam_search``),
:func:`beam_search_async` with an async one (the server, on :class:`AsyncLLM`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tokenloom.core.outputs import Logprob, RequestOutput
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import InvalidRequestError


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    # stop a prompt's search once beam_width of its beams have finished (Hugging Face's
    # early_stopping=True); False searches on to max_tokens, as vLLM does
    early_stopping: bool = False
    # tokens that finish a beam besides the model's EOS (the request's stop_token_ids)
    stop_token_ids: tuple[int, ...] = ()

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
    stop_reason: int | None = None

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


class BeamSearch:
    """The search over one or more prompts, a step at a time: :meth:`pending` gives the beams
    to extend (as token lists), :meth:`advance` takes each one's top logprobs, :meth:`results`
    ranks what finished. Exact: it keeps, per prompt, the ``beam_width`` extensions with the
    highest cumulative logprob (equal lengths, so the same order as the length-penalised
    score) and ranks finished beams by :func:`beam_search_score`."""

    def __init__(self, prompts_token_ids: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int]):
        self.params = params
        self.eos_token_ids = set(eos_token_ids)
        self.finishing_ids = self.eos_token_ids | set(params.stop_token_ids)
        self.num_prompts = len(prompts_token_ids)
        self.live: list[list[BeamSearchSequence]] = [
            [BeamSearchSequence(list(ids), len(ids))] for ids in prompts_token_ids
        ]
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts_token_ids]
        self.num_steps = 0

    @property
    def step_params(self) -> SamplingParams:
        """What each beam's one-token engine request samples with (only its logprobs matter)."""
        return SamplingParams(
            max_tokens=1,
            logprobs=2 * self.params.beam_width,
            temperature=self.params.temperature,
            ignore_eos=True,
            detokenize=False,
        )

    def pending(self) -> list[list[int]]:
        """The token lists of the beams to extend this step, prompt by prompt; empty when done."""
        if self.num_steps >= self.params.max_tokens:
            return []
        return [beam.tokens for beam in itertools.chain.from_iterable(self.live)]

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """Extend the pending beams: ``step_logprobs[i]`` is beam i's top tokens (token id ->
        Logprob), in the order :meth:`pending` gave them."""
        params = self.params
        cursor = 0
        for prompt_index, prompt_beams in enumerate(self.live):
            candidates: list[BeamSearchSequence] = []
            for beam in prompt_beams:
                logprobs = step_logprobs[cursor]
                cursor += 1
                for token_id, logprob in logprobs.items():
                    candidate = BeamSearchSequence(
                        tokens=beam.tokens + [token_id],
                        num_prompt_tokens=beam.num_prompt_tokens,
                        cum_logprob=beam.cum_logprob + logprob.logprob,
                        logprobs=beam.logprobs + [logprobs],
                    )
                    if token_id in self.finishing_ids and not (params.ignore_eos and token_id in self.eos_token_ids):
                        candidate.finish_reason = "stop"
                        candidate.stop_reason = None if token_id in self.eos_token_ids else token_id
                        self.completed[prompt_index].append(candidate)
                    else:
                        candidates.append(candidate)
            candidates.sort(key=lambda s: s.cum_logprob, reverse=True)
            self.live[prompt_index] = candidates[: params.beam_width]
            if params.early_stopping and len(self.completed[prompt_index]) >= params.beam_width:
                self.live[prompt_index] = []
        self.num_steps += 1

    def results(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """Per prompt, its ``beam_width`` best finished or still-live beams, best first."""
        outputs = []
        for prompt_index in range(self.num_prompts):
            for beam in self.live[prompt_index]:
                beam.finish_reason = "length"
            finished = self.completed[prompt_index] + self.live[prompt_index]
            best = sorted(
                finished,
                key=lambda s: beam_search_score(s, self.finishing_ids, self.params.length_penalty),
                reverse=True,
            )[: self.params.beam_width]
            if decode is not None:
                for sequence in best:
                    sequence.text = decode(sequence.output_token_ids)
            outputs.append(BeamSearchOutput(best))
        return outputs


def _top_logprobs(output: RequestOutput) -> dict[int, Logprob]:
    sample_logprobs = output.outputs[0].logprobs if output.outputs else None
    if not sample_logprobs:  # every step asks for them: the engine broke its contract
        raise RuntimeError("beam search asked for logprobs and the engine returned none")
    return sample_logprobs[0]


def beam_search(
    generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]],
    prompts_token_ids: list[list[int]],
    params: BeamSearchParams,
    eos_token_ids: set[int],
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """Run beam search for each prompt; ``generate`` runs one engine pass over token-id prompts."""
    search = BeamSearch(prompts_token_ids, params, eos_token_ids)
    step_params = search.step_params
    while beams := search.pending():
        search.advance([_top_logprobs(output) for output in generate(beams, step_params)])
    return search.results(decode)


async def beam_search_async(
    generate: Callable[[list[list[int]], SamplingParams], Awaitable[list[RequestOutput]]],
    prompts_token_ids: list[list[int]],
    params: BeamSearchParams,
    eos_token_ids: set[int],
    decode: Callable[[list[int]], str] | None = None,
) -> list[BeamSearchOutput]:
    """:func:`beam_search` with an async ``generate`` (each step's beams run as concurrent
    engine requests, batched together by the engine)."""
    search = BeamSearch(prompts_token_ids, params, eos_token_ids)
    step_params = search.step_params
    while beams := search.pending():
        search.advance([_top_logprobs(output) for output in await generate(beams, step_params)])
    return search.results(decode)
