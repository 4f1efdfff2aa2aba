"""The ``Executor`` interface: it owns the workers that hold the model and the KV cache.
The core only sends it a :class:`SchedulerOutput` per step and receives sampled tokens.
Implementations (one process, several processes, Ray) are plugins."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.config import EngineConfig
from tokenloom.errors import ConfigError

if TYPE_CHECKING:
    from tokenloom.core.model_loader import ModelInfo
    from tokenloom.core.platform import Platform
    from tokenloom.plugins.manager import PlainPlugins


# how long a worker may take to answer one step (counted for each worker from when it
# answered its previous call, so steps queued behind a running one are not charged for it)
# before the engine is declared dead; tokenloom's name first, then vLLM's
EXECUTE_MODEL_TIMEOUT_ENV = ("TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS", "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS")
# Twice vLLM's 300 s, for slow CPUs: the longest step of a healthy engine is a full
# --max-num-batched-tokens prefill (2048 tokens by default). SmolLM2-135M prefills 256 tokens in
# ~0.14 s on 2 cores, so a 7B model takes about a minute for 2048 of them: 600 s leaves ten times
# that for a busier machine. There is no compile or warm-up step (the model runs eagerly).
DEFAULT_EXECUTE_MODEL_TIMEOUT_SECONDS = 600.0


def execute_model_timeout() -> float | None:
    """The step timeout in seconds from the environment (see :data:`EXECUTE_MODEL_TIMEOUT_ENV`);
    None when it is set to 0 (wait for ever)."""
    for name in EXECUTE_MODEL_TIMEOUT_ENV:
        text = os.environ.get(name, "").strip()
        if not text:
            continue
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0 or seconds == float("inf"):
            raise ConfigError(
                f"{name}={text!r} is not a number of seconds: use a positive number (0 turns the step timeout off)",
                param=name,
            )
        return seconds or None
    return DEFAULT_EXECUTE_MODEL_TIMEOUT_SECONDS


# the shared secret of the control connections between nodes (an engine's workers on other
# nodes, data-parallel replicas on other nodes): both ends prove they hold it before any
# (pickled) message is read
NODE_AUTHKEY_ENV = "TOKENLOOM_NODE_AUTHKEY"


def node_authkey(param: str, environ: dict[str, str] | None = None) -> bytes:
    """The secret :data:`NODE_AUTHKEY_ENV` holds; ConfigError (about ``param``, the flag that
    spans nodes) when it is not set."""
    value = (os.environ if environ is None else environ).get(NODE_AUTHKEY_ENV, "")
    if not value.strip():
        raise ConfigError(
            f"--{param} connects processes on several nodes over TCP: set {NODE_AUTHKEY_ENV} to the same secret on "
            "every node (it authenticates both ends before any message is read)",
            param=param,
        )
    return value.encode()


def wait_for_node_processes(processes: list[Any], what: str) -> int:
    """A ``--headless`` node's main: waits until its started ``processes`` (``what`` they are, for
    the log) end, SIGTERM or Ctrl-C terminating them. The exit code: 0 when they were stopped that
    way or every one ended cleanly, else 1."""
    stopping = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        stopping.set()
        for process in processes:
            if process.is_alive():
                process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for process in processes:
        process.join()
    codes = [process.exitcode for process in processes]
    logging.getLogger(__name__).info("headless: the %s ended (exit codes %s)", what, codes)
    return 0 if stopping.is_set() or all(code == 0 for code in codes) else 1


# what every worker and replica process imports whatever it runs, imported once by the forkserver
WORKER_PRELOAD = ("torch", "transformers")


@functools.cache
def _worker_context() -> Any:
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


def worker_process(target: Callable[..., Any], args: tuple[Any, ...], *, name: str, daemon: bool = False) -> Any:
    """A process (not yet started) that runs ``target(*args)``: a worker of ``-tp``/``-pp``, a
    node's worker, a data-parallel replica. It is forked from this process's forkserver, which
    imported :data:`WORKER_PRELOAD` once, when the first such process started: a spawned process
    imported torch and transformers again each time (about 2 CPU seconds; 0.1 s forked). Not a
    plain fork of this process: torch's thread pools do not survive one.

    A forkserver's children inherit the forkserver's environment, as it was when it started;
    each process here gets this process's environment of the moment it is created instead,
    before ``target`` runs (only what the preloaded modules read when imported stays the
    forkserver's). Its CPU affinity is the forkserver's too: a process that needs other cores
    sets them itself (a replica does)."""
    return _worker_context().Process(
        target=_run_in_environment, args=(dict(os.environ), target, args), name=name, daemon=daemon
    )


def _run_in_environment(environ: dict[str, str], target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def is_stopped(pid: int | None) -> bool:
    """Whether the process ``pid`` on this machine is stopped (``SIGSTOP``, a debugger): what
    tells a worker that hangs from the peers waiting for it in a collective."""
    import psutil

    try:
        return pid is not None and psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is built from, as plain picklable data resolved in the main process:
    the engine config as the user gave it, and what the engine resolved from it."""

    config: EngineConfig
    model_info: ModelInfo
    """The resolved model: files, architecture, context length, vocabulary, runner type."""
    platform: str
    """The device platform plugin chosen (``--device auto`` resolved to a name)."""
    plugin_tables: PlainPlugins
    """The plugin registries as plain data (kind -> name -> ``"module:attr"``), which workers
    import from; workers never run plugin discovery."""
    profile_mm_items: list[Any] = field(default_factory=list)
    """The worst-case media items (``MultiModalItem``) a profile run encodes (empty: none)."""

    def platform_class(self) -> type[Platform]:
        """The chosen platform plugin's class, imported from :attr:`plugin_tables`: what an
        executor reads before any worker constructs the platform (``distributed_backend``)."""
        from tokenloom.plugins.manager import PluginSet

        platform_class: type[Platform] = (
            PluginSet.from_plain(self.plugin_tables).registry("platform").get(self.platform)
        )
        return platform_class


class Executor:
    """Registered with ``register_executors``; constructed once, in the main process, with a
    :class:`WorkerSpec` to ship to the workers it starts."""

    max_concurrent_batches: int = 1
    """How many steps the engine may have in flight at once (:meth:`execute_async` before the
    previous result is back): 1 here; an executor with pipeline stages takes one per stage."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.config = spec.config

    def initialize(self) -> int:
        """Start workers, load the model, size and allocate the KV cache.

        :returns: the number of KV-cache blocks every worker allocated.
        """
        raise NotImplementedError

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers; called by the engine loop, one step at a time."""
        raise NotImplementedError

    def execute_async(self, scheduler_output: SchedulerOutput) -> concurrent.futures.Future[ModelRunnerOutput]:
        """Start one step and return at once with a future of its output, so the engine can
        schedule the next batch while this one runs (up to :attr:`max_concurrent_batches` in
        flight; outputs complete in the order the steps were sent). This default runs
        :meth:`execute` now and returns a done future (its exception, if it raised)."""
        future: concurrent.futures.Future[ModelRunnerOutput] = concurrent.futures.Future()
        try:
            future.set_result(self.execute(scheduler_output))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def prefault_kv_cache(self, max_bytes: int) -> int:
        """Optional: while the engine is idle, make the workers map up to ``max_bytes`` more (at
        least one block) of KV-cache memory that no request has used yet, while less than the
        runner's lead is mapped ahead of use (a lazily zeroed cache otherwise pays a page fault
        per page on a request's critical path). Called on the engine's thread, between steps,
        never concurrently with :meth:`execute`.

        :returns: the bytes mapped; 0 when there is nothing left to do now (the default).
        """
        return 0

    @classmethod
    def run_node(cls, config: EngineConfig, timeout: float) -> int:
        """``tokenloom serve ... --nnodes N --node-rank R --headless``: run this node's share of
        the workers of node 0's engine (``config.parallel.workers_per_node`` of them, ranks
        ``R * per_node`` on) until that engine stops them or goes away; ``timeout``: how long
        they wait for node 0 to answer. Returns the process's exit code. An executor that
        spreads its workers over nodes this way overrides it (the built-in ``mp`` does)."""
        raise ConfigError(
            f"this executor ({cls.__name__}) does not run workers on other nodes: use --distributed-executor-backend mp",
            param="nnodes",
        )

    def check_health(self) -> None:
        """Raise :class:`~tokenloom.errors.EngineDeadError` naming the worker when one has died
        (or stopped answering). Called by the engine on its thread, between steps (also while
        idle, about once a second) and after a step failed; cheap: no round trip per call."""

    def shutdown(self) -> None:
        """Stop the workers and free their memory; idempotent."""
