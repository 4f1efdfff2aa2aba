"""Data parallelism across nodes without Ray, as vLLM runs it: the head node's server with
part of the replicas and `tokenloom serve --headless` on another "node" (a separate process
group on this machine) whose replica connects to the head over authenticated TCP; external load
balancing (--data-parallel-rank: one replica per server) and hybrid (--data-parallel-hybrid-lb:
a server per node over its own replicas); the flags checked together."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from tests.core.engine.test_data_parallel import collect, running_long_requests
from tests.e2e.conftest import REPO_ROOT, free_port
from tokenloom.core.config import EngineArgs
from tokenloom.core.engine import build_engine_client
from tokenloom.core.engine.data_parallel import DataParallelAsyncLLM
from tokenloom.core.engine.remote_replicas import Hello, ReplicaListener
from tokenloom.core.engine.replica_handles import mp_replica_ranks, single_replica_rank
from tokenloom.core.executor import NODE_AUTHKEY_ENV
from tokenloom.errors import ConfigError, EngineDeadError

SECRET = "multinode-test-secret"


def parallel_of(**args):
    return EngineArgs(**args).create_engine_config().parallel


# -- where the replicas run ------------------------------------------------------------------------


def test_the_head_starts_its_share_and_waits_for_the_rest():
    head = parallel_of(data_parallel_size=4, data_parallel_size_local=1, data_parallel_address="10.0.0.1")
    assert mp_replica_ranks(head) == ([0], [1, 2, 3])
    assert single_replica_rank(head) is None
    everything_here = parallel_of(data_parallel_size=3)
    assert mp_replica_ranks(everything_here) == ([0, 1, 2], [])


def test_a_hybrid_node_balances_over_its_own_replicas_only():
    node = parallel_of(
        data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, data_parallel_hybrid_lb=True
    )
    assert mp_replica_ranks(node) == ([2, 3], [])
    assert single_replica_rank(node) is None
    one_replica = parallel_of(
        data_parallel_size=4, data_parallel_size_local=1, data_parallel_start_rank=3, data_parallel_hybrid_lb=True
    )
    assert single_replica_rank(one_replica) == 3


def test_a_rank_given_is_one_replica_behind_an_external_load_balancer():
    from tokenloom.api.serve_args import parse_serve_args

    serve_args = parse_serve_args(["m", "-dp", "2", "--data-parallel-rank", "1"], {})
    parallel = serve_args.engine_args.create_engine_config().parallel
    assert parallel.data_parallel_external_lb and single_replica_rank(parallel) == 1
    with pytest.raises(
        ConfigError, match=r"^--data-parallel-rank: must be between 0 and --data-parallel-size - 1 \(1\), got 2"
    ):
        parse_serve_args(["m", "-dp", "2", "--data-parallel-rank", "2"], {})


def test_the_multinode_flags_are_checked_together():
    from tokenloom.api.serve_args import parse_serve_args

    with pytest.raises(
        ConfigError, match=r"^--data-parallel-address: 1 of 2 replicas on this node: the others .*--headless"
    ):
        EngineArgs(data_parallel_size=2, data_parallel_size_local=1).create_engine_config()
    with pytest.raises(
        ConfigError,
        match="^--data-parallel-start-rank: a node that runs part of the replicas says how many with --data-parallel-size-local",
    ):
        EngineArgs(data_parallel_size=2, data_parallel_start_rank=1).create_engine_config()
    with pytest.raises(ConfigError, match=r"^--data-parallel-size-local: must be between 0 and .* \(1\), got 2"):
        EngineArgs(data_parallel_size=2, data_parallel_size_local=2, data_parallel_start_rank=1).create_engine_config()
    with pytest.raises(ConfigError, match="^--data-parallel-rpc-port: must be a TCP port"):
        EngineArgs(data_parallel_size=2, data_parallel_rpc_port=70000).create_engine_config()
    with pytest.raises(ConfigError, match="--headless runs this node's share .* --data-parallel-address HEAD"):
        parse_serve_args(["m", "--headless", "-dp", "2", "-dpl", "1", "-dpr", "1"], {})
    with pytest.raises(ConfigError, match="--headless serves a head node's API server over the mp backend"):
        parse_serve_args(
            ["m", "--headless", "-dp", "2", "-dpl", "1", "-dpr", "1", "-dpa", "h", "--data-parallel-hybrid-lb"], {}
        )
    headless = parse_serve_args(
        ["m", "--headless", "-dp", "2", "-dpl", "1", "-dpr", "1", "-dpa", "h", "-dpp", "1234"], {}
    )
    assert headless.server.headless
    assert mp_replica_ranks(headless.engine_args.create_engine_config().parallel) == ([1], [0])


def test_the_listener_takes_only_authenticated_replicas_of_its_ranks_and_model(monkeypatch):
    monkeypatch.setenv(NODE_AUTHKEY_ENV, SECRET)
    port = free_port()
    attached = []
    done = threading.Event()

    def attach(rank, connection):
        attached.append(rank)
        done.set()

    listener = ReplicaListener("127.0.0.1", port, {1}, "the-model", attach)
    try:
        with pytest.raises(AuthenticationError):
            Client(("127.0.0.1", port), authkey=b"wrong")
        for hello in (Hello(2, "the-model"), Hello(1, "another-model")):
            refused = Client(("127.0.0.1", port), authkey=SECRET.encode())
            refused.send(hello)
            with pytest.raises(EOFError):
                refused.recv()  # closed by the head
        accepted = Client(("127.0.0.1", port), authkey=SECRET.encode())
        accepted.send(Hello(1, "the-model"))
        assert done.wait(10) and attached == [1]
        accepted.close()
    finally:
        listener.close()


def test_the_secret_is_required(monkeypatch):
    monkeypatch.delenv(NODE_AUTHKEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"set {NODE_AUTHKEY_ENV} to the same secret on every node"):
        ReplicaListener("127.0.0.1", free_port(), {1}, "m", lambda rank, connection: None)


# -- a head and a headless node ----------------------------------------------------------------------


@pytest.mark.slow  # two engines, one behind `tokenloom serve --headless`
def test_a_headless_nodes_replica_serves_with_the_heads_and_its_loss_fails_only_its_streams(
    tiny_llama_dir, monkeypatch, tmp_path
):
    monkeypatch.setenv(NODE_AUTHKEY_ENV, SECRET)
    args = dict(model=tiny_llama_dir, dtype="float32", block_size=4)
    prompts = ["A short story about a robot:", "Numbers: 1, 2,", "The sky is", "Once upon a time"]

    async def single():
        engine = build_engine_client(EngineArgs(**args))
        await engine.start()
        try:
            return await asyncio.gather(*(collect(engine, f"r{i}", prompt, 8) for i, prompt in enumerate(prompts)))
        finally:
            await engine.shutdown()

    expected = asyncio.run(single())
    port = free_port()
    group = ["-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", str(port)]
    log_path = tmp_path / "headless.log"
    with open(log_path, "w") as log:
        # its own session: killing the group is a node going away, replica process and all
        headless = subprocess.Popen(
            [sys.executable, "-m", "tokenloom", "serve", tiny_llama_dir, "--headless", *group, "-dpr", "1"]
            + ["--dtype", "float32", "--block-size", "4"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
            start_new_session=True,
        )
    try:
        engine = build_engine_client(
            EngineArgs(
                **args,
                data_parallel_size=2,
                data_parallel_size_local=1,
                data_parallel_address="127.0.0.1",
                data_parallel_rpc_port=port,
            )
        )
        assert isinstance(engine, DataParallelAsyncLLM)

        async def run():
            await engine.start()
            try:
                got = await asyncio.gather(*(collect(engine, f"r{i}", prompt, 8) for i, prompt in enumerate(prompts)))
                assert got == expected
                (long_zero, long_one), owners = await running_long_requests(engine, prompts[:2])
                assert owners == {"long-0": 0, "long-1": 1}  # the remote replica holds one
                os.killpg(headless.pid, signal.SIGKILL)  # the node goes away
                with pytest.raises(EngineDeadError, match=r"replica 1 \(rank 1, on a headless node\) disconnected"):
                    await long_one
                assert engine.errored
                assert len(await long_zero) == 200  # the head's own replica runs its request to the end
            finally:
                await engine.shutdown()

        asyncio.run(run())
    finally:
        if headless.poll() is None:
            os.killpg(headless.pid, signal.SIGKILL)
        headless.wait()
    assert "headless: data-parallel replica 1 of 2, for the server at 127.0.0.1:" in log_path.read_text()
