"""``ParallelConfig``: tensor, pipeline and data parallelism and the executor that owns the
workers; the checks that the sizes and backends fit together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.errors import ConfigError


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Number of tensor-parallel ranks (one worker process each)."""
    pipeline_parallel_size: int = 1
    """Number of pipeline stages (one worker process per stage and tensor-parallel rank)."""
    data_parallel_size: int = 1
    """Number of data-parallel replicas: full engines (each with its own scheduler, executor
    and KV cache) behind one API server, requests balanced by load."""
    data_parallel_size_local: int | None = None
    """Data-parallel replicas to run on this node (the rest on other nodes of the Ray cluster,
    ``--data-parallel-backend ray`` only); unset: all of them under ``mp``, wherever Ray places
    them under ``ray``."""
    data_parallel_backend: str = "mp"
    """Where data-parallel replicas run: ``mp`` (one process each on this machine) or ``ray``
    (one Ray actor each, on the cluster ``RAY_ADDRESS`` names or a local Ray)."""
    data_parallel_rank: int = 0
    """This engine's rank among the data-parallel replicas (``-dp`` sets it per replica): its
    KV-cache event batches carry it, and its event endpoints' ports are offset by it."""
    distributed_executor_backend: str | None = None
    """Executor plugin that owns the workers: ``uni`` (one worker in the engine's process),
    ``mp`` (worker processes on this machine) or ``ray`` (Ray actors, across machines); by
    default ``mp`` when ``tp * pp > 1``, else ``uni``."""

    @property
    def world_size(self) -> int:
        """Workers of one engine: ``tp * pp``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def check_worker_grid(parallel: ParallelConfig) -> None:
    """``-tp``/``-pp`` are positive, and the executor named can hold ``tp * pp`` workers."""
    for flag, size in (
        ("tensor-parallel-size", parallel.tensor_parallel_size),
        ("pipeline-parallel-size", parallel.pipeline_parallel_size),
    ):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"--{flag}: must be a whole number of at least 1, got {size!r}", param=flag)
    if parallel.distributed_executor_backend == "uni" and parallel.world_size > 1:
        raise ConfigError(
            f"--distributed-executor-backend uni runs one worker in the engine's process, but "
            f"-tp {parallel.tensor_parallel_size} -pp {parallel.pipeline_parallel_size} needs "
            f"{parallel.world_size} workers: use mp (worker processes on this machine, the default) or ray",
            param="distributed-executor-backend",
        )


DATA_PARALLEL_BACKENDS = ("mp", "ray")


def validate_data_parallel(parallel: ParallelConfig) -> None:
    """``-dp``, ``--data-parallel-size-local`` and ``--data-parallel-backend`` make sense together."""

    def bad(flag: str, message: str) -> None:
        raise ConfigError(f"--{flag}: {message}", param=flag)

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    size = parallel.data_parallel_size
    if not is_int(size) or size < 1:
        bad("data-parallel-size", f"must be a whole number of at least 1, got {size!r}")
    if parallel.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
        bad(
            "data-parallel-backend",
            f"must be one of {', '.join(DATA_PARALLEL_BACKENDS)}, got {parallel.data_parallel_backend!r}",
        )
    local = parallel.data_parallel_size_local
    if local is None:
        return
    if not is_int(local) or not 0 <= local <= size:
        bad("data-parallel-size-local", f"must be between 0 and --data-parallel-size ({size}), got {local!r}")
    if local != size and parallel.data_parallel_backend != "ray":
        # replicas on other machines need something that starts them there: Ray does
        bad(
            "data-parallel-size-local",
            f"{local} of {size} replicas on this node needs --data-parallel-backend ray (the mp backend "
            "starts every replica on this machine); leave it unset or equal to --data-parallel-size",
        )
