"""What the engine gives back, shaped like vLLM's: :class:`RequestOutput` (a generate
request's outputs, text, logprobs and metrics) and :class:`PoolingRequestOutput` (a pooling
request's vector or score)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# a "logprob" entry: token id -> Logprob
SampleLogprobs = list[dict[int, "Logprob"]]


PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's ``n`` outputs (``RequestOutput.outputs[i]``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns and ``AsyncLLM.generate`` yields, like vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class PoolingOutput:
    """The pooled output of one prompt: a float32 CPU tensor (``[hidden_size]`` for embeddings)."""

    data: Any


@dataclass
class EmbeddingOutput:
    """One prompt's embedding as a list of floats (``LLM.embed``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    """The similarity score of one (text_1, text_2) pair (``LLM.score``)."""

    score: float


@dataclass
class PoolingRequestOutput:
    """What ``LLM.encode/embed/score`` return and ``AsyncLLM.encode`` yields: ``outputs`` is a
    :class:`PoolingOutput`, :class:`EmbeddingOutput` or :class:`ScoringOutput`."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    error: str | None = None
