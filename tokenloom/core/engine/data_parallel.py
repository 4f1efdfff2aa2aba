"""Data parallelism (``-dp N``): N engine replicas, each a whole engine (scheduler, executor,
KV cache; itself tensor-parallel if asked) in its own process (``mp``) or Ray actor (``ray``),
behind one API server. :class:`DataParallelAsyncLLM` has :class:`AsyncLLM`'s surface, so the
server cannot tell one engine from N: it sends each request to the least loaded replica,
routes aborts to the replica holding the request and sums the replicas' stats.

This module is the server's end: the balancer, one :class:`ReplicaHandle` per replica
(:class:`ProcessReplica` for ``mp``, :class:`RayReplica` for ``ray``) and the engine client.
What runs inside a replica, a plain :class:`AsyncLLM` wrapped by a
:class:`~tokenloom.core.engine.replica_host.ReplicaHost`, is
:mod:`~tokenloom.core.engine.replica_host`; the two speak the frozen dataclasses of
:mod:`~tokenloom.core.engine.replica_messages`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from tokenloom.core.config import EngineArgs, EngineConfig, LoRAConfig
from tokenloom.core.distributed import import_ray
from tokenloom.core.engine.async_llm import RequestStreams, StreamItem
from tokenloom.core.engine.commands import AbortRequest
from tokenloom.core.engine.llm_engine import EngineStats
from tokenloom.core.engine.replica_host import STATS_INTERVAL_SECONDS, RayReplicaActor, replica_process_main
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
from tokenloom.core.executor import EXECUTE_MODEL_TIMEOUT_ENV, execute_model_timeout, is_stopped
from tokenloom.core.kv_connector import KVConnectorStats
from tokenloom.core.logits_processors import LogitsProcessorResolver
from tokenloom.core.sampling_params import PoolingParams, SamplingParams
from tokenloom.core.structured_output_compile import REQUEST_CLIENT
from tokenloom.errors import ConfigError, EngineDeadError
from tokenloom.plugins.manager import PlainPlugins, PluginSet

logger = logging.getLogger(__name__)

# how long start-up waits for every replica to build its engine (loading a big model is slow)
REPLICA_START_TIMEOUT_SECONDS = 900.0
# how long shutdown waits for a replica to stop its engine before killing it
REPLICA_STOP_TIMEOUT_SECONDS = 30.0
# the CPUs a Ray replica asks for (and keeps its torch threads to)
REPLICA_RAY_CPUS = 1


# -- balancing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaLoad:
    """What the balancer knows of one replica."""

    num_in_flight: int  # requests sent to it and not finished, counted by the server
    kv_cache_usage: float  # its KV-cache usage (0..1) as last reported
    alive: bool = True


def choose_replica(loads: list[ReplicaLoad]) -> int:
    """The replica the next request goes to: the live one with the fewest requests in flight,
    then the lowest KV-cache usage, then the lowest index.

    Requests in flight come first because the server counts them the moment it sends one (a
    burst spreads evenly), while KV usage arrives a step late and only separates replicas with
    equal queues: the one whose requests hold less cache has more room for the next one."""
    candidates = [(load.num_in_flight, load.kv_cache_usage, index) for index, load in enumerate(loads) if load.alive]
    if not candidates:
        raise EngineDeadError("every data-parallel replica is dead; see the server log and restart the server")
    return min(candidates)[2]


def sum_stats(replica_stats: list[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts and counters summed, KV-cache usage the mean
    (every replica has a cache of the same size), LoRA adapters merged."""
    count = max(len(replica_stats), 1)
    spec_stats = [stats.spec_decoding for stats in replica_stats if stats.spec_decoding is not None]
    spec_decoding = None
    if spec_stats:
        per_position = [
            sum(values)
            for values in itertools.zip_longest(
                *(spec.num_accepted_tokens_per_pos or [] for spec in spec_stats), fillvalue=0
            )
        ]
        spec_decoding = dataclasses.replace(
            spec_stats[0],
            num_drafts=sum(spec.num_drafts for spec in spec_stats),
            num_draft_tokens=sum(spec.num_draft_tokens for spec in spec_stats),
            num_accepted_tokens=sum(spec.num_accepted_tokens for spec in spec_stats),
            num_accepted_tokens_per_pos=per_position,
        )

    connector_stats = [stats.kv_connector for stats in replica_stats if stats.kv_connector is not None]
    kv_connector = None
    if connector_stats:
        kv_connector = KVConnectorStats(
            **{
                f.name: sum(getattr(connector, f.name) for connector in connector_stats)
                for f in dataclasses.fields(KVConnectorStats)
            }
        )

    def merged(name: str) -> list[str]:
        return sorted({adapter for stats in replica_stats for adapter in getattr(stats, name)})

    return EngineStats(
        num_running=sum(stats.num_running for stats in replica_stats),
        num_waiting=sum(stats.num_waiting for stats in replica_stats),
        kv_cache_usage=sum(stats.kv_cache_usage for stats in replica_stats) / count,
        prefix_cache_queries=sum(stats.prefix_cache_queries for stats in replica_stats),
        prefix_cache_hits=sum(stats.prefix_cache_hits for stats in replica_stats),
        num_preemptions=sum(stats.num_preemptions for stats in replica_stats),
        prompt_tokens_total=sum(stats.prompt_tokens_total for stats in replica_stats),
        generation_tokens_total=sum(stats.generation_tokens_total for stats in replica_stats),
        running_lora_adapters=merged("running_lora_adapters"),
        waiting_lora_adapters=merged("waiting_lora_adapters"),
        max_lora=max((stats.max_lora for stats in replica_stats), default=0),
        spec_decoding=spec_decoding,
        kv_connector=kv_connector,
    )


