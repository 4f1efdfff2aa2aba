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
    """Data-parallel replicas to run on this node; unset: all of them under ``mp``, wherever Ray
    places them under ``ray``. The rest run on other nodes: of the Ray cluster under ``ray``;
    under ``mp``, started there by ``tokenloom serve --headless`` (which connect to this node's
    --data-parallel-address), or behind their own API servers with --data-parallel-hybrid-lb."""
    data_parallel_backend: str = "mp"
    """Where data-parallel replicas run: ``mp`` (one process each on this machine) or ``ray``
    (one Ray actor each, on the cluster ``RAY_ADDRESS`` names or a local Ray)."""
    data_parallel_rank: int = 0
    """This engine's rank among the data-parallel replicas (``-dp`` sets it per replica): its
    KV-cache event batches carry it, and its event endpoints' ports are offset by it. Given on
    the command line (--data-parallel-rank), this server is that one replica of ``-dp`` behind an
    external load balancer."""
    data_parallel_external_lb: bool = False
    """This server runs one replica (--data-parallel-rank) and an external load balancer spreads
    requests over the ``-dp`` servers (set when --data-parallel-rank is given)."""
    data_parallel_hybrid_lb: bool = False
    """This node's API server balances over its own replicas (ranks --data-parallel-start-rank
    on, --data-parallel-size-local of them); an external load balancer spreads requests over
    the nodes."""
    data_parallel_start_rank: int = 0
    """The rank of this node's first replica (a secondary node's, with --headless or
    --data-parallel-hybrid-lb)."""
    data_parallel_address: str | None = None
    """The head node's address: where it listens for the replicas of --headless nodes, and
    where they connect."""
    data_parallel_rpc_port: int = 29550
    """The head node's port for the replicas of --headless nodes (vLLM's default)."""
    nnodes: int = 1
    """Nodes one engine's ``tp * pp`` workers span under ``mp``: each node runs
    ``tp * pp / nnodes`` of them; node 0 runs the engine and the API server, the others run
    ``tokenloom serve MODEL ... --node-rank R --headless``."""
    node_rank: int = 0
    """This node's place among --nnodes: it runs workers ``node_rank * per_node`` on."""
    master_addr: str = "127.0.0.1"
    """Node 0's address, where every worker meets: ``torch.distributed``'s rendezvous on
    --master-port, and node 0's engine listening for the other nodes' workers on the port after it."""
    master_port: int = 29501
    """Node 0's rendezvous port (vLLM's default); the port after it carries the engine's calls to
    the workers on other nodes."""
    distributed_executor_backend: str | None = None
    """Executor plugin that owns the workers: ``uni`` (one worker in the engine's process),
    ``mp`` (worker processes on this machine) or ``ray`` (Ray actors, across machines); by
    default ``mp`` when ``tp * pp > 1``, else ``uni``."""

    @property
    def world_size(self) -> int:
        """Workers of one engine: ``tp * pp``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def workers_per_node(self) -> int:
        """Workers of one engine on each of its --nnodes nodes."""
        return self.world_size // max(1, self.nnodes)

    @property
    def worker_control_port(self) -> int:
        """Node 0's port for the engine's calls to the workers of the other nodes."""
        return self.master_port + 1


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


def validate_nodes(parallel: ParallelConfig) -> None:
    """``--nnodes``/``--node-rank``/``--master-addr``/``--master-port`` (one engine's workers
    across nodes without Ray) fit the worker grid and the other parallel flags."""

    def bad(flag: str, message: str) -> None:
        raise ConfigError(f"--{flag}: {message}", param=flag)

    nnodes, node_rank, port = parallel.nnodes, parallel.node_rank, parallel.master_port
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
        bad("nnodes", f"must be a whole number of at least 1, got {nnodes!r}")
    if not isinstance(node_rank, int) or isinstance(node_rank, bool) or not 0 <= node_rank < nnodes:
        bad("node-rank", f"must be between 0 and --nnodes - 1 ({nnodes - 1}), got {node_rank!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65535:
        bad("master-port", f"must be a TCP port (1-65534; the port after it is used too), got {port!r}")
    if nnodes == 1:
        return
    if parallel.world_size % nnodes:
        bad(
            "nnodes",
            f"-tp {parallel.tensor_parallel_size} -pp {parallel.pipeline_parallel_size} makes "
            f"{parallel.world_size} workers, which {nnodes} nodes cannot share equally: choose sizes whose "
            "product is a multiple of --nnodes",
        )
    if parallel.distributed_executor_backend not in (None, "mp"):
        bad(
            "nnodes",
            f"spreads the mp executor's workers over nodes, not {parallel.distributed_executor_backend}'s "
            "(with ray, the Ray cluster places the workers: leave out --nnodes)",
        )
    if parallel.data_parallel_size > 1:
        bad("nnodes", "spreads one engine's workers over nodes: it does not combine with -dp here")


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
    rank = parallel.data_parallel_rank
    if parallel.data_parallel_external_lb:
        if not is_int(rank) or not 0 <= rank < size:
            bad("data-parallel-rank", f"must be between 0 and --data-parallel-size - 1 ({size - 1}), got {rank!r}")
        if parallel.data_parallel_hybrid_lb or parallel.data_parallel_size_local is not None:
            bad(
                "data-parallel-rank",
                "runs one replica behind an external load balancer: leave out --data-parallel-hybrid-lb and "
                "--data-parallel-size-local (a node with several replicas uses those with --data-parallel-start-rank)",
            )
        return
    start = parallel.data_parallel_start_rank
    if not is_int(start) or not 0 <= start < size:
        bad("data-parallel-start-rank", f"must be between 0 and --data-parallel-size - 1 ({size - 1}), got {start!r}")
    port = parallel.data_parallel_rpc_port
    if not is_int(port) or not 0 < port < 65536:
        bad("data-parallel-rpc-port", f"must be a TCP port (1-65535), got {port!r}")
    local = parallel.data_parallel_size_local
    if local is None:
        if start or parallel.data_parallel_hybrid_lb:
            bad(
                "data-parallel-size-local" if parallel.data_parallel_hybrid_lb else "data-parallel-start-rank",
                "a node that runs part of the replicas says how many with --data-parallel-size-local",
            )
        return
    if not is_int(local) or not 0 <= local <= size - start:
        bad(
            "data-parallel-size-local",
            f"must be between 0 and --data-parallel-size - --data-parallel-start-rank ({size - start}), got {local!r}",
        )
    if parallel.data_parallel_backend == "ray":
        if start or parallel.data_parallel_hybrid_lb:
            bad(
                "data-parallel-backend",
                "ray places every replica from the head node: leave out --data-parallel-start-rank and --data-parallel-hybrid-lb",
            )
        return
    if parallel.data_parallel_hybrid_lb:
        if local < 1:
            bad("data-parallel-size-local", "a --data-parallel-hybrid-lb node runs at least one replica")
        return
    if local != size and not parallel.data_parallel_address:
        # the mp backend starts the others with `tokenloom serve --headless` on their nodes
        bad(
            "data-parallel-address",
            f"{local} of {size} replicas on this node: the others run on other nodes, started there by "
            "`tokenloom serve MODEL --headless -dp N -dpl L -dpr START -dpa HEAD`, and need the address of the "
            "head node to connect to (with --data-parallel-backend ray, Ray places them instead)",
        )
