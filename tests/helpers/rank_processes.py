"""The suite's own multi-rank runs (``fn(rank, *args)`` in ``nprocs`` processes, as
``torch.multiprocessing.spawn``), started as tokenloom starts its workers: forked from a
forkserver that imported torch and transformers once (tokenloom/core/executor.py), not spawned,
so each rank does not import them again."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing

from tokenloom.core.executor import WORKER_PRELOAD


def run_ranks(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` for every rank below ``nprocs``, each in its own process; returns
    once all have ended, raising the first rank's error."""
    multiprocessing.set_forkserver_preload(list(WORKER_PRELOAD))
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
