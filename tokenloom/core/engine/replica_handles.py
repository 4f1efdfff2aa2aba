"""The server's end of one data-parallel replica: :class:`ReplicaHandle`, which a receiver
thread feeds from the replica and declares dead when it falls silent, for a spawned process
(:class:`ProcessReplica`, ``mp``) or a Ray actor (:class:`RayReplica`, ``ray``); and where the
replicas go (their rank, this machine's cores, Ray's nodes). The balancer and the engine client
over the handles are :mod:`~tokenloom.core.engine.data_parallel`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, cast

from tokenloom.core.config import EngineArgs
from tokenloom.core.engine.replica_host import STATS_INTERVAL_SECONDS, RayReplicaActor, replica_process_main
from tokenloom.core.engine.replica_messages import Failed, FromReplica, Ready, Shutdown, ToReplica
from tokenloom.core.executor import EXECUTE_MODEL_TIMEOUT_ENV, execute_model_timeout, is_stopped, worker_process
from tokenloom.errors import ConfigError, EngineDeadError
from tokenloom.plugins.manager import PlainPlugins

logger = logging.getLogger(__name__)

# the CPUs a Ray replica asks for (and keeps its torch threads to)
REPLICA_RAY_CPUS = 1


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

    def receive(
        self,
        connection: Any,
        on_messages: Callable[[int, list[FromReplica]], None],
        on_death: Callable[[int, str], None],
    ) -> bool:
        """Reads ``connection`` (a pipe's or socket's end) until it closes: True then; False when
        the replica failed to build or went silent (already reported)."""
        while True:
            try:
                if self.ready.done() and self.silence_limit is not None:
                    if not connection.poll(self.silence_limit):
                        self._silent(on_death)
                        return False
                messages = connection.recv()
            except (EOFError, OSError):
                return True
            match messages:
                case [Ready(facts)]:
                    self.ready.set_result(facts)
                case [Failed(error)]:
                    self.ready.set_exception(error.unpack())
                    return False
                case _:
                    on_messages(self.index, messages)

    def ended(self, reason: str, on_death: Callable[[int, str], None]) -> None:
        """The replica's connection closed: a build that never finished fails with ``reason``,
        a running replica is dead (unless it was being stopped)."""
        if not self.ready.done():  # died while building: start-up raises it
            self.ready.set_exception(EngineDeadError(reason))
        elif not self.closing:
            on_death(self.index, reason)

    def _silent(self, on_death: Callable[[int, str], None]) -> None:
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
        inbox_reader, self._inbox = multiprocessing.Pipe(duplex=False)
        self._outbox, outbox_writer = multiprocessing.Pipe(duplex=False)
        # not a daemon: a replica running -tp N starts worker processes of its own
        self.process = worker_process(
            replica_process_main,
            (index, engine_args, tables, cpu_ids, inbox_reader, outbox_writer),
            name=f"tokenloom-dp-replica-{index}",
        )
        self.process.start()
        inbox_reader.close()
        outbox_writer.close()

    def start(
        self, on_messages: Callable[[int, list[FromReplica]], None], on_death: Callable[[int, str], None]
    ) -> None:
        def receive() -> None:
            if not self.receive(self._outbox, on_messages, on_death):
                return
            self.process.join(timeout=5)
            self.ended(
                f"data-parallel replica {self.index} (pid {self.process.pid}) exited with code {self.process.exitcode}",
                on_death,
            )

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


class RemoteReplica(ReplicaHandle):
    """A replica a ``tokenloom serve --headless`` node started: its messages over the one
    authenticated TCP connection it opened to this server
    (:mod:`~tokenloom.core.engine.remote_replicas`). It cannot be killed from here: closing
    the connection makes it stop."""

    def __init__(self, index: int, rank: int):
        super().__init__(index)
        self.rank = rank
        self._connection: Connection | None = None
        self._callbacks: tuple[Callable[[int, list[FromReplica]], None], Callable[[int, str], None]] | None = None
        self._attach_lock = threading.Lock()

    def attach(self, connection: Connection) -> None:
        """The replica connected (the listener's thread calls this)."""
        with self._attach_lock:
            self._connection = connection
            callbacks = self._callbacks
        if callbacks is not None:
            self._start_receiving(*callbacks)

    def start(
        self, on_messages: Callable[[int, list[FromReplica]], None], on_death: Callable[[int, str], None]
    ) -> None:
        with self._attach_lock:
            self._callbacks = (on_messages, on_death)
            attached = self._connection is not None
        if attached:
            self._start_receiving(on_messages, on_death)

    def _start_receiving(
        self, on_messages: Callable[[int, list[FromReplica]], None], on_death: Callable[[int, str], None]
    ) -> None:
        connection = self._connection
        assert connection is not None

        def receive() -> None:
            if self.receive(connection, on_messages, on_death):
                self.ended(
                    f"data-parallel replica {self.index} (rank {self.rank}, on a headless node) disconnected", on_death
                )

        threading.Thread(target=receive, name=f"tokenloom-dp-receive-{self.index}", daemon=True).start()

    def _silent(self, on_death: Callable[[int, str], None]) -> None:
        if self.closing:
            return
        on_death(
            self.index,
            self.silence_reason(f"data-parallel replica {self.index} (rank {self.rank}, on a headless node)"),
        )
        self.kill()

    def send(self, message: ToReplica) -> None:
        connection = self._connection
        if connection is None:
            raise EngineDeadError(f"data-parallel replica {self.index} (rank {self.rank}) has not connected")
        try:
            with self._send_lock:
                connection.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise EngineDeadError(
                f"data-parallel replica {self.index} (rank {self.rank}) cannot be reached: {exc}"
            ) from None

    def stop(self, timeout: float) -> None:
        self.closing = True
        with contextlib.suppress(EngineDeadError):
            self.send(Shutdown())
        self.kill()

    def kill(self) -> None:
        connection = self._connection
        if connection is not None:
            connection.close()


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


def mp_replica_ranks(parallel: Any) -> tuple[list[int], list[int]]:
    """Under ``mp``: the ranks of the replicas this server starts, and of those that connect to it
    from --headless nodes. With --data-parallel-hybrid-lb this node's server balances over its own
    replicas only (the other nodes run their own servers)."""
    size, start = parallel.data_parallel_size, parallel.data_parallel_start_rank
    local = size if parallel.data_parallel_size_local is None else parallel.data_parallel_size_local
    local_ranks = list(range(start, start + local))
    if parallel.data_parallel_hybrid_lb:
        return local_ranks, []
    return local_ranks, [rank for rank in range(size) if rank not in local_ranks]


def single_replica_rank(parallel: Any) -> int | None:
    """The rank of the one replica this server runs by itself (--data-parallel-rank behind an
    external load balancer, or a --data-parallel-hybrid-lb node of one replica); None when it
    balances over several."""
    if parallel.data_parallel_external_lb:
        return int(parallel.data_parallel_rank)
    if parallel.data_parallel_size == 1 or parallel.data_parallel_backend != "mp":
        return None
    local_ranks, remote_ranks = mp_replica_ranks(parallel)
    return local_ranks[0] if len(local_ranks) == 1 and not remote_ranks else None


def replica_engine_args(engine_args: EngineArgs, rank: int) -> EngineArgs:
    """The engine arguments of the replica of ``rank`` (what its KV-cache events carry): one
    engine, which starts no replicas of its own."""
    return dataclasses.replace(
        engine_args,
        data_parallel_size=1,
        data_parallel_size_local=None,
        data_parallel_rank=rank,
        data_parallel_start_rank=0,
        data_parallel_hybrid_lb=False,
        data_parallel_external_lb=False,
    )


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
