"""The communicators of :mod:`tokenloom.core.distributed`, in real worker processes over gloo."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from helpers.rank_processes import run_ranks

from tokenloom.core.distributed import Communicator, ParallelRank, ParallelState, init_parallel_state


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ranks_are_laid_out_stage_major():
    places = [ParallelRank.of(rank, tp_size=2, pp_size=3) for rank in range(6)]
    assert [(p.pp_rank, p.tp_rank) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [p.rank for p in places] == list(range(6))
    assert places[0].is_first_stage and not places[0].is_last_stage and places[5].is_last_stage


def test_one_worker_collectives_are_identities():
    state = ParallelState.single()
    x = torch.arange(4.0)
    assert state.tp.all_reduce(x) is x and state.tp.all_gather(x) is x
    assert state.pp.broadcast_object({"a": 1}) == {"a": 1}
    with pytest.raises(RuntimeError, match="nobody"):
        Communicator().send(x, 1)


def _worker(rank: int, tp_size: int, pp_size: int, init_method: str, results) -> None:
    torch.set_num_threads(1)
    state = init_parallel_state(ParallelRank.of(rank, tp_size, pp_size), init_method, "gloo")
    out = {}
    out["sum"] = state.tp.all_reduce(torch.full((3,), float(rank + 1))).tolist()
    out["gather"] = state.tp.all_gather(torch.tensor([[float(rank)]]), dim=-1).tolist()
    out["object"] = state.pp.broadcast_object({"from": rank}, src=0)
    if state.pp.size > 1:
        if state.place.is_first_stage:
            state.pp.send(torch.tensor([rank * 10.0, 1.0]), dst=1)
        else:
            out["recv"] = state.pp.recv((2,), torch.float32, src=0).tolist()
    results[rank] = out
    torch.distributed.destroy_process_group()


def test_tensor_and_pipeline_groups_over_gloo():
    """A 2 x 2 grid: TP groups {0,1} and {2,3} sum and gather; PP groups {0,2} and {1,3}
    broadcast from stage 0 and pass a tensor from stage 0 to stage 1."""
    results = mp.Manager().dict()
    run_ranks(_worker, (2, 2, f"tcp://127.0.0.1:{free_port()}", results), nprocs=4)
    assert results[0]["sum"] == results[1]["sum"] == [3.0] * 3
    assert results[2]["sum"] == results[3]["sum"] == [7.0] * 3
    assert results[0]["gather"] == [[0.0, 1.0]] and results[3]["gather"] == [[2.0, 3.0]]
    assert results[2]["object"] == {"from": 0} and results[3]["object"] == {"from": 1}
    assert results[2]["recv"] == [0.0, 1.0] and results[3]["recv"] == [10.0, 1.0]