# -- the server side: one handle per replica ----------------------------------------------------


class ReplicaHandle:
    """The server's end of one replica. A receiver thread hands each batch of messages to
    ``on_messages(index, messages)`` and, once, the reason it died to ``on_death(index, reason)``.

    A started replica sends its stats at least every ``STATS_INTERVAL_SECONDS`` from its event
    loop, whatever its engine thread is doing: one silent for the step timeout
    (``TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS``) is stopped or hung, so it is dead and killed."""

    def __init__(self, index: int):
        self.index = index
        self.ready: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self.closing = False
        self._send_lock = threading.Lock()
        self.silence_limit = execute_model_timeout()
        """Seconds a started replica may send nothing before it is declared dead (None: no limit)."""

    def silence_reason(self, what: str) -> str:
        """Why the replica (``what`` names it) is dead after a silence of :attr:`silence_limit`."""
        return f"{what} sent nothing for {self.silence_limit:g}s ({EXECUTE_MODEL_TIMEOUT_ENV[0]} sets the limit)"

    def start(
        self, on_messages: Callable[[int, list[FromReplica]], None], on_death: Callable[[int, str], None]
    ) -> None:
        raise NotImplementedError

    def send(self, message: ToReplica) -> None:
        """Queue ``message`` for the replica; EngineDeadError when it cannot be reached."""
        raise NotImplementedError

    def stop(self, timeout: float) -> None:
        """Stop the replica's engine and end the process or actor (killed after ``timeout``)."""
        raise NotImplementedError

    def kill(self) -> None:
        """End the replica at once (tests use it to play a crash)."""
        raise NotImplementedError


