"""What the executors of a ``tp * pp`` grid of workers (``mp``, ``ray``) share:
:class:`WorkerGridExecutor` holds the grid's sizes and output rank, builds every worker's
:class:`~tokenloom.builtin_plugins.executors.worker_host.WorkerLaunch`, and runs the start-up
sequence (load the model, size the KV cache by the smallest worker, allocate it) once the
workers have started, however a subclass reaches them."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from tokenloom.builtin_plugins.executors.worker_host import WorkerLaunch, output_rank
from tokenloom.worker_api import Executor, WorkerSpec, execute_model_timeout

logger = logging.getLogger(__name__)

# how long each start-up phase (workers joining the group, loading weights, sizing and
# allocating the KV cache) may take before the engine gives up
START_TIMEOUT_SECONDS = float(os.environ.get("TOKENLOOM_WORKER_START_TIMEOUT", "900"))


class WorkerGridExecutor(Executor):
    """An executor with one worker per rank of the ``pp_size x tp_size`` grid. Subclasses start
    the workers and answer :meth:`call_workers`; the rest of the start-up is here."""

    backend_name = ""
    """How the log names the executor: its registered name (``mp``, ``ray``)."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        parallel = self.config.parallel
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.world_size = parallel.world_size
        # a step per pipeline stage: while the last stage runs one, the first runs the next
        self.max_concurrent_batches = self.pp_size
        # the rank whose reply is the step's output (the other ranks answer None)
        self.output_rank = output_rank(self.tp_size, self.pp_size)
        self.worker_pids: list[int] = []  # by rank, once the workers have started
        self.execute_timeout = execute_model_timeout()
        """How long a worker may take to answer a step (None: no limit); past it the engine is
        dead, with a reason naming the worker."""

    def worker_launches(self, init_method: str, num_local_workers: Callable[[int], int]) -> list[WorkerLaunch]:
        """Every rank's launch data: the rendezvous ``init_method`` and, for each rank, how many
        workers share its machine (``num_local_workers(rank)``)."""
        distributed_backend = self.spec.platform_class().distributed_backend
        log_level = logging.getLogger("tokenloom").getEffectiveLevel()
        return [
            WorkerLaunch(
                spec=self.spec,
                rank=rank,
                init_method=init_method,
                distributed_backend=distributed_backend,
                num_local_workers=num_local_workers(rank),
                log_level=log_level,
            )
            for rank in range(self.world_size)
        ]

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """``WorkerHost.method(*args)`` on every started worker; their replies in rank order,
        waiting at most :data:`START_TIMEOUT_SECONDS` (then EngineDeadError). A worker's own
        error is raised as it is."""
        raise NotImplementedError

    def load_model_and_allocate_kv_cache(self, started: float) -> int:
        """The start-up after the workers have started (``started``: when :meth:`initialize`
        began, from ``time.perf_counter``).

        :returns: the number of KV-cache blocks every worker allocated: the fewest any worker
            has room for, so that every rank holds the same block table.
        """
        load_times = self.call_workers("load_model")
        num_blocks: int = min(self.call_workers("determine_num_blocks"))
        allocate_times = self.call_workers("allocate_kv_cache", num_blocks)
        logger.info(
            "%s executor ready in %.2fs: tp %d x pp %d workers (pids %s), model loaded in %.2fs (slowest worker), "
            "%d KV blocks on every worker (allocated in %.2fs), step timeout %s",
            self.backend_name,
            time.perf_counter() - started,
            self.tp_size,
            self.pp_size,
            ", ".join(str(pid) for pid in self.worker_pids),
            max(load_times),
            num_blocks,
            max(allocate_times),
            "off" if self.execute_timeout is None else f"{self.execute_timeout:g}s",
        )
        return num_blocks
