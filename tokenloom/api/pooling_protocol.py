"""Pydantic models of the pooling endpoints: OpenAI's embeddings, vLLM's ``/pooling`` and
``/v1/score``, and the Jina/Cohere-style rerank API (``/v1/rerank``, ``/v2/rerank``).

Requests accept unknown fields (named in one log line per request), as the other endpoints do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tokenloom.api.protocol import RequestModel, ResponseModel, unix_now

# one input: text or token ids; a request: one input or a list of them
PoolingInput = str | list[int] | list[str] | list[list[int]]


class PoolingOptions(RequestModel):
    """What every pooling request shares (vLLM's extra parameters)."""

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    """Keep at most this many tokens of each input (-1: the model's context length); text is
    truncated by the tokenizer (special tokens kept), token ids keep their last ones."""
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None


class EmbeddingRequest(PoolingOptions):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest):
    """vLLM's ``/pooling``: the pooler's raw output per input."""


class ScoreRequest(PoolingOptions):
    text_1: str | list[int] | list[str] | list[list[int]]
    text_2: str | list[int] | list[str] | list[list[int]]


class RerankDocument(RequestModel):
    text: str


class RerankRequest(PoolingOptions):
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    """Return the best ``top_n`` documents (0 or absent: all)."""
    return_documents: bool = True


class PoolingUsage(ResponseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingData(ResponseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=unix_now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(ResponseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=unix_now)
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=unix_now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankUsage(ResponseModel):
    total_tokens: int = 0


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
