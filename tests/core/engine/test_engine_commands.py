"""AsyncLLM's commands: typed, immutable, applied in order on the engine thread; an add whose
client went away is dropped, a failing add fails only its own stream, and closing a stream
early sends an abort."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tokenloom.core.engine import AsyncLLM, PreparedPrompt
from tokenloom.core.engine.commands import AbortRequest, AddPoolingRequest, AddRequest
from tokenloom.core.request import PoolingParams, SamplingParams
from tokenloom.errors import OverloadedError

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