class ProcessReplica(ReplicaHandle):
    """An ``mp`` replica: a spawned process and two one-way pipes."""

    def __init__(self, index: int, engine_args: EngineArgs, tables: PlainPlugins, cpu_ids: list[int] | None):
        super().__init__(index)
        context = multiprocessing.get_context("spawn")  # torch's thread pools do not survive fork
        inbox_reader, self._inbox = context.Pipe(duplex=False)
        self._outbox, outbox_writer = context.Pipe(duplex=False)
        # not a daemon: a replica running -tp N starts worker processes of its own
        self.process = context.Process(
            target=replica_process_main,
            args=(index, engine_args, tables, cpu_ids, inbox_reader, outbox_writer),
            name=f"tokenloom-dp-replica-{index}",
        )
        self.process.start()
        inbox_reader.close()
        outbox_writer.close()

    def start(
        self, on_messages: Callable[[int, list[FromReplica]], None], on_death: Callable[[int, str], None]
    ) -> None:
        def receive() -> None:
            while True:
                try:
                    if self.ready.done() and self.silence_limit is not None:
                        if not self._outbox.poll(self.silence_limit):
                            self._silent(on_death)
                            return
                    messages = self._outbox.recv()
                except (EOFError, OSError):
                    break
                match messages:
                    case [Ready(facts)]:
                        self.ready.set_result(facts)
                    case [Failed(error)]:
                        self.ready.set_exception(error.unpack())
                        return
                    case _:
                        on_messages(self.index, messages)
            self.process.join(timeout=5)
            reason = (
                f"data-parallel replica {self.index} (pid {self.process.pid}) exited with code {self.process.exitcode}"
            )
            if not self.ready.done():  # died while building: start-up raises it
                self.ready.set_exception(EngineDeadError(reason))
            elif not self.closing:
                on_death(self.index, reason)

        threading.Thread(target=receive, name=f"tokenloom-dp-receive-{self.index}", daemon=True).start()

    def _silent(self, on_death: Callable[[int, str], None]) -> None:
        if self.closing:
            return  # a replica shutting down goes quiet; stop() ends it
        pid = self.process.pid
        stopped = ", stopped by a signal" if is_stopped(pid) else ""
        on_death(self.index, self.silence_reason(f"data-parallel replica {self.index} (pid {pid}{stopped})"))
        self.process.kill()  # its workers, if any, see the pipe close and leave

    def send(self, message: ToReplica) -> None:
        try:
            with self._send_lock:
                self._inbox.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise EngineDeadError(f"data-parallel replica {self.index} cannot be reached: {exc}") from None

    def stop(self, timeout: float) -> None:
        self.closing = True
        with contextlib.suppress(EngineDeadError):
            self.send(Shutdown())
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("data-parallel replica %d did not stop in %.0f s: killing it", self.index, timeout)
            self.process.kill()
            self.process.join(5)
        self._inbox.close()

    def kill(self) -> None:
        self.process.kill()


class RayReplica(ReplicaHandle):
    """A ``ray`` replica: an actor the server polls for messages."""

    def __init__(self, index: int, engine_args: EngineArgs, tables: PlainPlugins, actor_options: dict[str, Any]):
        import ray

        super().__init__(index)
        self._ray = ray
        # Ray's actor handle is dynamic (each method gains .remote), which Ray's stubs cannot say
        self.actor: Any = cast(Any, ray.remote(RayReplicaActor).options(**actor_options).remote())
        self._started = self.actor.start.remote(index, actor_options["num_cpus"], engine_args, tables)

    def start(
        self, on_messages: Callable[[int, list[FromReplica]], None], on_death: Callable[[int, str], None]
    ) -> None:
        ray = self._ray

        def receive() -> None:
            try:
                self.ready.set_result(ray.get(self._started))
            except BaseException as exc:
                self.ready.set_exception(exc)
                return
            while not self.closing:
                try:
                    messages = ray.get(
                        self.actor.next_messages.remote(STATS_INTERVAL_SECONDS),
                        timeout=None if self.silence_limit is None else STATS_INTERVAL_SECONDS + self.silence_limit,
                    )
                except ray.exceptions.GetTimeoutError:
                    if not self.closing:  # a replica shutting down goes quiet; stop() ends it
                        on_death(self.index, self.silence_reason(f"data-parallel replica {self.index} (Ray actor)"))
                        with contextlib.suppress(Exception):
                            ray.kill(self.actor)
                    return
                except BaseException as exc:  # RayActorError and kin: the actor or its node is gone
                    if not self.closing:
                        on_death(self.index, f"data-parallel replica {self.index} (Ray actor) died: {exc}")
                    return
                on_messages(self.index, messages)

        threading.Thread(target=receive, name=f"tokenloom-dp-receive-{self.index}", daemon=True).start()

    def send(self, message: ToReplica) -> None:
        try:
            self.actor.handle.remote(message)
        except Exception as exc:
            raise EngineDeadError(f"data-parallel replica {self.index} cannot be reached: {exc}") from None

    def stop(self, timeout: float) -> None:
        self.closing = True
        with contextlib.suppress(Exception):
            self._ray.get(self.actor.shutdown.remote(), timeout=timeout)
        with contextlib.suppress(Exception):
            self._ray.kill(self.actor)

    def kill(self) -> None:
        self._ray.kill(self.actor)


def with_rank(replica_args: EngineArgs, index: int) -> EngineArgs:
    """A replica's engine arguments: its rank (what its KV-cache events carry) is its index."""
    return dataclasses.replace(replica_args, data_parallel_rank=index)


