"""What runs inside one worker process (``mp``) or Ray actor (``ray``): :class:`WorkerHost`
joins the engine's ``torch.distributed`` world, builds the :class:`~tokenloom.worker_api.Worker`
and answers the executor's calls, timing each start-up phase in the log as ``uni`` does."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from tokenloom.worker_api import ModelRunnerOutput, ParallelRank, SchedulerOutput, WorkerSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLaunch:
    """Plain data one worker starts from (pickled into its process or actor)."""

    spec: WorkerSpec
    rank: int
    init_method: str
    """``tcp://host:port`` of the rendezvous (rank 0's node)."""
    distributed_backend: str
    """``Platform.distributed_backend`` of the engine's platform (gloo on the CPU)."""
    num_local_workers: int = 1
    """Workers on this worker's machine: they share its cores."""
    log_level: int = logging.INFO

    @property
    def place(self) -> ParallelRank:
        parallel = self.spec.config.parallel
        return ParallelRank.of(self.rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)


def output_rank(tp_size: int, pp_size: int) -> int:
    """The global rank whose ModelRunnerOutput the engine receives: the last stage's tp-rank 0."""
    return (pp_size - 1) * tp_size


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def configure_worker_logging(rank: int, level: int) -> None:
    """A worker process starts with no logging set up: its records go to stderr (the server's
    log), each line naming the worker."""
    root = logging.getLogger()
    if root.handlers:  # set up already (e.g. by a script's top level, which spawn re-runs)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s [worker {rank} pid {os.getpid()}] %(name)s: %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(level)


class WorkerHost:
    """One worker and the calls the executors make on it. Every worker receives every call;
    :meth:`execute` returns the step's output only on the output rank (None elsewhere)."""

    def __init__(self, launch: WorkerLaunch):
        from tokenloom.worker_api import Worker, init_parallel_state

        started = time.perf_counter()
        self.launch = launch
        self.rank = launch.rank
        place = launch.place
        self.is_output_rank = self.rank == output_rank(place.tp_size, place.pp_size)
        self.parallel = init_parallel_state(place, launch.init_method, launch.distributed_backend)
        joined = time.perf_counter()
        self.worker = Worker(launch.spec, self.parallel, num_local_workers=launch.num_local_workers)
        logger.info(
            "worker %d (tp rank %d, pp rank %d) started in %.2fs: joined the %d-worker group in %.2fs",
            self.rank,
            place.tp_rank,
            place.pp_rank,
            time.perf_counter() - started,
            place.world_size,
            joined - started,
        )

    def pid(self) -> int:
        return os.getpid()

    def load_model(self) -> float:
        started = time.perf_counter()
        self.worker.load_model()
        elapsed = time.perf_counter() - started
        logger.info("worker %d: model loaded in %.2fs", self.rank, elapsed)
        return elapsed

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> float:
        started = time.perf_counter()
        self.worker.allocate_kv_cache(num_blocks)
        elapsed = time.perf_counter() - started
        logger.info("worker %d: KV cache of %d blocks allocated in %.2fs", self.rank, num_blocks, elapsed)
        return elapsed

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.worker.execute(scheduler_output)
        return output if self.is_output_rank else None

    def prefault_kv_cache(self, max_bytes: int) -> int:
        return int(self.worker.runner.prefault_kv_cache(max_bytes))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def describe_exit(exitcode: Any) -> str:
    """``exit code 1`` / ``killed by SIGKILL`` for a process's exit code."""
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
