"""The ``mp`` executor: ``tp * pp`` worker processes on this machine (spawned, never forked:
the engine's process holds threads and maybe a device context), each one
:class:`~tokenloom.builtin_plugins.executors.worker_host.WorkerHost`. The default when
``tp * pp > 1``. With ``--nnodes`` the workers are spread over several nodes
(:mod:`~tokenloom.builtin_plugins.executors.worker_nodes`): this node starts its share, and the
others' workers reach the engine over a TCP connection each instead of a pipe.

Each step's :class:`SchedulerOutput` is pickled once and written to every worker's pipe; the
output rank's reply is the step's result. Writes never wait for earlier replies, so up to
``pp_size`` steps are in flight (``execute_async``); a reader thread matches replies to calls in
the order they were sent and notices at once when a worker process ends, or when one has not
answered a step within the step timeout (``TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS``): a worker
that hangs or is stopped then kills the engine as a dead one does, and the workers are killed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from tokenloom.builtin_plugins.executors.worker_grid import (
    START_TIMEOUT_SECONDS,
    WorkerGridExecutor,
)
from tokenloom.builtin_plugins.executors.worker_host import (
    WorkerHost,
    WorkerLaunch,
    configure_worker_logging,
    describe_exit,
    free_port,
)
from tokenloom.builtin_plugins.executors.worker_nodes import RemoteWorkerProcess, accept_node_workers, run_worker_node
from tokenloom.errors import EngineDeadError
from tokenloom.worker_api import (
    EXECUTE_MODEL_TIMEOUT_ENV,
    EngineConfig,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerSpec,
    is_stopped,
    worker_process,
)

logger = logging.getLogger(__name__)

# a worker asked to stop gets this long to leave before it is terminated, then killed
STOP_GRACE_SECONDS = 5.0
# how often, at most, the reader thread looks for a call past its timeout while it waits
TIMEOUT_CHECK_SECONDS = 1.0

_OK, _ERROR = "ok", "error"


class RemoteWorkerError(Exception):
    """A worker's exception as text, when the exception itself does not pickle."""


def _pickled_reply(status: str, payload: Any) -> bytes:
    try:
        data = pickle.dumps((status, payload), protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)  # an exception with a custom __init__ may pickle but not unpickle
        return data
    except Exception:
        text = "".join(traceback.format_exception(payload)) if isinstance(payload, BaseException) else repr(payload)
        return pickle.dumps((_ERROR, RemoteWorkerError(text)), protocol=pickle.HIGHEST_PROTOCOL)


def run_worker_process(launch: WorkerLaunch, conn: multiprocessing.connection.Connection) -> None:
    """A worker process's main: build the host, then answer calls ``(method, args)`` in order
    until told to stop or the engine's end of the pipe closes (the engine process is gone)."""
    configure_worker_logging(launch.rank, launch.log_level)
    try:
        host = WorkerHost(launch)
    except BaseException as exc:
        logger.exception("worker %d failed to start", launch.rank)
        conn.send_bytes(_pickled_reply(_ERROR, exc))
        return
    conn.send_bytes(_pickled_reply(_OK, host.pid()))
    try:
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except EOFError:
                logger.warning("worker %d: the engine process went away; stopping", launch.rank)
                return
            if method == "stop":
                conn.send_bytes(_pickled_reply(_OK, None))
                return
            try:
                reply = _pickled_reply(_OK, getattr(host, method)(*args))
            except Exception as exc:
                logger.exception("worker %d: %s failed", launch.rank, method)
                reply = _pickled_reply(_ERROR, exc)
            conn.send_bytes(reply)
    finally:
        host.close()


