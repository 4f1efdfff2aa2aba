"""The pooling endpoints, served when the model runs on the pooling runner:
``POST /v1/embeddings`` (OpenAI), ``/pooling`` (vLLM), ``/v1/score`` (vLLM) and
``/v1/rerank`` + ``/v2/rerank`` (Jina/Cohere). Scores are the cosine similarity of
embeddings (bi-encoders such as all-MiniLM-L6-v2).

Every input of a request becomes one engine request; the scheduler batches them under its
token budget. All inputs are tokenized and checked before the first is queued, so a bad
input fails the request with a 400 and leaves nothing running.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenloom.api.engine_runs import ClientDisconnected, cancel_on_disconnect
from tokenloom.api.http_errors import request_id_of
from tokenloom.api.pooling_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingOptions,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from tokenloom.api.prompt_inputs import OFF_LOOP_TOKENIZE_CHARS, input_size, off_loop_if_large
from tokenloom.api.serving_base import ServingContext
from tokenloom.core.pooling import check_pooling_params, cosine_similarity, score_inputs
from tokenloom.core.sampling_params import PoolingParams
from tokenloom.errors import ContextLengthError, InvalidRequestError, TokenloomError

logger = logging.getLogger(__name__)

POOLING_PATHS = ("/v1/embeddings", "/pooling", "/v1/score", "/v1/rerank", "/v2/rerank")
# status nginx uses for "client closed request"; nobody reads it
CLIENT_CLOSED_STATUS = 499


def encode_vector(vector: Any, encoding_format: str) -> list[float] | str:
    """A float32 tensor as JSON floats, or as base64 of its little-endian float32 bytes
    (what OpenAI clients decode with ``numpy.frombuffer(..., dtype="float32")``)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode("ascii")
    floats: list[float] = vector.float().tolist()
    return floats