def local_cpu_sets(num_replicas: int) -> list[list[int] | None]:
    """This machine's cores dealt out to ``num_replicas`` local replicas, an equal run each
    (shared round-robin when there are more replicas than cores)."""
    if not hasattr(os, "sched_getaffinity"):
        return [None] * num_replicas
    cores = sorted(os.sched_getaffinity(0))
    if num_replicas >= len(cores):
        return [[cores[index % len(cores)]] for index in range(num_replicas)]
    per_replica = len(cores) // num_replicas
    return [cores[index * per_replica : (index + 1) * per_replica] for index in range(num_replicas)]


def ray_actor_options(parallel: Any, ray: Any) -> list[dict[str, Any]]:
    """Where each Ray replica goes: ``--data-parallel-size-local`` of them pinned to this node,
    the rest pinned round-robin to the cluster's other nodes; unset, Ray spreads them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    size = parallel.data_parallel_size
    # no runtime_env: every node runs the tokenloom (and plugins) installed there, and a
    # runtime_env would make Ray start an agent per worker, tens of seconds on a small machine
    base: dict[str, Any] = {"num_cpus": REPLICA_RAY_CPUS}
    local = parallel.data_parallel_size_local
    if local is None:
        return [dict(base, scheduling_strategy="SPREAD") for _ in range(size)]
    here = ray.get_runtime_context().get_node_id()
    others = [node["NodeID"] for node in ray.nodes() if node.get("Alive") and node["NodeID"] != here]
    if local < size and not others:
        raise ConfigError(
            f"--data-parallel-size-local {local} leaves {size - local} replica(s) for other nodes, but the Ray "
            "cluster has only this one: add nodes (ray start --address=...) or raise --data-parallel-size-local",
            param="data-parallel-size-local",
        )
    nodes = [here] * local + [others[index % len(others)] for index in range(size - local)] if others else [here] * size
    return [dict(base, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)) for node in nodes]


# -- the server's engine ----------------------------------------------------------------------


class DataParallelAsyncLLM(RequestStreams):
    """:class:`AsyncLLM`'s surface over N replicas (see the module docstring). Built by
    ``AsyncLLM.from_engine_args`` when ``data_parallel_size > 1``. Requests are admitted and
    streamed as :class:`AsyncLLM` does (:class:`RequestStreams`); this only chooses the replica."""

    def __init__(self, config: EngineConfig, plugins: PluginSet, replicas: list[ReplicaHandle]):
        super().__init__()
        self.config = config
        self.plugins = plugins
        self.replicas = replicas
        self._facts: dict[str, Any] = {}
        self._owner: dict[str, int] = {}  # request id -> the replica that holds it
        self._num_in_flight = [0] * len(replicas)
        self._replica_stats: list[EngineStats | None] = [None] * len(replicas)
        self._dead_reasons: list[str | None] = [None] * len(replicas)
        self._calls: dict[int, tuple[int, concurrent.futures.Future[Any]]] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()
        self._stopping = False
        self._ray_started_here = False
        self._logits_processor_resolver: LogitsProcessorResolver | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, plugins: PluginSet | None = None) -> DataParallelAsyncLLM:
        """Starts every replica (they build their engines at the same time) and returns once all
        are ready; a replica's build error is raised here after the others are stopped."""
        from tokenloom.plugins.manager import load_plugins

        config = engine_args.create_engine_config()
        plugins = plugins or load_plugins()
        parallel = config.parallel
        # each replica is one engine: dp 1 inside, so it does not start replicas of its own
        replica_args = dataclasses.replace(engine_args, data_parallel_size=1, data_parallel_size_local=None)
        tables = plugins.to_plain()
        replicas: list[ReplicaHandle] = []
        self = cls(config, plugins, replicas)
        started = time.perf_counter()
        try:
            if parallel.data_parallel_backend == "ray":
                ray = import_ray("data-parallel-backend")
                if not ray.is_initialized():
                    # the cluster RAY_ADDRESS names is joined; without it a private local Ray
                    # starts (never a `ray start` cluster found by chance) and stops with the server
                    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False)
                    self._ray_started_here = True
                for index, options in enumerate(ray_actor_options(parallel, ray)):
                    replicas.append(RayReplica(index, with_rank(replica_args, index), tables, options))
            else:
                for index, cpu_ids in enumerate(local_cpu_sets(parallel.data_parallel_size)):
                    replicas.append(ProcessReplica(index, with_rank(replica_args, index), tables, cpu_ids))
            self._num_in_flight = [0] * len(replicas)
            self._replica_stats = [None] * len(replicas)
            self._dead_reasons = [None] * len(replicas)
            for replica in replicas:
                replica.start(self._on_messages, self._on_death)
            deadline = time.monotonic() + REPLICA_START_TIMEOUT_SECONDS
            for replica in replicas:
                facts = replica.ready.result(timeout=max(deadline - time.monotonic(), 0.0))
                if not self._facts:
                    self._facts = facts
        except BaseException as exc:
            self._stop_replicas()
            if isinstance(exc, concurrent.futures.TimeoutError):
                raise EngineDeadError(
                    f"the data-parallel replicas were not ready after {REPLICA_START_TIMEOUT_SECONDS:.0f} s "
                    "(under Ray: does the cluster have a free CPU for each replica?)"
                ) from None
            raise
        logger.info(
            "data parallel: %d replicas (%s backend) ready in %.2f s",
            len(replicas),
            parallel.data_parallel_backend,
            time.perf_counter() - started,
        )
        return self

    # -- the engine facts the server reads (replica 0's; every replica runs the same model)

    @property
    def tokenizer(self) -> Any:
        return self._facts["tokenizer"]

    @property
    def model_name(self) -> str:
        return cast(str, self._facts["model_name"])

    @property
    def served_model_names(self) -> list[str]:
        return list(self._facts["served_model_names"])

    @property
    def max_model_len(self) -> int:
        return cast(int, self._facts["max_model_len"])

    @property
    def runner_type(self) -> str:
        return cast(str, self._facts["runner_type"])

    @property
    def hf_config(self) -> Any:
        return self._facts["hf_config"]

    @property
    def max_logprobs(self) -> int:
        return cast(int, self._facts["max_logprobs"])

    @property
    def vocab_size(self) -> int:
        return cast(int, self._facts["vocab_size"])

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return dict(self._facts["generation_defaults"])

    @property
    def max_num_seqs(self) -> int:
        return cast(int, self._facts["max_num_seqs"])

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._facts["eos_token_ids"])

    @property
    def scheduling_policy(self) -> str:
        return cast(str, self._facts["scheduling_policy"])

    @property
    def lora_config(self) -> LoRAConfig:
        return self.config.lora

    @property
    def logits_processor_resolver(self) -> LogitsProcessorResolver:
        if self._logits_processor_resolver is None:
            self._logits_processor_resolver = LogitsProcessorResolver(
                self.plugins.registry("logits_processor"), self.config.model.logits_processor_pattern
            )
        return self._logits_processor_resolver

    @property
    def is_running(self) -> bool:
        return bool(self._facts) and not self.errored and not self._stopping

    def stats(self) -> EngineStats:
        return sum_stats([stats for stats in self._replica_stats if stats is not None])

    def replica_loads(self) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(
                num_in_flight=self._num_in_flight[index],
                kv_cache_usage=stats.kv_cache_usage if stats is not None else 0.0,
                alive=self._dead_reasons[index] is None,
            )
            for index, stats in enumerate(self._replica_stats)
        ]

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    # -- LoRA: every replica serves every adapter

    def resolve_lora(self, lora_request: Any) -> Any:
        """The adapter checked against the model by a live replica (blocking: call it off the
        event loop once the server runs)."""
        return self._call_now(self._live_replicas()[0], ResolveLora(lora_request)).result()

    async def add_lora(self, lora_request: Any) -> bool:
        await asyncio.gather(*(self._call(index, AddLora(lora_request)) for index in self._live_replicas()))
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        removed = await asyncio.gather(*(self._call(index, RemoveLora(lora_int_id)) for index in self._live_replicas()))
        return any(removed)

    async def reset_prefix_cache(self) -> None:
        await asyncio.gather(*(self._call(index, ResetPrefixCacheCall()) for index in self._live_replicas()))

    # -- requests

    async def _prepare_generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, priority: int, lora_request: Any
    ) -> Generate:
        # the replica prepares it (tokenizes, compiles the grammar, resolves the adapter)
        return Generate(request_id, prompt, sampling_params, priority, lora_request, REQUEST_CLIENT.get())

    def _prepare_encode(self, prompt: Any, pooling_params: PoolingParams, request_id: str, priority: int) -> Encode:
        return Encode(request_id, prompt, pooling_params, priority)

    def _dispatch(self, request_id: str, request: Any) -> None:
        index = choose_replica(self.replica_loads())
        self._owner[request_id] = index
        self._num_in_flight[index] += 1
        self.replicas[index].send(request)

    def _release(self, request_id: str, finished: bool) -> None:
        index = self._owner.pop(request_id, None)
        if index is None:
            return  # no replica took it (every one is dead)
        self._num_in_flight[index] -= 1
        if not finished and self._dead_reasons[index] is None:
            with contextlib.suppress(EngineDeadError):
                self.replicas[index].send(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        if index is not None and self._dead_reasons[index] is None:
            with contextlib.suppress(EngineDeadError):
                self.replicas[index].send(AbortRequest(request_id))

    # -- calls that every replica answers

    def _live_replicas(self) -> list[int]:
        live = [index for index, reason in enumerate(self._dead_reasons) if reason is None]
        if not live:
            raise EngineDeadError(f"the engine is dead: {self._dead_reason}")
        return live

    def _call_now(self, index: int, call: ReplicaCall) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._calls_lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = (index, future)
        try:
            self.replicas[index].send(Call(call_id, call))
        except EngineDeadError as exc:
            with self._calls_lock:
                self._calls.pop(call_id, None)
            future.set_exception(exc)
        return future

    async def _call(self, index: int, call: ReplicaCall) -> Any:
        return await asyncio.wrap_future(self._call_now(index, call))

    # -- the receiver threads

    def _on_messages(self, index: int, messages: list[FromReplica]) -> None:
        outputs: list[tuple[str, StreamItem]] = []
        for message in messages:
            match message:
                case Output(request_id, output):
                    outputs.append((request_id, output.unpack() if isinstance(output, PackedError) else output))
                case Reply(call_id, ok, value):
                    with self._calls_lock:
                        _, future = self._calls.pop(call_id, (None, None))
                    if future is not None:
                        if ok:
                            future.set_result(value)
                        else:
                            future.set_exception(value.unpack())
                case Stats(stats, dead_reason):
                    self._replica_stats[index] = stats
                    if dead_reason is not None:
                        self._on_death(index, f"data-parallel replica {index}'s engine died: {dead_reason}")
                case _:
                    logger.error("data-parallel replica %d sent an unknown message %r", index, message)
        if outputs:
            self._on_loop(self._put_outputs, outputs)

    def _on_death(self, index: int, reason: str) -> None:
        with self._calls_lock:
            calls = [call_id for call_id, (owner, _) in self._calls.items() if owner == index]
            futures = [self._calls.pop(call_id)[1] for call_id in calls]
        for future in futures:
            future.set_exception(EngineDeadError(reason))
        self._on_loop(self._replica_died, index, reason)

    def _on_loop(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(callback, *args)
        else:  # before the server's loop runs nothing is streaming: apply it here
            callback(*args)

    def _replica_died(self, index: int, reason: str) -> None:
        """The replica's open streams end with an error and the server stops taking requests
        (/health answers 503): a replica short, the server is not what it was started as."""
        if self._dead_reasons[index] is not None or self._stopping:
            return
        logger.error("%s: its open requests end with an error and the server reports unhealthy", reason)
        self._dead_reasons[index] = reason
        self.errored = True
        self._dead_reason = reason
        error = EngineDeadError(f"the engine died: {reason}")
        self._put_outputs([(request_id, error) for request_id, owner in self._owner.items() if owner == index])

    # -- shutdown

    async def shutdown(self) -> None:
        self._stopping = True
        await asyncio.get_running_loop().run_in_executor(None, self._stop_replicas)

    def _stop_replicas(self) -> None:
        """Stops every replica at once (each waits for its own engine) and, if this server
        started Ray, Ray too: nothing is left running."""
        self._stopping = True
        threads = [
            threading.Thread(target=replica.stop, args=(REPLICA_STOP_TIMEOUT_SECONDS,), daemon=True)
            for replica in self.replicas
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if self._ray_started_here:
            import ray

            ray.shutdown()
            self._ray_started_here = False