class _Call:
    """One call sent to every worker: its future completes when all have answered."""

    def __init__(
        self, method: str, num_workers: int, combine: Callable[[list[Any]], Any], timeout: float | None = None
    ):
        self.method = method
        self.timeout = timeout
        """Seconds each worker may take to answer, from when the call was sent or the worker
        answered its previous call, whichever is later (None: no limit here)."""
        self.sent_at = time.monotonic()
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.replies: list[Any] = [None] * num_workers
        self.remaining = num_workers
        self.error: BaseException | None = None
        self.combine = combine

    def answer(self, rank: int, status: str, payload: Any) -> None:
        if status == _ERROR and self.error is None:
            self.error = payload
        self.replies[rank] = payload
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                try:
                    self.future.set_result(self.combine(self.replies))
                except Exception as exc:
                    self.future.set_exception(exc)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class WorkerProcessGroup:
    """The worker processes, their pipes and the reader thread. Separate from the executor so a
    finalizer can stop the processes when the executor is dropped without ``shutdown``.

    ``launches`` are this node's workers, spawned here; ``remote_workers`` (called once they
    are spawned) returns the handles and connections of the workers of other nodes, ranks after
    this node's, in rank order."""

    def __init__(
        self,
        launches: list[WorkerLaunch],
        remote_workers: Callable[[], list[tuple[RemoteWorkerProcess, multiprocessing.connection.Connection]]] = list,
    ):
        self.processes: list[Any] = []  # by rank: multiprocessing.Process, or RemoteWorkerProcess
        self.conns: list[multiprocessing.connection.Connection] = []
        # held while a call is registered and written: writes reach every pipe in call order.
        # The reader never takes it: a writer blocked on a full pipe waits for a worker that
        # may itself wait for the reader to drain its reply.
        self._send_lock = threading.Lock()
        self._closing = False
        self.dead_reason: str | None = None
        self._wake_reader, self._wake_writer = multiprocessing.Pipe(duplex=False)
        try:
            for launch in launches:
                parent_end, child_end = multiprocessing.Pipe()
                process = worker_process(
                    run_worker_process,
                    (launch, child_end),
                    name=f"tokenloom-worker-{launch.rank}",
                    daemon=True,  # multiprocessing's exit handler terminates them if all else fails
                )
                process.start()
                child_end.close()  # so the worker's death reads as EOF here
                self.processes.append(process)
                self.conns.append(parent_end)
            for remote, conn in remote_workers():
                self.processes.append(remote)
                self.conns.append(conn)
        except BaseException:  # e.g. the spawn failed, or another node's workers never came
            for process in self.processes:
                process.kill()
                process.join(timeout=2.0)
            raise
        self.num_workers = len(self.processes)
        self._pending: list[collections.deque[_Call]] = [collections.deque() for _ in self.processes]
        # by rank: when the worker last answered a call (read and written by the reader thread)
        self._answered_at = [time.monotonic()] * self.num_workers
        # each worker's first reply says it started (its replies wait in its pipe until the reader reads them)
        self.started = self._register("start", lambda pids: pids)
        self._reader = threading.Thread(target=self._read_replies, name="tokenloom-mp-replies", daemon=True)
        self._reader.start()

    # -- calls ----------------------------------------------------------------------------

    def _register(self, method: str, combine: Callable[[list[Any]], Any], timeout: float | None = None) -> _Call:
        call = _Call(method, self.num_workers, combine, timeout)
        for pending in self._pending:
            pending.append(call)
        return call

    def call(
        self, method: str, *args: Any, combine: Callable[[list[Any]], Any] = list, timeout: float | None = None
    ) -> _Call:
        """Send ``method(*args)`` to every worker (without waiting for earlier calls). With a
        ``timeout``, a worker that has not answered that many seconds after the call was due
        (sent, and the worker's earlier calls answered) kills the engine (see :meth:`_timed_out`)."""
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self.dead_reason is not None:
                raise EngineDeadError(f"the engine's {self.dead_reason}")
            if self._closing:
                raise EngineDeadError("the mp executor is shut down")
            # registered before it is sent: the reader may see the reply before send returns
            call = self._register(method, combine, timeout)
            try:
                for conn in self.conns:
                    conn.send_bytes(data)
            except OSError as exc:  # a broken pipe: the worker is gone
                self._mark_dead(f"pipe to a worker broke while sending {method}: {exc}")
        if self.dead_reason is not None:  # it died while this call was being registered
            call.fail(EngineDeadError(f"the engine's {self.dead_reason}"))
        return call

    def _read_replies(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes) if process.sentinel}
        by_conn = {conn: rank for rank, conn in enumerate(self.conns)}
        while True:
            ready = multiprocessing.connection.wait(
                [*by_conn, *sentinels, self._wake_reader], timeout=self._until_next_timeout()
            )
            if self._closing:
                return
            for item in ready:
                rank = by_conn.get(item)  # type: ignore[call-overload]
                if rank is None:
                    continue  # a sentinel: read what the worker wrote before it ended first
                try:
                    status, payload = pickle.loads(item.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._worker_ended(rank)
                    return
                call = self._pending[rank].popleft()
                self._answered_at[rank] = time.monotonic()
                call.answer(rank, status, payload)
            for item in ready:
                rank = sentinels.get(item)
                if rank is not None and not self._closing:
                    conn = self.conns[rank]
                    if conn.poll():
                        continue  # its last replies first; EOF comes after them
                    self._worker_ended(rank)
                    return
            if self._overdue_ranks():
                self._timed_out()
                return

    def _overdue_since(self, rank: int) -> float | None:
        """When the call ``rank`` owes first stops being on time (None: it owes none with a limit)."""
        pending = self._pending[rank]
        call = pending[0] if pending else None
        if call is None or call.timeout is None:
            return None
        return max(call.sent_at, self._answered_at[rank]) + call.timeout

    def _until_next_timeout(self) -> float | None:
        """How long the reader may wait for a reply before it must look for an overdue call."""
        deadlines = [
            deadline for rank in range(self.num_workers) if (deadline := self._overdue_since(rank)) is not None
        ]
        if not deadlines:  # a call sent while the reader waits is looked at within a tick
            return TIMEOUT_CHECK_SECONDS
        return min(TIMEOUT_CHECK_SECONDS, max(0.0, min(deadlines) - time.monotonic()))

    def _overdue_ranks(self) -> list[int]:
        now = time.monotonic()
        return [
            rank
            for rank in range(self.num_workers)
            if (deadline := self._overdue_since(rank)) is not None and now >= deadline
        ]

    def _timed_out(self) -> None:
        """Some worker has not answered a call within its timeout: it hangs (or a peer it waits
        for in a collective does, or it was stopped). The engine is dead, with a reason naming
        every worker past its time, and all the workers are killed: the survivors would wait in
        their collectives for ever, and a stopped process would outlive the server."""
        ranks = self._overdue_ranks()
        call = self._pending[ranks[0]][0]
        stopped = {rank for rank in ranks if self._is_local(rank) and is_stopped(self.processes[rank].pid)}
        workers = " and ".join(  # the stopped ones first: the others most likely wait for them
            self._describe(rank, ", stopped by a signal" if rank in stopped else "")
            for rank in sorted(ranks, key=lambda rank: rank not in stopped)
        )
        self._mark_dead(
            f"{workers} did not answer {call.method} within {call.timeout:g}s "
            f"({EXECUTE_MODEL_TIMEOUT_ENV[0]} sets the limit)"
        )
        for process in self.processes:
            process.kill()

    def _is_local(self, rank: int) -> bool:
        return not isinstance(self.processes[rank], RemoteWorkerProcess)

    def _describe(self, rank: int, state: str = "") -> str:
        process = self.processes[rank]
        where = "" if self._is_local(rank) else f" on node {process.node_rank}"
        return f"worker {rank} (pid {process.pid}{where}{state})"

    def _worker_ended(self, rank: int) -> None:
        if self._closing:
            return
        process = self.processes[rank]
        if not self._is_local(rank):
            self._mark_dead(f"{self._describe(rank)} disconnected (its node stopped, or the network between them)")
            return
        process.join(timeout=1.0)
        self._mark_dead(f"{self._describe(rank)} {describe_exit(process.exitcode)}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("mp executor: %s; the engine cannot continue", reason)
        error = EngineDeadError(f"the engine's {reason}")
        for pending in self._pending:
            while pending:
                pending.popleft().fail(error)

    def check_alive(self) -> None:
        if self.dead_reason is None and not self._closing:
            for rank, process in enumerate(self.processes):
                if process.exitcode is not None:
                    self._mark_dead(f"{self._describe(rank)} {describe_exit(process.exitcode)}")
                    break
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine's {self.dead_reason}")

    # -- stopping -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ask every worker to stop, then terminate (and kill) the ones that do not; idempotent."""
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(("stop", ())))
                except OSError:
                    pass  # already gone
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=2.0)
        self._wake_writer.send_bytes(b"")
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout=5.0)
        error = EngineDeadError("the mp executor is shut down")
        for pending in self._pending:
            while pending:
                pending.popleft().fail(error)
        for conn in (*self.conns, self._wake_reader, self._wake_writer):
            conn.close()


