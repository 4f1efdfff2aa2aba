"""The replica side of data parallelism (``-dp N``): :class:`ReplicaHost` runs inside each
replica around a plain :class:`~tokenloom.core.engine.async_llm.AsyncLLM`, turning the server's
messages (the frozen dataclasses of :mod:`~tokenloom.core.engine.replica_messages`) into calls
and the calls' outputs back into messages. An ``mp`` replica's process
(:func:`replica_process_main`) pipes them; a Ray replica (:class:`RayReplicaActor`) hands them
out when the server polls. The server's end is :mod:`~tokenloom.core.engine.data_parallel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import signal
import threading
from collections.abc import AsyncGenerator
from typing import Any

from tokenloom.core.config import EngineArgs
from tokenloom.core.engine.async_llm import AsyncLLM
from tokenloom.core.engine.commands import AbortRequest
from tokenloom.core.engine.replica_messages import (
    AddLora,
    Call,
    Encode,
    Failed,
    FromReplica,
    Generate,
    Output,
    PackedError,
    Ready,
    RemoveLora,
    ReplicaCall,
    Reply,
    ResetPrefixCacheCall,
    ResolveLora,
    Shutdown,
    Stats,
    ToReplica,
)
from tokenloom.core.outputs import PoolingRequestOutput, RequestOutput
from tokenloom.core.structured_output_compile import REQUEST_CLIENT
from tokenloom.plugins.manager import PlainPlugins, PluginSet

logger = logging.getLogger(__name__)

# a replica reports its stats at least this often while idle (and with every batch of outputs)
STATS_INTERVAL_SECONDS = 0.5

# what the server's engine facts are, read once from the first replica when it is ready
FACT_NAMES = (
    "model_name",
    "served_model_names",
    "max_model_len",
    "runner_type",
    "hf_config",
    "max_logprobs",
    "vocab_size",
    "generation_defaults",
    "max_num_seqs",
    "eos_token_ids",
    "scheduling_policy",
    "tokenizer",
)


class ReplicaHost:
    """Runs inside a replica, on its event loop: applies the server's messages to the replica's
    :class:`AsyncLLM` and queues what goes back: outputs, call replies, and last in every batch
    the replica's stats (:mod:`~tokenloom.core.engine.replica_messages`)."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._outbox: list[FromReplica] = []
        self._has_mail = asyncio.Event()

    def facts(self) -> dict[str, Any]:
        return {name: getattr(self.llm, name) for name in FACT_NAMES}

    def handle(self, message: ToReplica) -> None:
        match message:
            case Generate(request_id, prompt, sampling_params, priority, lora_request, client):
                stream = self.llm.generate(
                    prompt, sampling_params, request_id, priority=priority, lora_request=lora_request
                )
                # the stream runs in its task's context: the client the server named (compile slots)
                context = contextvars.copy_context()
                context.run(REQUEST_CLIENT.set, client)
                self._start(request_id, stream, context)
            case Encode(request_id, prompt, pooling_params, priority):
                self._start(request_id, self.llm.encode(prompt, pooling_params, request_id, priority=priority))
            case AbortRequest(request_id):
                task = self._tasks.pop(request_id, None)
                if task is not None:
                    task.cancel()  # closing the stream aborts the request in the engine
            case Call(call_id, call):
                asyncio.get_running_loop().create_task(self._reply(call_id, call))
            case _:
                logger.error("data-parallel replica: unknown message %r", message)

    def _start(
        self,
        request_id: str,
        stream: AsyncGenerator[RequestOutput | PoolingRequestOutput, None],
        context: contextvars.Context | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        forward = self._forward(request_id, stream)
        # a task runs in a copy of the context current where it is created
        self._tasks[request_id] = context.run(loop.create_task, forward) if context else loop.create_task(forward)

    async def _forward(
        self, request_id: str, stream: AsyncGenerator[RequestOutput | PoolingRequestOutput, None]
    ) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    self._post(Output(request_id, output))
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            self._post(Output(request_id, PackedError.of(exc)))
        finally:
            self._tasks.pop(request_id, None)

    async def _reply(self, call_id: int, call: ReplicaCall) -> None:
        try:
            value: Any
            match call:
                case ResolveLora(lora_request):
                    value = await asyncio.to_thread(self.llm.resolve_lora, lora_request)
                case AddLora(lora_request):
                    value = await self.llm.add_lora(lora_request)
                case RemoveLora(lora_int_id):
                    value = await self.llm.remove_lora(lora_int_id)
                case ResetPrefixCacheCall():
                    await self.llm.reset_prefix_cache()
                    value = None
            self._post(Reply(call_id, True, value))
        except Exception as exc:
            self._post(Reply(call_id, False, PackedError.of(exc)))

    def _post(self, message: FromReplica) -> None:
        self._outbox.append(message)
        self._has_mail.set()

    async def next_messages(self, timeout: float = STATS_INTERVAL_SECONDS) -> list[FromReplica]:
        """What is waiting to go back, at once if anything is, else after ``timeout``; always
        ends with the replica's stats (a heartbeat when there is nothing else)."""
        if not self._outbox:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._has_mail.wait(), timeout)
        self._has_mail.clear()
        messages, self._outbox = self._outbox, []
        dead_reason = self.llm.dead_reason or ("the engine stopped" if self.llm.errored else None)
        messages.append(Stats(self.llm.stats(), dead_reason))
        return messages

    async def shutdown(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await self.llm.shutdown()


async def _build_host(engine_args: EngineArgs, tables: PlainPlugins) -> ReplicaHost:
    llm = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args, PluginSet.from_plain(tables))
    await llm.start()
    return ReplicaHost(llm)


