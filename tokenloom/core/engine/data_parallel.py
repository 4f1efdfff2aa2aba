"""Data parallelism (``-dp N``): N engine replicas, each a whole engine (scheduler, executor,
KV cache; itself tensor-parallel if asked) in its own process (``mp``) or Ray actor (``ray``),
behind one API server. :class:`DataParallelAsyncLLM` has :class:`AsyncLLM`'s surface, so the
server cannot tell one engine from N: it sends each request to the least loaded replica,
routes aborts to the replica holding the request and sums the replicas' stats.

This module is the server's end: the balancer and the engine client. It reaches each replica
through a :class:`~tokenloom.core.engine.replica_handles.ReplicaHandle` (a process for ``mp``, an
actor for ``ray``: :mod:`~tokenloom.core.engine.replica_handles`). What runs inside a replica, a plain :class:`AsyncLLM` wrapped by a
:class:`~tokenloom.core.engine.replica_host.ReplicaHost`, is
:mod:`~tokenloom.core.engine.replica_host`; the two speak the frozen dataclasses of
:mod:`~tokenloom.core.engine.replica_messages`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from tokenloom.core.config import EngineArgs, EngineConfig, LoRAConfig
from tokenloom.core.distributed import import_ray
from tokenloom.core.engine.commands import AbortRequest
from tokenloom.core.engine.engine_stats import EngineStats, sum_stats
from tokenloom.core.engine.replica_handles import (
    ProcessReplica,
    RayReplica,
    RemoteReplica,
    ReplicaHandle,
    local_cpu_sets,
    mp_replica_ranks,
    ray_actor_options,
    replica_engine_args,
)
from tokenloom.core.engine.replica_messages import (
    AddLora,
    Call,
    Encode,
    FromReplica,
    Generate,
    Output,
    PackedError,
    RemoveLora,
    ReplicaCall,
    Reply,
    ResetPrefixCacheCall,
    ResolveLora,
    Stats,
)
from tokenloom.core.engine.request_streams import RequestStreams, StreamItem
from tokenloom.core.logits_processors import LogitsProcessorResolver
from tokenloom.core.sampling_params import PoolingParams, SamplingParams
from tokenloom.core.structured_output_compile import REQUEST_CLIENT
from tokenloom.errors import EngineDeadError
from tokenloom.plugins.manager import PluginSet

logger = logging.getLogger(__name__)

# how long start-up waits for every replica to build its engine (loading a big model is slow)
REPLICA_START_TIMEOUT_SECONDS = 900.0
# how long shutdown waits for a replica to stop its engine before killing it
REPLICA_STOP_TIMEOUT_SECONDS = 30.0


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
        self._listener: Any = None  # the ReplicaListener for --headless nodes' replicas, if any
        self._logits_processor_resolver: LogitsProcessorResolver | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, plugins: PluginSet | None = None) -> DataParallelAsyncLLM:
        """Starts every replica (they build their engines at the same time) and returns once all
        are ready; a replica's build error is raised here after the others are stopped."""
        from tokenloom.plugins.manager import load_plugins

        config = engine_args.create_engine_config()
        plugins = plugins or load_plugins()
        parallel = config.parallel
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
                    replicas.append(RayReplica(index, replica_engine_args(engine_args, index), tables, options))
            else:
                local_ranks, remote_ranks = mp_replica_ranks(parallel)
                local_ranks, remote_ranks = mp_replica_ranks(parallel)
                for rank, cpu_ids in zip(local_ranks, local_cpu_sets(len(local_ranks)), strict=True):
                    replicas.append(
                        ProcessReplica(len(replicas), replica_engine_args(engine_args, rank), tables, cpu_ids)
                    )
                if remote_ranks:
                    from tokenloom.core.engine.remote_replicas import ReplicaListener

                    remote = {
                        rank: RemoteReplica(len(replicas) + offset, rank) for offset, rank in enumerate(remote_ranks)
                    }
                    replicas.extend(remote.values())
                    assert parallel.data_parallel_address is not None  # checked by the config
                    self._listener = ReplicaListener(
                        parallel.data_parallel_address,
                        parallel.data_parallel_rpc_port,
                        set(remote),
                        engine_args.model,
                        lambda rank, connection: remote[rank].attach(connection),
                    )
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
        if self._listener is not None:
            self._listener.close()
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
