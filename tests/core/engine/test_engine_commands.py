"""AsyncLLM's commands: typed, immutable, applied in order on the engine thread; an add whose
client went away is dropped, a failing add fails only its own stream, closing a stream
early sends an abort, and a request id is taken by one request in flight at a time."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from tokenloom.core.engine import AsyncLLM, PreparedPrompt
from tokenloom.core.engine.commands import AbortRequest, AddPoolingRequest, AddRequest
from tokenloom.core.engine.request_streams import RequestStreams
from tokenloom.core.outputs import RequestOutput
from tokenloom.core.sampling_params import PoolingParams, SamplingParams
from tokenloom.errors import InvalidRequestError, OverloadedError

PREPARED = PreparedPrompt([1, 2, 3], None)


class RecordingEngine:
    """Stands in for LLMEngine: records what the engine thread asks of it."""

    def __init__(self, refuse: Exception | None = None):
        self.calls: list[tuple] = []
        self.refuse = refuse

    def stats(self):
        return None

    def add_request(self, request_id, prompt, params, *, priority, arrival_time, prepared):
        self.calls.append(("add", request_id, params, priority, arrival_time, prepared))
        if self.refuse is not None:
            raise self.refuse

    def add_pooling_request(self, request_id, prompt, params, *, priority, arrival_time, prepared):
        self.calls.append(("add_pooling", request_id, params, priority, arrival_time, prepared))

    def abort_request(self, request_id):
        self.calls.append(("abort", request_id))


def test_commands_are_immutable_values():
    command = AddRequest("r", SamplingParams(), PREPARED, priority=1, arrival_time=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        command.request_id = "other"
    assert command == AddRequest("r", SamplingParams(), PREPARED, 1, 2.0)
    assert AbortRequest("r") != AbortRequest("s")


def test_the_engine_thread_applies_commands_in_order():
    engine = RecordingEngine()
    async_llm = AsyncLLM(engine)

    async def run():
        async_llm._loop = asyncio.get_running_loop()
        async_llm._streams = {"a": asyncio.Queue(), "p": asyncio.Queue()}
        pooling = PoolingParams(dimensions=2)
        for command in (
            AddRequest("a", SamplingParams(n=2), PREPARED, 3, 4.0),
            AddRequest("gone", SamplingParams(), PREPARED, 0, 5.0),  # its client left
            AddPoolingRequest("p", pooling, PREPARED, 0, 6.0),
            AbortRequest("a"),
        ):
            async_llm._send(command)
        async_llm._drain_commands()
        return pooling

    pooling = asyncio.run(run())
    assert engine.calls == [
        ("add", "a", SamplingParams(n=2), 3, 4.0, PREPARED),
        ("add_pooling", "p", pooling, 0, 6.0, PREPARED),
        ("abort", "a"),
    ]


def test_a_refused_add_fails_its_own_stream_only():
    engine = RecordingEngine(refuse=OverloadedError("3 requests are already waiting"))
    async_llm = AsyncLLM(engine)

    async def run():
        async_llm._loop = asyncio.get_running_loop()
        async_llm._streams = {"a": asyncio.Queue(), "b": asyncio.Queue()}
        async_llm._apply(AddRequest("a", SamplingParams(), PREPARED, 0, 1.0))
        await asyncio.sleep(0)  # the delivery is scheduled on the loop
        return async_llm._streams["a"].get_nowait(), async_llm._streams["b"].empty()

    delivered, other_empty = asyncio.run(run())
    assert isinstance(delivered, OverloadedError) and other_empty


def test_closing_a_stream_early_sends_an_abort():
    async_llm = AsyncLLM(RecordingEngine())
    sent = []

    async def run():
        async_llm._loop = asyncio.get_running_loop()
        async_llm._thread = object()  # the engine thread is not started: commands are only recorded
        async_llm._send = sent.append
        outputs = async_llm._outputs("a", AddRequest("a", SamplingParams(), PREPARED, 0, 1.0), object)
        task = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0)
        assert "a" in async_llm._streams
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await outputs.aclose()

    asyncio.run(run())
    assert [type(command) for command in sent] == [AddRequest, AbortRequest]
    assert sent[1] == AbortRequest("a") and "a" not in async_llm._streams


class GatedStreams(RequestStreams):
    """The shared request path with a preparation that waits for the test (as a grammar
    compile does) and an engine that answers each dispatched request with one finished output."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()
        self.dispatched: list[str] = []
        self.released: list[str] = []

    async def start(self):
        self._loop = asyncio.get_running_loop()

    async def _prepare_generate(self, prompt, sampling_params, request_id, priority, lora_request):
        await self.gate.wait()
        if prompt == "refuse":
            raise InvalidRequestError("bad prompt", param="prompt")
        return prompt

    def _dispatch(self, request_id, request):
        self.dispatched.append(request_id)
        output = RequestOutput(request_id, request, [1], None, [], finished=True)
        self._loop.call_soon(self._put_outputs, [(request_id, output)])

    def _release(self, request_id, finished):
        self.released.append(request_id)


async def first_output(stream):
    async with contextlib.aclosing(stream):
        return await anext(stream)


def test_a_second_request_with_an_id_in_flight_is_refused_while_the_first_prepares():
    # issue 37: the id check and the stream's registration were split by the preparation's
    # await, so a duplicate got past the check, took over the first one's stream, and the
    # first never answered
    streams = GatedStreams()

    async def run():
        first = asyncio.ensure_future(first_output(streams.generate("one", SamplingParams(), "dup")))
        await asyncio.sleep(0)  # the first is admitted and waits in its preparation
        with pytest.raises(InvalidRequestError, match="already in use") as refused:
            await asyncio.wait_for(first_output(streams.generate("two", SamplingParams(), "dup")), 60)
        assert refused.value.param == "request_id"
        streams.gate.set()
        return await asyncio.wait_for(first, 60)

    output = asyncio.run(run())
    assert output.prompt == "one" and streams.dispatched == ["dup"]
    assert "dup" not in streams._streams


def test_a_request_that_fails_to_prepare_frees_its_id():
    streams = GatedStreams()
    streams.gate.set()

    async def run():
        with pytest.raises(InvalidRequestError):
            await first_output(streams.generate("refuse", SamplingParams(), "r"))
        assert "r" not in streams._streams and streams.dispatched == []
        return await first_output(streams.generate("again", SamplingParams(), "r"))

    assert asyncio.run(run()).prompt == "again"