def replica_process_main(
    index: int, engine_args: EngineArgs, tables: PlainPlugins, cpu_ids: list[int] | None, inbox: Any, outbox: Any
) -> None:
    """An ``mp`` replica's process: builds the engine, sends :class:`Ready` (or :class:`Failed`),
    then serves messages until told to stop or the server goes."""
    # the server stops its replicas itself; a Ctrl-C reaching the whole process group must not
    # kill one before the server has ended its streams
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    enter_replica(index, cpu_ids)
    asyncio.run(serve_replica(engine_args, tables, inbox, outbox))


def enter_replica(index: int, cpu_ids: list[int] | None) -> None:
    """What a replica's process does first: keep to its cores and prefix its log lines."""
    if cpu_ids and hasattr(os, "sched_setaffinity"):
        # the CPU platform sizes torch's thread pool from the affinity: replicas on separate
        # cores do not fight over them
        os.sched_setaffinity(0, cpu_ids)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [dp replica {index}] %(name)s: %(message)s"
    )


async def serve_replica(engine_args: EngineArgs, tables: PlainPlugins, inbox: Any, outbox: Any) -> None:
    try:
        host = await _build_host(engine_args, tables)
    except BaseException as exc:
        outbox.send([Failed(PackedError.of(exc))])
        return
    outbox.send([Ready(host.facts())])
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def read() -> None:
        while True:
            try:
                message = inbox.recv()
            except (EOFError, OSError):  # the server is gone: stop rather than linger as an orphan
                message = Shutdown()
            if isinstance(message, Shutdown):
                loop.call_soon_threadsafe(stop.set)
                return
            loop.call_soon_threadsafe(host.handle, message)

    threading.Thread(target=read, name="tokenloom-dp-inbox", daemon=True).start()
    while not stop.is_set():
        messages = await host.next_messages()
        try:
            outbox.send(messages)
        except (BrokenPipeError, OSError):
            break
    await host.shutdown()


class RayReplicaActor:
    """A ``ray`` replica: an async Ray actor (``ray.remote`` is applied when the server starts
    it, so importing this module needs no Ray) around a :class:`ReplicaHost`."""

    def __init__(self) -> None:
        self.host: ReplicaHost | None = None

    async def start(self, index: int, num_cpus: int, engine_args: EngineArgs, tables: PlainPlugins) -> dict[str, Any]:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        per_replica = min(num_cpus, len(cores))
        # Ray counts CPUs but pins none: replicas that share a node take different cores
        cpu_ids = [cores[(index * per_replica + offset) % len(cores)] for offset in range(per_replica)]
        enter_replica(index, cpu_ids or None)
        self.host = await _build_host(engine_args, tables)
        return self.host.facts()

    async def handle(self, message: ToReplica) -> None:
        assert self.host is not None, "the replica has not started"
        self.host.handle(message)

    async def next_messages(self, timeout: float) -> list[FromReplica]:
        assert self.host is not None, "the replica has not started"
        return await self.host.next_messages(timeout)

    async def shutdown(self) -> None:
        if self.host is not None:
            await self.host.shutdown()

    def pid(self) -> int:
        return os.getpid()
