"""The ``ray`` executor: the ``tp * pp`` workers as Ray actors, one per bundle of a placement
group, on the Ray cluster ``RAY_ADDRESS`` names (any of its machines) or on a local Ray started
for the engine (and stopped with it). Rank 0's node hosts the ``torch.distributed`` rendezvous.

A worker that does not answer a step within the step timeout
(``TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS``) kills the engine, as a dead actor does.

``TOKENLOOM_RAY_PLACEMENT_STRATEGY`` chooses how bundles spread: ``PACK`` (the default, as few
nodes as possible), ``SPREAD``, ``STRICT_PACK`` (one node) or ``STRICT_SPREAD`` (one per node).
Needs the ``ray`` extra: ``pip install tokenloom[ray]``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections import Counter
from typing import Any

from tokenloom.builtin_plugins.executors.worker_grid import (
    START_TIMEOUT_SECONDS,
    WorkerGridExecutor,
)
from tokenloom.builtin_plugins.executors.worker_host import WorkerHost, WorkerLaunch, free_port
from tokenloom.errors import ConfigError, EngineDeadError
from tokenloom.worker_api import EXECUTE_MODEL_TIMEOUT_ENV, ModelRunnerOutput, SchedulerOutput, WorkerSpec, import_ray

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# how long the placement group may wait for its bundles
PLACEMENT_TIMEOUT_SECONDS = float(os.environ.get("TOKENLOOM_RAY_PLACEMENT_TIMEOUT", "120"))
# how often, at most, a wait for the workers looks for a dead actor or a call past its timeout
WATCH_INTERVAL_SECONDS = 1.0


class RayWorker:
    """The actor: a :class:`WorkerHost` built once the rendezvous address is known. Its
    default concurrency group runs one call at a time, in call order, on one thread (torch
    keeps a thread pool per calling thread); ``wait_for_stop`` waits on its own thread so the
    driver notices a dead actor without a round trip per check."""

    def __init__(self) -> None:
        import threading

        self.host: WorkerHost | None = None
        self._stopped = threading.Event()

    def node_and_port(self) -> tuple[str, str, int]:
        import ray

        ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        return ray.get_runtime_context().get_node_id(), ip, free_port(ip)

    def start(self, launch: WorkerLaunch) -> int:
        from tokenloom.builtin_plugins.executors.worker_host import configure_worker_logging

        configure_worker_logging(launch.rank, launch.log_level)
        self.host = WorkerHost(launch)
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        """``WorkerHost.method(*args)``, as an ``mp`` worker process answers a call (Ray hands
        ``args`` over with any object reference among them resolved)."""
        if self.host is None:
            raise RuntimeError(f"ray worker: {method} called before start")
        return getattr(self.host, method)(*args)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None
        self._stopped.set()

    def wait_for_stop(self) -> None:
        self._stopped.wait()


class RayExecutor(WorkerGridExecutor):
    """``tp * pp`` Ray actors placed by a placement group (one CPU bundle each)."""

    backend_name = "ray"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.actors: list[Any] = []
        self.worker_node_ids: list[str] = []
        self._placement_group: Any = None
        self._started_ray = False
        self._watch_refs: list[Any] = []
        self._dead_reason: str | None = None
        # results are collected in send order on one thread: steps in flight finish FIFO
        self._collector: concurrent.futures.ThreadPoolExecutor | None = None
        # when the last call's replies were all in: the actors run calls in order, so the next
        # call is due from then (or from when it was sent, if later)
        self._last_collected = 0.0
        self._ray: Any = None

    # -- start-up -------------------------------------------------------------------------

    def _connect(self) -> Any:
        ray = import_ray("distributed-executor-backend")
        if ray.is_initialized():
            return ray
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=True)
            logger.info("ray executor: connected to the Ray cluster at %s", address)
        else:
            # a local Ray for this engine; its CPUs are logical: the workers share the cores
            # (the CPU platform gives each its share of threads), so tp * pp bundles always fit
            num_cpus = max(self.world_size, os.cpu_count() or 1)
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
            logger.info("ray executor: started a local Ray with %d CPUs (set RAY_ADDRESS to use a cluster)", num_cpus)
        self._started_ray = True
        return ray

    def initialize(self) -> int:
        started = time.perf_counter()
        strategy = os.environ.get("TOKENLOOM_RAY_PLACEMENT_STRATEGY", "PACK").upper()
        if strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"TOKENLOOM_RAY_PLACEMENT_STRATEGY={strategy!r} is no Ray placement strategy: "
                f"use one of {', '.join(PLACEMENT_STRATEGIES)}",
                param="distributed-executor-backend",
            )
        ray = self._ray = self._connect()
        try:
            return self._start_workers(ray, strategy, started)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, ray: Any, strategy: str, started: float) -> int:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._placement_group = placement_group([{"CPU": 1}] * self.world_size, strategy=strategy)
        ready, _ = ray.wait([self._placement_group.ready()], timeout=PLACEMENT_TIMEOUT_SECONDS)
        if not ready:
            raise EngineDeadError(
                f"ray executor: the cluster could not place {self.world_size} workers (1 CPU each, "
                f"strategy {strategy}) within {PLACEMENT_TIMEOUT_SECONDS:.0f}s; it has "
                f"{ray.available_resources().get('CPU', 0):g} CPUs free on {len(ray.nodes())} node(s)"
            )
        actor_class = ray.remote(num_cpus=1, concurrency_groups={"watch": 1})(RayWorker)
        self.actors = [
            actor_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement_group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(self.world_size)
        ]
        places = ray.get([actor.node_and_port.remote() for actor in self.actors], timeout=START_TIMEOUT_SECONDS)
        self.worker_node_ids = [node_id for node_id, _, _ in places]
        _, rank0_ip, rank0_port = places[0]
        per_node = Counter(self.worker_node_ids)
        launches = self.worker_launches(
            f"tcp://{rank0_ip}:{rank0_port}", lambda rank: per_node[self.worker_node_ids[rank]]
        )
        self.worker_pids = self._get([actor.start.remote(launch) for actor, launch in zip(self.actors, launches)])
        self._watch_refs = [actor.wait_for_stop.options(concurrency_group="watch").remote() for actor in self.actors]
        logger.info(
            "ray executor: %d workers started in %.2fs on %d node(s) (rendezvous %s:%d)",
            self.world_size,
            time.perf_counter() - started,
            len(per_node),
            rank0_ip,
            rank0_port,
        )
        num_blocks = self.load_model_and_allocate_kv_cache(started)
        self._collector = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenloom-ray-results")
        return num_blocks

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        return self._get([actor.call.remote(method, *args) for actor in self.actors])

    def _get(self, refs: list[Any], timeout: float | None = START_TIMEOUT_SECONDS) -> list[Any]:
        if self._ray is None:
            raise EngineDeadError("the ray executor is shut down")
        try:
            return list(self._ray.get(refs, timeout=timeout))
        except self._ray.exceptions.GetTimeoutError:
            raise EngineDeadError(
                f"ray executor: the workers did not answer within {timeout:.0f}s "
                "(TOKENLOOM_WORKER_START_TIMEOUT sets the start-up limit)"
            ) from None
        except self._ray.exceptions.RayTaskError as exc:
            # the worker's own exception (e.g. a model that does not load), not Ray's wrapper
            cause = exc.as_instanceof_cause() if hasattr(exc, "as_instanceof_cause") else exc
            raise cause from None
        except self._ray.exceptions.RayActorError as exc:
            self._dead_reason = f"Ray worker actor died: {exc}"
            raise EngineDeadError(f"the engine's {self._dead_reason}") from None

    # -- steps ----------------------------------------------------------------------------

    def execute_async(self, scheduler_output: SchedulerOutput) -> concurrent.futures.Future[ModelRunnerOutput]:
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine's {self._dead_reason}")
        if self._collector is None:
            raise EngineDeadError("the ray executor is not initialized (or was shut down)")
        # one object in the store that every actor reads, not a copy per call
        step_ref = self._ray.put(scheduler_output)
        refs = [actor.call.remote("execute", step_ref) for actor in self.actors]
        return self._collector.submit(self._collect_step, refs, time.monotonic())

    def _collect_step(self, refs: list[Any], sent_at: float) -> ModelRunnerOutput:
        """The output rank's result, once every worker has answered (see :meth:`_collect`)."""
        output: ModelRunnerOutput = self._collect(refs, "execute", sent_at)[self.output_rank]
        return output

    def _collect(self, refs: list[Any], method: str, sent_at: float) -> list[Any]:
        """Every worker's reply to one call (``refs`` by rank, sent at ``sent_at``). A worker's
        error or death is raised as soon as it shows, not after the others: once the model is
        split, the survivors of a dead worker wait for it forever inside their collectives. So
        is a worker that has not answered within the step timeout (see :meth:`_timed_out`)."""
        due_since = max(sent_at, self._last_collected)
        pending = list(refs)
        while pending:
            if self._ray is None:
                raise EngineDeadError("the ray executor is shut down")
            wait = WATCH_INTERVAL_SECONDS
            if self.execute_timeout is not None:
                left = due_since + self.execute_timeout - time.monotonic()
                if left <= 0:
                    self._timed_out(refs, pending, method)
                wait = min(wait, left)
            done, pending = self._ray.wait(pending, num_returns=len(pending), timeout=wait)
            self._get(done, timeout=None)  # raises the worker's error, or EngineDeadError
            if pending:
                self.check_health()
        self._last_collected = time.monotonic()
        return self._get(refs, timeout=None)

    def _timed_out(self, refs: list[Any], pending: list[Any], method: str) -> None:
        """Declare the engine dead, naming the workers that have not answered ``method`` (hung,
        stopped, or waiting in a collective for one that is), and kill every actor: the engine
        cannot use them again, and a stopped actor would outlive it. Raises EngineDeadError."""
        workers = " and ".join(
            f"Ray worker {rank} (pid {self.worker_pids[rank]})" for rank, ref in enumerate(refs) if ref in pending
        )
        self._dead_reason = (
            f"{workers} did not answer {method} within {self.execute_timeout:g}s "
            f"({EXECUTE_MODEL_TIMEOUT_ENV[0]} sets the limit)"
        )
        logger.error("ray executor: %s; the engine cannot continue", self._dead_reason)
        for actor in self.actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:
                pass
        raise EngineDeadError(f"the engine's {self._dead_reason}")

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(scheduler_output).result()

    def prefault_kv_cache(self, max_bytes: int) -> int:
        if not self.actors:
            return 0
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine's {self._dead_reason}")
        refs = [actor.call.remote("prefault_kv_cache", max_bytes) for actor in self.actors]
        mapped: int = min(self._collect(refs, "prefault_kv_cache", time.monotonic()))
        return mapped

    def check_health(self) -> None:
        if self._dead_reason is None and self._watch_refs:
            # a watch call finishes only when its actor stops: finished means it died
            done, _ = self._ray.wait(self._watch_refs, num_returns=1, timeout=0)
            if done:
                rank = self._watch_refs.index(done[0])
                try:
                    self._ray.get(done[0])
                    cause = "stopped"
                except Exception as exc:
                    cause = f"died ({type(exc).__name__})"
                self._dead_reason = f"Ray worker {rank} (pid {self.worker_pids[rank]}) {cause}"
                logger.error("ray executor: %s; the engine cannot continue", self._dead_reason)
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine's {self._dead_reason}")

    # -- stopping -------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the actors, remove the placement group, and stop Ray if this engine started it."""
        ray = self._ray
        if ray is None:
            return
        self._ray = None
        if self._collector is not None:
            self._collector.shutdown(wait=False, cancel_futures=True)
            self._collector = None
        if self.actors and self._dead_reason is None:
            try:  # leave the torch.distributed group cleanly first
                ray.wait([actor.close.remote() for actor in self.actors], num_returns=len(self.actors), timeout=5)
            except Exception:
                pass
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []
        self._watch_refs = []
        if self._placement_group is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._placement_group)
            except Exception:
                pass
            self._placement_group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