class MultiprocExecutor(WorkerGridExecutor):
    """``tp * pp`` worker processes on this machine, one per rank, sharing its cores."""

    backend_name = "mp"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.group: WorkerProcessGroup | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def initialize(self) -> int:
        started = time.perf_counter()
        parallel = self.config.parallel
        per_node = parallel.workers_per_node
        if parallel.nnodes == 1:
            launches = self.worker_launches(f"tcp://127.0.0.1:{free_port()}", lambda rank: per_node)
            self.group = WorkerProcessGroup(launches)
        else:
            launches = self.worker_launches(
                f"tcp://{parallel.master_addr}:{parallel.master_port}", lambda rank: per_node
            )
            others = launches[per_node:]
            self.group = WorkerProcessGroup(
                launches[:per_node], lambda: accept_node_workers(self.config, others, START_TIMEOUT_SECONDS)
            )
        # the processes go when this executor does, even without shutdown() (and at exit)
        self._finalizer = weakref.finalize(self, self.group.shutdown)
        try:
            self.worker_pids = self._wait(self.group.started, "start")
            logger.info("mp executor: %d workers started in %.2fs", self.world_size, time.perf_counter() - started)
            return self.load_model_and_allocate_kv_cache(started)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def run_node(cls, config: EngineConfig, timeout: float) -> int:
        return run_worker_node(config, timeout)

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        replies: list[Any] = self._wait(self._live_group().call(method, *args), method)
        return replies

    def _wait(self, call: _Call, what: str) -> Any:
        try:
            return call.future.result(timeout=START_TIMEOUT_SECONDS)
        except concurrent.futures.TimeoutError:
            raise EngineDeadError(
                f"mp executor: the workers did not finish {what} within {START_TIMEOUT_SECONDS:.0f}s "
                "(TOKENLOOM_WORKER_START_TIMEOUT sets the limit)"
            ) from None

    def _live_group(self) -> WorkerProcessGroup:
        if self.group is None:
            raise EngineDeadError("the mp executor is not initialized (or was shut down)")
        return self.group

    def execute_async(self, scheduler_output: SchedulerOutput) -> concurrent.futures.Future[ModelRunnerOutput]:
        rank = self.output_rank
        call = self._live_group().call(
            "execute", scheduler_output, combine=lambda replies: replies[rank], timeout=self.execute_timeout
        )
        return call.future

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(scheduler_output).result()

    def prefault_kv_cache(self, max_bytes: int) -> int:
        # every worker maps the same share of its own cache; report one worker's bytes
        call = self._live_group().call("prefault_kv_cache", max_bytes, combine=min, timeout=self.execute_timeout)
        mapped: int = call.future.result()
        return mapped

    def check_health(self) -> None:
        self._live_group().check_alive()

    def shutdown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs group.shutdown once
        self.group = None
