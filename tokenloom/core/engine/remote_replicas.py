"""Data-parallel replicas on other nodes without Ray (vLLM's multi-node ``mp`` data parallelism).

The head node's server (``-dp N -dpl L -dpa HEAD``) runs L replicas itself and listens on
``HEAD:--data-parallel-rpc-port`` (:class:`ReplicaListener`) for the others. Each other node runs
``tokenloom serve MODEL --headless -dp N -dpl L2 -dpr START -dpa HEAD``
(:func:`run_headless`): it starts its replicas, ranks START on, and each connects to the head
(:func:`connect_to_head`), says which rank it is (:class:`Hello`), and then speaks over that one
connection the messages a local replica speaks over its pipes
(:mod:`~tokenloom.core.engine.replica_messages`). The server's end of such a replica is
:class:`~tokenloom.core.engine.data_parallel.RemoteReplica`.

The connection is :mod:`multiprocessing.connection`'s, which pickles: both ends prove they hold
the shared secret ``TOKENLOOM_NODE_AUTHKEY`` (an HMAC challenge each way) before any message is
read, because a pickle from an unauthenticated peer could run code. The secret is required.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

from tokenloom.core.config import EngineArgs
from tokenloom.core.engine.replica_host import enter_replica, serve_replica
from tokenloom.core.executor import node_authkey, wait_for_node_processes, worker_process
from tokenloom.errors import ConfigError, EngineDeadError
from tokenloom.plugins.manager import PlainPlugins, PluginSet

logger = logging.getLogger(__name__)

CONNECT_RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class Hello:
    """A headless node's replica, first on its connection: its rank and the model it serves."""

    rank: int
    model: str


def dp_authkey() -> bytes:
    """The shared secret of a multi-node data-parallel group; ConfigError when it is not set."""
    return node_authkey("data-parallel-address")


class ReplicaListener:
    """The head's socket for the replicas of --headless nodes: a thread accepts each connection,
    authenticates it, reads its :class:`Hello` and hands ``(rank, connection)`` to ``attach``;
    a connection with a bad secret, an unexpected rank or another model is closed and logged."""

    def __init__(
        self,
        address: str,
        port: int,
        ranks: set[int],
        model: str,
        attach: Callable[[int, Connection], None],
    ):
        self._waiting = set(ranks)
        self._model = model
        self._attach = attach
        try:
            self._listener = Listener((address, port), authkey=dp_authkey())
        except OSError as exc:
            raise ConfigError(
                f"cannot listen for the headless nodes' replicas on {address}:{port}: {exc.strerror or exc}",
                param="data-parallel-rpc-port",
            ) from None
        logger.info(
            "data parallel: waiting on %s:%d for the replicas of rank%s %s (started by `tokenloom serve --headless`)",
            address,
            port,
            "s" if len(ranks) > 1 else "",
            ", ".join(map(str, sorted(ranks))),
        )
        threading.Thread(target=self._accept, name="tokenloom-dp-listener", daemon=True).start()

    def _accept(self) -> None:
        while self._waiting:
            try:
                connection = self._listener.accept()
            except (multiprocessing.AuthenticationError, EOFError, ConnectionError) as exc:
                logger.warning("data parallel: refused a replica connection: %s", exc or type(exc).__name__)
                continue
            except OSError:  # closed
                return
            try:
                hello = connection.recv() if connection.poll(30) else None
            except (EOFError, OSError):
                hello = None
            if not isinstance(hello, Hello) or hello.rank not in self._waiting or hello.model != self._model:
                logger.warning(
                    "data parallel: refused a replica connection (%s; waiting for ranks %s of model %r)",
                    hello,
                    sorted(self._waiting),
                    self._model,
                )
                connection.close()
                continue
            self._waiting.discard(hello.rank)
            logger.info("data parallel: the replica of rank %d connected", hello.rank)
            self._attach(hello.rank, connection)
        self.close()

    def close(self) -> None:
        try:
            self._listener.close()
        except OSError:
            pass


def connect_to_head(address: str, port: int, hello: Hello, timeout: float) -> Connection:
    """A replica's connection to the head's :class:`ReplicaListener`, retried until ``timeout``
    (the head may start after this node); EngineDeadError when it never answers."""
    deadline = time.monotonic() + timeout
    authkey = dp_authkey()
    while True:
        try:
            connection = Client((address, port), authkey=authkey)
        except OSError as exc:  # refused, unreachable, not resolved (yet)
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"the head node {address}:{port} did not answer within {timeout:.0f} s: {exc}"
                ) from None
            time.sleep(CONNECT_RETRY_SECONDS)
            continue
        connection.send(hello)
        return connection


def remote_replica_main(
    rank: int, engine_args: EngineArgs, tables: PlainPlugins, cpu_ids: list[int] | None, timeout: float
) -> None:
    """A headless node's replica process: connects to the head, then serves as a local replica does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the headless process stops its replicas itself
    enter_replica(rank, cpu_ids)
    parallel = engine_args.create_engine_config().parallel
    address, port = parallel.data_parallel_address, parallel.data_parallel_rpc_port
    assert address is not None  # checked by the config
    connection = connect_to_head(address, port, Hello(rank, engine_args.model), timeout)
    asyncio.run(serve_replica(engine_args, tables, connection, connection))


def run_headless(engine_args: EngineArgs, plugins: PluginSet, timeout: float) -> int:
    """``tokenloom serve --headless``: starts this node's replicas and waits for them (each ends
    when the head's server stops it or goes away); SIGTERM or Ctrl-C stops them. The exit code
    is 0 when every replica ended cleanly."""
    from tokenloom.core.engine.replica_handles import local_cpu_sets, replica_engine_args

    dp_authkey()  # fail here, before any process starts
    parallel = engine_args.create_engine_config().parallel
    local = parallel.data_parallel_size_local or 0
    ranks = list(range(parallel.data_parallel_start_rank, parallel.data_parallel_start_rank + local))
    tables = plugins.to_plain()
    processes = [
        worker_process(
            remote_replica_main,
            (rank, replica_engine_args(engine_args, rank), tables, cpu_ids, timeout),
            name=f"tokenloom-dp-replica-{rank}",
        )
        for rank, cpu_ids in zip(ranks, local_cpu_sets(len(ranks)), strict=True)
    ]
    for process in processes:
        process.start()
    logger.info(
        "headless: data-parallel replica%s %s of %d, for the server at %s:%d",
        "s" if len(ranks) > 1 else "",
        ", ".join(map(str, ranks)),
        parallel.data_parallel_size,
        parallel.data_parallel_address,
        parallel.data_parallel_rpc_port,
    )
    return wait_for_node_processes(processes, "replicas")
