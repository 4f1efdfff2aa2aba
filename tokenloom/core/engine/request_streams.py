"""The request path the server's engines share (:class:`RequestStreams`): a request admitted,
its outputs streamed to it through an asyncio queue, and the request aborted when its stream is
closed early. :class:`~tokenloom.core.engine.async_llm.AsyncLLM` sends requests to its engine
thread, :class:`~tokenloom.core.engine.data_parallel.DataParallelAsyncLLM` to a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

from tokenloom.core.outputs import PoolingRequestOutput, RequestOutput
from tokenloom.core.sampling_params import PoolingParams, SamplingParams
from tokenloom.errors import EngineDeadError, InvalidRequestError

# what a request's stream carries: its outputs, or the exception that ended it
StreamItem = RequestOutput | PoolingRequestOutput | BaseException
OutputT = TypeVar("OutputT", RequestOutput, PoolingRequestOutput)


class RequestStreams:
    """What the server's engines share (:class:`~tokenloom.core.engine.async_llm.AsyncLLM` for one engine,
    :class:`~tokenloom.core.engine.data_parallel.DataParallelAsyncLLM` for replicas): admitting
    a request, its output stream, and aborting it when the stream is closed early. A subclass
    says only how a request is prepared (:meth:`_prepare_generate`, :meth:`_prepare_encode`)
    and where it goes (:meth:`_dispatch`, :meth:`_release`)."""

    def __init__(self) -> None:
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.errored = False
        self._dead_reason: str | None = None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped (e.g. which worker or replica died, and how); None while it runs."""
        return self._dead_reason

    async def start(self) -> None:
        """Bind outputs to the running event loop (and start what runs the engine); idempotent."""
        raise NotImplementedError

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        stream = await self._admit(request_id)
        try:
            request = await self._prepare_generate(prompt, sampling_params, request_id, priority, lora_request)
        except BaseException:
            self._unregister(request_id, stream)
            raise
        async with contextlib.aclosing(self._outputs(request_id, request, RequestOutput)) as outputs:
            async for item in outputs:
                yield item

    async def encode(
        self, prompt: Any, pooling_params: PoolingParams | None, request_id: str, *, priority: int = 0
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """The pooled output of one prompt (a single, final item); bad input raises here,
        before anything is queued."""
        stream = await self._admit(request_id)
        try:
            request = self._prepare_encode(prompt, pooling_params or PoolingParams(), request_id, priority)
        except BaseException:
            self._unregister(request_id, stream)
            raise
        async with contextlib.aclosing(self._outputs(request_id, request, PoolingRequestOutput)) as outputs:
            async for item in outputs:
                yield item

    async def _admit(self, request_id: str) -> asyncio.Queue[StreamItem]:
        """Take the id for a new request (its stream, registered); raise when it is in use.
        Start the engine if needed.

        The check and the registration happen with no await between them: preparing a request
        awaits (a grammar compile, an adapter's files), and a second request with the same id
        that got past the check meanwhile would take over the first one's stream, which then
        never answers. Here the second one is refused (a 400) while the first runs."""
        if self.errored:
            raise EngineDeadError(f"the engine is dead: {self._dead_reason}")
        await self.start()
        if request_id in self._streams:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use by a request in flight: give each request its own "
                "request_id (or X-Request-Id)",
                param="request_id",
            )
        stream: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def _unregister(self, request_id: str, stream: asyncio.Queue[StreamItem]) -> None:
        """Forget ``stream`` (only it: the id may have been taken again since)."""
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]

    async def _prepare_generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, priority: int, lora_request: Any
    ) -> Any:
        """What :meth:`_dispatch` sends for a generation request; bad input raises here."""
        raise NotImplementedError

    def _prepare_encode(self, prompt: Any, pooling_params: PoolingParams, request_id: str, priority: int) -> Any:
        """What :meth:`_dispatch` sends for a pooling request; bad input raises here."""
        raise NotImplementedError

    def _dispatch(self, request_id: str, request: Any) -> None:
        """Send the prepared request to the engine that runs it (its stream is registered)."""
        raise NotImplementedError

    def _release(self, request_id: str, finished: bool) -> None:
        """The request's stream has ended: forget where it went and, unless it ``finished``,
        abort it there (the client went away or the stream failed)."""
        raise NotImplementedError

    async def _outputs(self, request_id: str, request: Any, kind: type[OutputT]) -> AsyncGenerator[OutputT, None]:
        """Dispatch ``request`` and yield its outputs (of type ``kind``) until the finished one;
        closing this early aborts the request."""
        stream = self._streams.get(request_id)
        if stream is None:  # not admitted through _admit (a direct caller)
            stream = self._streams[request_id] = asyncio.Queue()
        finished = False
        try:
            self._dispatch(request_id, request)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if not isinstance(item, kind):  # the engine answers by the request's kind
                    raise EngineDeadError(f"request {request_id!r} got a {type(item).__name__}, not a {kind.__name__}")
                finished = item.finished
                yield item
        finally:
            self._unregister(request_id, stream)
            self._release(request_id, finished)

    def _put_outputs(self, items: list[tuple[str, StreamItem]]) -> None:
        """Hand outputs (or the errors that end them) to their streams; on the event loop."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)
