"""One engine's workers on several nodes without Ray: vLLM's ``--nnodes``/``--node-rank`` with
the ``mp`` executor.

Node 0 runs ``tokenloom serve MODEL -tp T -pp P --nnodes N --master-addr HEAD``: its ``mp``
executor starts its own share of the ``T * P`` workers (ranks ``0 .. T * P / N - 1``) as usual
and accepts the others on ``HEAD:--master-port + 1`` (:func:`accept_node_workers`). Every other
node runs the same command with ``--node-rank R --headless`` (:func:`run_worker_node`): it starts
its share of worker processes, and each connects to node 0, says which rank it is
(:class:`WorkerHello`), receives its :class:`WorkerLaunch` and from then on answers the engine's
calls over that connection exactly as a local worker answers over its pipe. The workers meet for
``torch.distributed`` at ``HEAD:--master-port``.

The connection is :mod:`multiprocessing.connection`'s, which pickles: both ends prove they hold
the shared secret ``TOKENLOOM_NODE_AUTHKEY`` before any message is read. To the executor a worker
on another node is a :class:`RemoteWorkerProcess`: its end is seen when its connection closes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from tokenloom.builtin_plugins.executors.worker_host import WorkerLaunch
from tokenloom.errors import ConfigError, EngineDeadError
from tokenloom.worker_api import EngineConfig, node_authkey, wait_for_node_processes, worker_process

logger = logging.getLogger(__name__)

CONNECT_RETRY_SECONDS = 0.5
# how long a connected worker has to say who it is
HELLO_SECONDS = 30.0


@dataclass(frozen=True)
class WorkerHello:
    """A worker on another node, first on its connection: its rank, its node, its process id
    and the model its node was told to serve."""

    rank: int
    node_rank: int
    pid: int
    model: str


class RemoteWorkerProcess:
    """The executor's handle on a worker of another node, shaped like a local
    :class:`multiprocessing.Process` where the executor reads one: no sentinel and no exit code
    (its end shows as the end of its connection), and stopping it closes the connection (the
    worker then leaves)."""

    sentinel = None
    exitcode = None

    def __init__(self, hello: WorkerHello, connection: Connection):
        self.pid = hello.pid
        self.node_rank = hello.node_rank
        self._connection = connection

    def is_alive(self) -> bool:
        return not self._connection.closed

    def join(self, timeout: float | None = None) -> None:
        return None

    def terminate(self) -> None:
        self._connection.close()

    kill = terminate


def accept_node_workers(
    config: EngineConfig, launches: list[WorkerLaunch], timeout: float
) -> list[tuple[RemoteWorkerProcess, Connection]]:
    """Node 0's side: waits (at most ``timeout`` seconds) until every rank of ``launches`` (the
    other nodes' workers) has connected to ``--master-addr:--master-port + 1``, sends each its
    launch, and returns their handles and connections in the order of ``launches``. A connection
    with a bad secret, a rank not waited for or another model is closed and logged."""
    parallel = config.parallel
    address, port = parallel.master_addr, parallel.worker_control_port
    by_rank = {launch.rank: launch for launch in launches}
    attached: dict[int, tuple[RemoteWorkerProcess, Connection]] = {}
    try:
        listener = Listener((address, port), authkey=node_authkey("nnodes"))
    except OSError as exc:
        raise ConfigError(
            f"cannot listen for the other nodes' workers on {address}:{port} (--master-addr, --master-port + 1): "
            f"{exc.strerror or exc}",
            param="master-port",
        ) from None
    logger.info(
        "mp executor: waiting on %s:%d for workers %s from %d other node(s) (`tokenloom serve ... --node-rank R "
        "--headless`)",
        address,
        port,
        ", ".join(map(str, sorted(by_rank))),
        parallel.nnodes - 1,
    )
    deadline = time.monotonic() + timeout
    # closing a listening socket does not wake a thread blocked in accept(): a connection does
    timer = threading.Timer(timeout, _knock, (address, port))
    timer.start()
    try:
        while len(attached) < len(by_rank):
            try:
                connection = listener.accept()
            except (multiprocessing.AuthenticationError, EOFError, ConnectionError) as exc:
                if time.monotonic() < deadline:
                    logger.warning("mp executor: refused a worker connection: %s", exc or type(exc).__name__)
                    continue
                connection = None
            if time.monotonic() >= deadline:
                if connection is not None:
                    connection.close()
                missing = sorted(set(by_rank) - set(attached))
                raise EngineDeadError(
                    f"mp executor: workers {', '.join(map(str, missing))} of the other nodes did not connect to "
                    f"{address}:{port} within {timeout:.0f}s (start them with `tokenloom serve ... --nnodes "
                    f"{parallel.nnodes} --node-rank R --master-addr {address} --headless`)"
                )
            hello = _read_hello(connection)
            if (
                not isinstance(hello, WorkerHello)
                or hello.rank not in by_rank
                or hello.rank in attached
                or hello.model != config.model.model
            ):
                logger.warning(
                    "mp executor: refused a worker connection (%s; waiting for ranks %s of model %r)",
                    hello,
                    sorted(set(by_rank) - set(attached)),
                    config.model.model,
                )
                connection.close()
                continue
            connection.send(by_rank[hello.rank])
            attached[hello.rank] = (RemoteWorkerProcess(hello, connection), connection)
            logger.info("mp executor: worker %d (pid %d on node %d) connected", hello.rank, hello.pid, hello.node_rank)
    except BaseException:
        for _, connection in attached.values():
            connection.close()
        raise
    finally:
        timer.cancel()
        listener.close()
    return [attached[launch.rank] for launch in launches]


def _knock(address: str, port: int) -> None:
    """Connects to the listener (and leaves at once), so that its accept() returns."""
    try:
        socket.create_connection((address, port), timeout=5).close()
    except OSError:
        pass


def _read_hello(connection: Connection) -> Any:
    try:
        return connection.recv() if connection.poll(HELLO_SECONDS) else None
    except (EOFError, OSError):
        return None


def connect_to_node0(config: EngineConfig, hello: WorkerHello, timeout: float) -> tuple[Connection, WorkerLaunch]:
    """A worker's connection to node 0's engine, retried until ``timeout`` (node 0 may start
    after this node), and the launch node 0 sent back; EngineDeadError when it never answers."""
    parallel = config.parallel
    address, port = parallel.master_addr, parallel.worker_control_port
    deadline = time.monotonic() + timeout
    authkey = node_authkey("nnodes")
    while True:
        try:
            connection = Client((address, port), authkey=authkey)
            connection.send(hello)
            launch = connection.recv()
            break
        except (OSError, EOFError) as exc:  # refused, unreachable, not resolved (yet), or refused by node 0
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"node 0's engine at {address}:{port} did not take worker {hello.rank} within {timeout:.0f}s: {exc}"
                ) from None
            time.sleep(CONNECT_RETRY_SECONDS)
    if not isinstance(launch, WorkerLaunch) or launch.rank != hello.rank:
        raise EngineDeadError(f"node 0 answered worker {hello.rank} with {launch!r} instead of its launch")
    return connection, launch


def node_worker_main(rank: int, config: EngineConfig, timeout: float) -> None:
    """A worker process of a node other than 0: joins node 0's engine, then serves as a local worker does."""
    from tokenloom.builtin_plugins.executors.multiproc import run_worker_process

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the node's process stops its workers itself
    hello = WorkerHello(rank, config.parallel.node_rank, os.getpid(), config.model.model)
    connection, launch = connect_to_node0(config, hello, timeout)
    run_worker_process(launch, connection)


def run_worker_node(config: EngineConfig, timeout: float) -> int:
    """``tokenloom serve ... --nnodes N --node-rank R --headless``: starts this node's workers and
    waits for them (each ends when node 0's engine stops it or goes away); SIGTERM or Ctrl-C stops
    them. The exit code is 0 when every worker ended cleanly."""
    node_authkey("nnodes")  # fail here, before any process starts
    parallel = config.parallel
    per_node = parallel.workers_per_node
    ranks = range(parallel.node_rank * per_node, (parallel.node_rank + 1) * per_node)
    processes = [
        worker_process(node_worker_main, (rank, config, timeout), name=f"tokenloom-worker-{rank}") for rank in ranks
    ]
    for process in processes:
        process.start()
    logger.info(
        "headless: node %d of %d, workers %s of %d, for the engine at %s:%d",
        parallel.node_rank,
        parallel.nnodes,
        ", ".join(map(str, ranks)),
        parallel.world_size,
        parallel.master_addr,
        parallel.worker_control_port,
    )
    return wait_for_node_processes(processes, "workers")