class PoolingHandler:
    """Tokenizes and checks inputs, runs them through ``engine.encode`` and shapes responses."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    # -- inputs ---------------------------------------------------------------------------

    def _as_inputs(self, value: Any, param: str) -> list[str | list[int]]:
        """One input or a list of them, as a non-empty list."""
        if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
            inputs = [value]
        else:
            inputs = list(value)
        if not inputs:
            raise InvalidRequestError(f"{param} is empty: send a string, a list of strings or token ids", param=param)
        return inputs

    def _truncation(self, options: PoolingOptions) -> int | None:
        truncate = options.truncate_prompt_tokens
        if truncate is None:
            return None
        if truncate == -1:
            return self.ctx.max_model_len
        if truncate < 1:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 (the context length) or at least 1, got {truncate}",
                param="truncate_prompt_tokens",
            )
        return truncate

    async def tokenize_inputs(
        self, inputs: Sequence[str | list[int]], options: PoolingOptions, param: str
    ) -> list[list[int]]:
        """Token ids of every input (texts in one batched tokenizer call), truncated and
        checked against the vocabulary and the context length; in a worker thread when the
        inputs are large, and always when texts are truncated (the truncating tokenizer is
        taken one call at a time, which the event loop must never wait for)."""
        truncate = self._truncation(options)
        if truncate is not None and any(isinstance(item, str) for item in inputs):
            return await anyio.to_thread.run_sync(self._tokenize_inputs, inputs, options, truncate, param)
        return await off_loop_if_large(
            input_size(inputs), OFF_LOOP_TOKENIZE_CHARS, self._tokenize_inputs, inputs, options, truncate, param
        )

    def _tokenize_inputs(
        self, inputs: Sequence[str | list[int]], options: PoolingOptions, truncate: int | None, param: str
    ) -> list[list[int]]:
        texts = [(index, text) for index, text in enumerate(inputs) if isinstance(text, str)]
        for index, text in texts:
            if not text:
                raise InvalidRequestError(f"{param}[{index}] is an empty string", param=param)
        token_ids_by_index: dict[int, list[int]] = {}
        if texts:
            self.ctx.require_tokenizer("a text input", param)
            batch = [text for _, text in texts]
            if truncate is None:
                encoded = self.ctx.tokenizer(batch, add_special_tokens=options.add_special_tokens)["input_ids"]
            else:
                with self.ctx.truncating_tokenizer() as tokenizer:
                    encoded = tokenizer(
                        batch, add_special_tokens=options.add_special_tokens, truncation=True, max_length=truncate
                    )["input_ids"]
            for (index, _), ids in zip(texts, encoded):
                token_ids_by_index[index] = list(ids)
        for index, value in enumerate(inputs):
            if isinstance(value, str):
                continue
            if not value:
                raise InvalidRequestError(f"{param}[{index}] is an empty list of token ids", param=param)
            self.ctx.check_token_ids(value, param)
            token_ids_by_index[index] = list(value)[-truncate:] if truncate is not None else list(value)
        token_ids = [token_ids_by_index[index] for index in range(len(inputs))]  # every input is one of the two
        limit = self.ctx.max_model_len
        for index, ids in enumerate(token_ids):
            if len(ids) > limit:
                raise ContextLengthError(
                    f"{param}[{index}] has {len(ids)} tokens, but this model takes at most {limit}: shorten it or set "
                    "truncate_prompt_tokens",
                    param=param,
                )
        return token_ids

    def pooling_params(self, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        params = PoolingParams(dimensions=dimensions, normalize=normalize)
        hf_config = self.ctx.engine.hf_config
        if hf_config is not None:
            check_pooling_params(params, hf_config)
        return params

    # -- the engine ---------------------------------------------------------------------------

    async def encode_all(
        self, raw_request: Request, token_ids: list[list[int]], params: PoolingParams, request_id: str, priority: int
    ) -> list[Any]:
        """The pooled tensor of every input, in order; the client going away aborts them all."""

        async def encode_one(index: int, ids: list[int]) -> Any:
            final = None
            async for output in self.ctx.engine.encode(ids, params, f"{request_id}-{index}", priority=priority):
                final = output
            if final is None or final.error:
                raise TokenloomError(
                    f"input {index} failed in the engine: {final.error if final is not None else 'no output'}"
                )
            return final.outputs.data

        async def run_all() -> list[Any]:
            tasks = [asyncio.ensure_future(encode_one(index, ids)) for index, ids in enumerate(token_ids)]
            try:
                return await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()  # one failed: the rest are aborted in the engine
                await asyncio.gather(*tasks, return_exceptions=True)

        return await cancel_on_disconnect(raw_request, run_all())

    def _request_id(self, raw_request: Request, options: PoolingOptions, prefix: str) -> str:
        return f"{prefix}-{options.request_id or request_id_of(raw_request)}"

    def _begin(self, request: PoolingOptions, endpoint: str) -> str:
        self.ctx.check_ready()
        model_name = self.ctx.check_model(request.model)
        self.ctx.warn_unknown_fields(request, endpoint)
        return model_name

    # -- endpoints ------------------------------------------------------------------------------

    async def embeddings(
        self,
        request: EmbeddingRequest,
        raw_request: Request,
        *,
        endpoint: str = "/v1/embeddings",
        object_kind: str = "embedding",
    ) -> Response:
        model_name = self._begin(request, endpoint)
        params = self.pooling_params(request.dimensions, request.normalize)
        token_ids = await self.tokenize_inputs(self._as_inputs(request.input, "input"), request, "input")
        request_id = self._request_id(raw_request, request, "embd" if object_kind == "embedding" else "pool")
        vectors = await self.encode_all(raw_request, token_ids, params, request_id, request.priority)
        num_tokens = sum(len(ids) for ids in token_ids)
        usage = PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        body: EmbeddingResponse | PoolingResponse
        if object_kind == "embedding":
            embeddings = [
                EmbeddingData(index=index, embedding=encode_vector(vector, request.encoding_format))
                for index, vector in enumerate(vectors)
            ]
            body = EmbeddingResponse(id=request_id, model=model_name, data=embeddings, usage=usage)
        else:
            pooled = [
                PoolingData(index=index, data=encode_vector(vector, request.encoding_format))
                for index, vector in enumerate(vectors)
            ]
            body = PoolingResponse(id=request_id, model=model_name, data=pooled, usage=usage)
        return JSONResponse(body.model_dump())

    async def _similarities(
        self,
        raw_request: Request,
        options: PoolingOptions,
        first: Sequence[str | list[int]],
        second: Sequence[str | list[int]],
        pairs: list[tuple[int, int]],
        param_1: str,
        param_2: str,
        request_id: str,
    ) -> tuple[list[float], int]:
        """Cosine similarity of each pair's embeddings, and the tokens embedded."""
        first_ids = await self.tokenize_inputs(first, options, param_1)
        second_ids = await self.tokenize_inputs(second, options, param_2)
        vectors = await self.encode_all(
            raw_request, first_ids + second_ids, self.pooling_params(), request_id, options.priority
        )
        first_vectors, second_vectors = vectors[: len(first_ids)], vectors[len(first_ids) :]
        scores = [cosine_similarity(first_vectors[i], second_vectors[j]) for i, j in pairs]
        return scores, sum(len(ids) for ids in first_ids + second_ids)

    async def score(self, request: ScoreRequest, raw_request: Request) -> Response:
        model_name = self._begin(request, "/v1/score")
        first, second, pairs = score_inputs(request.text_1, request.text_2)
        request_id = self._request_id(raw_request, request, "score")
        scores, num_tokens = await self._similarities(
            raw_request, request, first, second, pairs, "text_1", "text_2", request_id
        )
        body = ScoreResponse(
            id=request_id,
            model=model_name,
            usage=PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
            data=[ScoreData(index=index, score=score) for index, score in enumerate(scores)],
        )
        return JSONResponse(body.model_dump())

    async def rerank(self, request: RerankRequest, raw_request: Request, endpoint: str) -> Response:
        model_name = self._begin(request, endpoint)
        documents = [doc.text if isinstance(doc, RerankDocument) else doc for doc in request.documents]
        if not documents:
            raise InvalidRequestError("documents is empty: send at least one document", param="documents")
        if request.top_n is not None and request.top_n < 0:
            raise InvalidRequestError(
                f"top_n must be positive (or 0 for all documents), got {request.top_n}", param="top_n"
            )
        if not request.query:
            raise InvalidRequestError("query is an empty string", param="query")
        request_id = self._request_id(raw_request, request, "rerank")
        scores, num_tokens = await self._similarities(
            raw_request,
            request,
            [request.query],
            documents,
            [(0, index) for index in range(len(documents))],
            "query",
            "documents",
            request_id,
        )
        ranked = sorted(range(len(documents)), key=lambda index: scores[index], reverse=True)
        if request.top_n:
            ranked = ranked[: request.top_n]
        results = [
            RerankResult(
                index=index,
                relevance_score=scores[index],
                document=RerankDocument(text=documents[index]) if request.return_documents else None,
            )
            for index in ranked
        ]
        body = RerankResponse(
            id=request_id, model=model_name, usage=RerankUsage(total_tokens=num_tokens), results=results
        )
        return JSONResponse(body.model_dump(exclude_none=True))


