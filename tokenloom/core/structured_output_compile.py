"""Where guided-decoding constraints are checked and compiled off the caller's thread:
:class:`CompilePool`, a few daemon threads that bound each job by a time limit, abandon (and
replace) a thread whose job overruns, cap the runaway threads, and share the threads out by
client (:data:`REQUEST_CLIENT`) so one client never holds them all. A backend whose compile
can stop part-way polls :func:`compile_cancelled`.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from tokenloom.errors import InvalidRequestError, OverloadedError

logger = logging.getLogger(__name__)


COMPILE_THREADS = 2
DEFAULT_COMPILE_TIMEOUT = 30.0
# compiles past their time limit whose threads are still running (Python cannot stop a
# thread); beyond this many, new constraints are refused with a 429 until one ends
MAX_RUNAWAY_COMPILES = 4
# one client (API key, else peer address) has one check or compile running at a time within
# its time limit (the rest wait in line), so the others always have a thread; while this many
# of its jobs overran and still run, its new ones get a 429: one client never holds every
# runaway slot
MAX_RUNAWAY_PER_CLIENT = 2


# who the request being served comes from (an opaque key: its API key's digest, or its peer
# address), set per HTTP request by the server's ClientMiddleware; None offline. Compile slots
# are shared out by it.
REQUEST_CLIENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tokenloom_request_client", default=None)


_current_job = threading.local()


def compile_cancelled() -> bool:
    """True when the compile (or check) running on this thread overran its time limit: its
    request already got its 400. A backend that can stop its work (say, a compile in a child
    process it can kill) polls this and raises; Python cannot stop the thread for it."""
    job = getattr(_current_job, "job", None)
    return job is not None and job.timed_out


class _CompileJob:
    def __init__(
        self,
        future: concurrent.futures.Future[Any],
        work: Callable[[], Any],
        describe: str,
        client: str | None,
        overrun_error: Callable[[float], Exception],
    ):
        self.future = future
        self.work = work
        self.describe = describe
        self.client = client
        self.overrun_error = overrun_error
        self.finished = False
        self.timed_out = False


def _compile_overran(describe: str) -> Callable[[float], Exception]:
    return lambda timeout: InvalidRequestError(
        f"{describe} took longer than the server's limit of {timeout:g}s "
        "(--structured-outputs-compile-timeout); simplify it (for example smaller maxLength, maxItems "
        "or repetition counts)",
        param="structured_outputs",
    )


class CompilePool:
    """Runs compiles (and constraint checks) on ``num_threads`` daemon threads, each bounded by
    ``timeout`` seconds: a job that overruns fails its Future with a 400 at once, its thread
    is abandoned (it ends when the work does, or sooner if the backend watches
    :func:`compile_cancelled`; its result is dropped) and a fresh thread takes its place, so
    one pathological constraint never holds up the others. Runaway threads still burn CPU, so
    at most ``max_runaway`` may exist; past that, new jobs get a 429.

    Jobs carry the client they come from (None: no client, no limit): one client's jobs run
    one at a time within their time limit (the rest wait in line, in order), so one client
    never holds every thread; a job that overran leaves the line (its thread was replaced) but
    counts against ``max_runaway_per_client``, and a client with that many gets a 429 for new
    jobs (and its queued ones) while the others' jobs go on.
    """

    def __init__(
        self,
        num_threads: int = COMPILE_THREADS,
        timeout: float = DEFAULT_COMPILE_TIMEOUT,
        max_runaway: int = MAX_RUNAWAY_COMPILES,
        max_runaway_per_client: int = MAX_RUNAWAY_PER_CLIENT,
    ):
        self.timeout = timeout
        self.max_runaway = max_runaway
        self.max_runaway_per_client = max_runaway_per_client
        self._queue: deque[_CompileJob] = deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._num_runaway = 0
        # clients with a job running within its time limit; each client's runaway jobs
        self._busy_clients: set[str] = set()
        self._runaway: Counter[str] = Counter()
        self._num_workers = 0
        self._closed = False
        for _ in range(num_threads):
            self._start_worker()

    @property
    def num_runaway(self) -> int:
        """Compiles that overran their time limit and are still running."""
        return self._num_runaway

    def num_runaway_of(self, client: str) -> int:
        """``client``'s jobs that overran their limit and still run."""
        with self._lock:
            return self._runaway[client]

    def submit(
        self,
        work: Callable[[], Any],
        describe: str,
        client: str | None = None,
        overrun_error: Callable[[float], Exception] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Queue ``work``; its Future fails with ``overrun_error(timeout)`` (by default: the
        compile took too long, a 400) when it overruns. Raises OverloadedError (429) while the
        runaway slots, or ``client``'s share of them, are full."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._num_runaway >= self.max_runaway:
                raise OverloadedError(
                    f"the grammar compiler is busy with {self._num_runaway} constraints that "
                    f"overran their {self.timeout:g}s limit; retry later"
                )
            if client is not None and self._runaway[client] >= self.max_runaway_per_client:
                raise self._client_overloaded()
            self._queue.append(_CompileJob(future, work, describe, client, overrun_error or _compile_overran(describe)))
            self._wakeup.notify()
        return future

    def _client_overloaded(self) -> OverloadedError:
        return OverloadedError(
            f"{self.max_runaway_per_client} of your constraints are still compiling past the server's "
            f"{self.timeout:g}s limit (--structured-outputs-compile-timeout); retry when they end, "
            "and simplify constraints that overran"
        )

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._wakeup.notify_all()

    def _start_worker(self) -> None:
        self._num_workers += 1
        threading.Thread(target=self._work, name="tokenloom-grammar", daemon=True).start()

    def _next_job(self) -> _CompileJob | None:
        """The first queued job whose client has nothing running (the lock is held)."""
        for index, job in enumerate(self._queue):
            if job.client is None or job.client not in self._busy_clients:
                del self._queue[index]
                if job.client is not None:
                    self._busy_clients.add(job.client)
                return job
        return None

    def _leave_line(self, job: _CompileJob) -> None:
        """``job`` ended or overran (the lock is held): its client's next job may start."""
        if job.client is not None:
            self._busy_clients.discard(job.client)
            self._wakeup.notify_all()

    def _work(self) -> None:
        while True:
            with self._wakeup:
                job = self._next_job()
                while job is None and not self._closed:
                    self._wakeup.wait()
                    job = self._next_job()
                if job is None:
                    self._num_workers -= 1
                    return
            if not job.future.set_running_or_notify_cancel():
                with self._lock:
                    self._leave_line(job)
                continue
            timer = threading.Timer(self.timeout, self._on_timeout, (job,))
            timer.daemon = True
            timer.start()
            result, error = None, None
            _current_job.job = job
            try:
                result = job.work()
            except BaseException as exc:  # handed to whoever waits on the Future
                error = exc
            finally:
                _current_job.job = None
            timer.cancel()
            with self._lock:
                job.finished = True
                if not job.timed_out:
                    self._leave_line(job)
                else:  # already answered, out of its client's line, and a replacement thread runs
                    self._num_runaway -= 1
                    if job.client is not None:
                        self._runaway[job.client] -= 1
                        if not self._runaway[job.client]:
                            del self._runaway[job.client]
                    self._num_workers -= 1
                    logger.warning("a grammar job that overran its limit ended after all: %s", job.describe)
                    return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

    def _on_timeout(self, job: _CompileJob) -> None:
        refused: list[_CompileJob] = []
        with self._lock:
            if job.finished:
                return
            job.timed_out = True
            self._num_runaway += 1
            self._leave_line(job)
            if job.client is not None:
                self._runaway[job.client] += 1
                if self._runaway[job.client] >= self.max_runaway_per_client:
                    # the client has all the runaway jobs it may: its queued ones get the 429 a
                    # new one would (they would only add to its runaways)
                    refused = [queued for queued in self._queue if queued.client == job.client]
                    for queued in refused:
                        self._queue.remove(queued)
            if not self._closed:
                self._start_worker()
        logger.warning("%s overran its %gs limit; its request gets a 400", job.describe, self.timeout)
        job.future.set_exception(job.overrun_error(self.timeout))
        for queued in refused:
            if queued.future.set_running_or_notify_cancel():
                queued.future.set_exception(self._client_overloaded())
