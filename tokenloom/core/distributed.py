"""Where a worker sits among an engine's workers (:class:`ParallelRank`) and how it talks to
the others (:class:`Communicator`): the collectives tensor and pipeline parallelism need.

Workers form a ``pp_size x tp_size`` grid; global rank ``pp_rank * tp_size + tp_rank``. Each
worker holds one communicator for its tensor-parallel group (the ranks of its pipeline stage)
and one for its pipeline group (the ranks with its ``tp_rank``, one per stage). A single
process uses :class:`Communicator` itself, whose collectives are identities; executors that
start several workers build :class:`TorchDistributedCommunicator` from ``torch.distributed``
with the backend the platform names (``Platform.distributed_backend``: gloo on the CPU).
Workers or replicas on a Ray cluster import Ray through :func:`import_ray`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.errors import ConfigError


@dataclass(frozen=True)
class ParallelRank:
    """One worker's place in the ``pp_size x tp_size`` grid (plain data, shipped to workers)."""

    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int) -> ParallelRank:
        """The place of global ``rank``."""
        return cls(tp_size=tp_size, pp_size=pp_size, tp_rank=rank % tp_size, pp_rank=rank // tp_size)


class Communicator:
    """Collectives inside one group of workers. This base class is the group of one worker
    (every collective is the identity); ``rank`` is the worker's index inside the group."""

    size: int = 1
    rank: int = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over the group; may reuse ``tensor``'s storage."""
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order."""
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to group rank ``dst`` (blocking)."""
        raise RuntimeError("a group of one worker has nobody to send to")

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a tensor of ``shape``/``dtype`` from group rank ``src`` (blocking)."""
        raise RuntimeError("a group of one worker has nobody to receive from")

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as group rank ``src`` has it (picklable plain data)."""
        return obj


class TorchDistributedCommunicator(Communicator):
    """A group of ``torch.distributed`` (its default process group must be initialised)."""

    def __init__(self, ranks: list[int]):
        import torch.distributed as dist

        self._dist = dist
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        # every process must create every group, in the same order (torch.distributed's rule)
        self.group = dist.new_group(self.ranks)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self._dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._dist.send(tensor.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self._dist.recv(tensor, src=self.ranks[src], group=self.group)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]


@dataclass
class ParallelState:
    """What a worker's model is built with: its place and its two groups."""

    place: ParallelRank
    tp: Communicator
    pp: Communicator

    @classmethod
    def single(cls) -> ParallelState:
        return cls(place=ParallelRank(), tp=Communicator(), pp=Communicator())


def init_parallel_state(place: ParallelRank, init_method: str, backend: str) -> ParallelState:
    """Join the engine's ``torch.distributed`` world (``init_method``: e.g. ``tcp://host:port``)
    and build this worker's groups. Called once per worker process, by every worker."""
    import torch.distributed as dist

    if place.world_size == 1:
        return ParallelState.single()
    dist.init_process_group(backend=backend, init_method=init_method, rank=place.rank, world_size=place.world_size)
    tp_groups = [[pp * place.tp_size + tp for tp in range(place.tp_size)] for pp in range(place.pp_size)]
    pp_groups = [[pp * place.tp_size + tp for pp in range(place.pp_size)] for tp in range(place.tp_size)]
    # every process creates every group, in the same order (new_group is collective)
    tp_comm = [_group(ranks, place.rank) for ranks in tp_groups][place.pp_rank]
    pp_comm = [_group(ranks, place.rank) for ranks in pp_groups][place.tp_rank]
    assert tp_comm is not None and pp_comm is not None
    return ParallelState(place=place, tp=tp_comm, pp=pp_comm)


def _group(ranks: list[int], rank: int) -> TorchDistributedCommunicator | None:
    """The communicator of ``ranks`` when ``rank`` is one of them; otherwise take part in
    creating that group (``new_group`` is collective) and return None."""
    import torch.distributed as dist

    if rank in ranks:
        return TorchDistributedCommunicator(ranks)
    dist.new_group(ranks)
    return None


def import_ray(flag: str) -> Any:
    """The ``ray`` module, imported when ``--FLAG ray`` chose it (the ``ray`` extra is optional);
    without it a ConfigError that names the flag and the install."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"--{flag} ray needs Ray, which is not installed ({exc}): pip install 'tokenloom[ray]' "
            f"(or pip install ray), or use --{flag} mp",
            param=flag,
        ) from None
    return ray