def pooling_routes(
    ctx: ServingContext, guard: Callable[[Request, Awaitable[Response]], Awaitable[Response]]
) -> APIRouter:
    """The routes of a pooling model; ``guard(raw_request, work)`` turns unexpected errors
    into a logged 500 (the app's own guard)."""
    router = APIRouter()
    handler = PoolingHandler(ctx)

    async def run(raw_request: Request, work: Awaitable[Response]) -> Response:
        async def answered() -> Response:
            try:
                return await work
            except ClientDisconnected:
                logger.info("request %s: the client disconnected; aborted", request_id_of(raw_request))
                return Response(status_code=CLIENT_CLOSED_STATUS)

        return await guard(raw_request, answered())

    @router.post("/v1/embeddings")
    async def create_embeddings(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await run(raw_request, handler.embeddings(request, raw_request))

    @router.post("/pooling")
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return await run(
            raw_request, handler.embeddings(request, raw_request, endpoint="/pooling", object_kind="pooling")
        )

    @router.post("/v1/score")
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return await run(raw_request, handler.score(request, raw_request))

    @router.post("/v1/rerank")
    async def rerank_v1(request: RerankRequest, raw_request: Request) -> Response:
        return await run(raw_request, handler.rerank(request, raw_request, "/v1/rerank"))

    @router.post("/v2/rerank")
    async def rerank_v2(request: RerankRequest, raw_request: Request) -> Response:
        return await run(raw_request, handler.rerank(request, raw_request, "/v2/rerank"))

    return router
