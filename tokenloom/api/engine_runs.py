"""Running prompts through the engine and answering with the run: the engine's outputs for
each prompt (observed for the metrics, aborted in the engine when left early), several prompts
merged in arrival order, beam search as batched one-token requests, and the HTTP response of a
run (server-sent events or JSON; 499 when the client goes away first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from tokenloom.api.metrics import RequestTimer, ServerMetrics
from tokenloom.api.tracing import REQUEST_TRACE_HEADERS, RequestTracer
from tokenloom.core.outputs import CompletionOutput, RequestOutput
from tokenloom.core.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenloom.core.engine.protocol import EngineClient

logger = logging.getLogger(__name__)
T = TypeVar("T")
# what ServingContext.generate_all gives: (prompt_index, output) pairs, closed to abort early
IndexedOutputs = AsyncGenerator[tuple[int, RequestOutput], None]


class ClientDisconnected(Exception):
    """The client went away before the response was ready; there is no one to answer."""


class EngineRuns:
    """:class:`~tokenloom.api.serving_base.ServingContext`'s engine methods; the attributes
    are set by its ``__init__``."""

    engine: EngineClient
    metrics: ServerMetrics | None
    tracer: RequestTracer | None
    tokenizer: Any  # None under --skip-tokenizer-init

    async def beam_search(
        self,
        prompts: list[tuple[list[int], Any]],
        request_id: str,
        priority: int,
        num_choices: int,
        logprobs: int | None,
        skip_special_tokens: bool,
    ) -> IndexedOutputs:
        """Beam search for each ``(prompt_token_ids, BeamSearchParams)`` on the engine, as the
        ``(prompt_index, output)`` pairs :meth:`generate_all` gives: one finished output per
        prompt, holding its ``num_choices`` best beams. Each step's beams are one-token engine
        requests that run batched; leaving early (cancelled, client gone) aborts them."""
        import contextlib

        from tokenloom.core.beam_search import beam_search_async

        eos_token_ids = set(self.engine.eos_token_ids)
        if not eos_token_ids and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos_token_ids = {self.tokenizer.eos_token_id}
        step_counter = iter(range(1 << 62))

        async def one_token(token_ids: list[int], params: SamplingParams, beam_id: str) -> RequestOutput:
            final = None
            stream = self.engine.generate(token_ids, params, beam_id, priority=priority)
            async with contextlib.aclosing(stream):
                async for output in stream:
                    final = output
            if final is None or final.error:
                raise RuntimeError(f"beam {beam_id} failed: {final.error if final else 'no output'}")
            return final

        async def generate(beams: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
            step = next(step_counter)
            params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            tasks = [
                asyncio.ensure_future(one_token(tokens, params, f"{request_id}-beam-{step}-{index}"))
                for index, tokens in enumerate(beams)
            ]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(*tasks, return_exceptions=True)

        def decode(token_ids: list[int]) -> str:
            text: str = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
            return text

        for prompt_index, (prompt_token_ids, params) in enumerate(prompts):
            timer = RequestTimer(self.metrics, len(prompt_token_ids))
            result = (await beam_search_async(generate, [prompt_token_ids], params, eos_token_ids, decode))[0]
            beams = result.sequences[:num_choices]
            outputs = [
                CompletionOutput(
                    index=index,
                    text=beam.text or "",
                    token_ids=beam.output_token_ids,
                    cumulative_logprob=beam.cum_logprob,
                    logprobs=beam.logprobs if logprobs is not None else None,
                    finish_reason=beam.finish_reason,
                    stop_reason=beam.stop_reason,
                )
                for index, beam in enumerate(beams)
            ]
            timer.on_output(sum(len(output.token_ids) for output in outputs))
            timer.on_finish([output.finish_reason or "length" for output in outputs])
            yield (
                prompt_index,
                RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=prompt_token_ids,
                    prompt_logprobs=None,
                    outputs=outputs,
                    finished=True,
                ),
            )

    async def generate(
        self,
        prompt: list[int] | dict[str, Any],
        params: SamplingParams,
        request_id: str,
        priority: int,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for one prompt, token ids or a dict with ``prompt_token_ids``
        and ``mm_items`` (with ``lora_request``'s adapter, if any), observed for the metrics (and
        a trace span when tracing); leaving early (an error, a cancelled task, a closed
        generator) aborts the request in the engine."""
        num_prompt_tokens = len(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
        timer = RequestTimer(self.metrics, num_prompt_tokens)
        if lora_request is None:
            stream = self.engine.generate(prompt, params, request_id, priority=priority)
        else:
            stream = self.engine.generate(prompt, params, request_id, priority=priority, lora_request=lora_request)
        finished = False
        # DELTA outputs only carry the choices that moved, so remember how each one ended
        finish_reasons: dict[int, str] = {}
        num_completion_tokens = 0
        try:
            async for output in stream:
                timer.on_output(sum(len(choice.token_ids) for choice in output.outputs))
                for choice in output.outputs:
                    if choice.finish_reason is not None:
                        finish_reasons[choice.index] = choice.finish_reason
                num_completion_tokens += sum(len(choice.token_ids) for choice in output.outputs)
                if output.finished:
                    finished = True
                    timer.on_finish([finish_reasons.get(index, "abort") for index in range(params.n)])
                    if self.tracer is not None:
                        self.tracer.record(
                            request_id,
                            params,
                            num_prompt_tokens,
                            num_completion_tokens,
                            output,
                            REQUEST_TRACE_HEADERS.get(),
                        )
                yield output
        finally:
            if not finished:
                # shielded: under a cancelled scope any unshielded await would be cancelled too
                with anyio.CancelScope(shield=True):
                    await self._abort(stream, request_id)

    async def _abort(self, stream: Any, request_id: str) -> None:
        try:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
            else:
                await self.engine.abort(request_id)
        except Exception as exc:  # aborting must never hide the original error
            logger.warning("aborting request %s failed: %s", request_id, exc)

    async def generate_all(
        self,
        prompts: Sequence[tuple[list[int] | dict[str, Any], SamplingParams]],
        request_id: str,
        priority: int,
        lora_request: Any = None,
    ) -> IndexedOutputs:
        """Several ``(prompt, params)`` at once (each prompt as :meth:`generate` takes it), as
        ``(prompt_index, output)`` in arrival order."""
        if len(prompts) == 1:
            prompt, params = prompts[0]
            async for output in self.generate(prompt, params, request_id, priority, lora_request):
                yield 0, output
            return
        streams = [
            self.generate(prompt_token_ids, params, f"{request_id}-{index}", priority, lora_request)
            for index, (prompt_token_ids, params) in enumerate(prompts)
        ]
        async for item in merge_streams(streams):
            yield item


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that goes away
    while a chunk is being sent still aborts the engine request at once (not at GC time)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, item
    finally:
        with anyio.CancelScope(shield=True):
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for stream in streams:
                await stream.aclose()


class GenerationRun(Protocol):
    """One generation request's answer, built from the ``(prompt_index, output)`` pairs of
    :meth:`ServingContext.generate_all` (the completions, chat, Responses and Messages runs)."""

    def stream(self, first: tuple[int, RequestOutput], outputs: IndexedOutputs) -> AsyncIterator[str]:
        """The server-sent events, from the first output on; closes ``outputs`` when done."""
        ...

    async def collect(self, outputs: IndexedOutputs) -> BaseModel:
        """The whole response, once every output is in."""
        ...


async def respond(
    raw_request: Request, run: GenerationRun, outputs: IndexedOutputs, request_id: str, stream: bool
) -> Response:
    """The HTTP response of one generation request: ``run.stream(first, outputs)`` as
    server-sent events, or ``run.collect(outputs)`` as JSON; 499 when the client goes away
    before the first output (or the whole response) is ready."""
    try:
        if stream:
            first = await cancel_on_disconnect(raw_request, anext(outputs))
            return EngineStreamingResponse(run.stream(first, outputs), media_type="text/event-stream")
        response = await cancel_on_disconnect(raw_request, run.collect(outputs))
    except ClientDisconnected:
        logger.info("request %s: the client disconnected; aborted", request_id)
        return Response(status_code=499)
    return JSONResponse(response.model_dump(mode="json"))


async def cancel_on_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work`` unless the client disconnects first, in which case ``work`` is
    cancelled (aborting its engine requests) and ClientDisconnected is raised."""
    outcome: dict[str, Any] = {}

    async with anyio.create_task_group() as task_group:

        async def run() -> None:
            try:
                outcome["value"] = await work
            except Exception as exc:  # re-raised below, outside the task group
                outcome["error"] = exc
            task_group.cancel_scope.cancel()

        async def watch() -> None:
            while True:
                message = await raw_request.receive()
                if message["type"] == "http.disconnect":
                    outcome["disconnected"] = True
                    task_group.cancel_scope.cancel()
                    return

        task_group.start_soon(run)
        task_group.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    if "value" not in outcome:
        raise ClientDisconnected()
    value: T = outcome["value"]
    return value
