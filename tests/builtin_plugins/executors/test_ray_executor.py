"""The ``ray`` executor on a local two-node Ray cluster (``ray.cluster_utils.Cluster``): the
two workers of ``-pp 2`` placed one per node (STRICT_SPREAD) give the greedy ids of ``uni``
(the second stage's worker returns the step; until pipeline stages split the model each
worker computes all of it);
a killed actor fails check_health; a stopped one fails the step once the step timeout passes,
naming it, and is killed; shutdown leaves no actor and no worker process; without Ray installed
the error names the extra to install."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import psutil
import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.errors import ConfigError, EngineDeadError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def greedy_ids(llm: LLM) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def two_node_cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_workers_spread_over_two_nodes_give_the_greedy_ids_of_uni(two_node_cluster, tiny_llama_dir, monkeypatch):
    import ray

    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster.address)
    monkeypatch.setenv("TOKENLOOM_RAY_PLACEMENT_STRATEGY", "STRICT_SPREAD")
    expected = greedy_ids(LLM(model=tiny_llama_dir, dtype="float32"))
    llm = LLM(model=tiny_llama_dir, dtype="float32", pipeline_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.engine.executor
    try:
        assert type(executor).__name__ == "RayExecutor"
        assert len(set(executor.worker_node_ids)) == 2  # one worker on each node
        assert greedy_ids(llm) == expected
        assert (executor.output_rank, executor.max_concurrent_batches) == (1, 2)
        # every actor answers the call by name, as an mp worker does: both map never-used blocks
        assert 0 < executor.prefault_kv_cache(1 << 20) <= 1 << 20
        actor_ids = [actor._actor_id.hex() for actor in executor.actors]
        pids = list(executor.worker_pids)

        llm.engine.check_health()
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            try:
                llm.engine.check_health()
            except EngineDeadError as exc:
                assert f"Ray worker 1 (pid {pids[1]})" in str(exc)
                break
            assert time.monotonic() < deadline, "check_health did not notice the killed actor"
            time.sleep(0.1)
    finally:
        llm.engine.shutdown()
    # the executor connected to the cluster, so it disconnected: the cluster stays, no actor does
    assert not ray.is_initialized()
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
        assert time.monotonic() < deadline, f"Ray worker processes outlived shutdown: {pids}"
        time.sleep(0.2)
    ray.init(address=two_node_cluster.address)
    alive = [
        actor
        for actor in ray._private.state.actors().values()
        if actor["ActorID"] in actor_ids and actor["State"] != "DEAD"
    ]
    assert alive == []


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_stopped_actor_fails_the_step_after_the_step_timeout_and_is_killed(
    two_node_cluster, tiny_llama_dir, monkeypatch
):
    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster.address)
    monkeypatch.setenv("TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3")
    llm = LLM(model=tiny_llama_dir, dtype="float32", pipeline_parallel_size=2, distributed_executor_backend="ray")
    engine = llm.engine
    pids = list(engine.executor.worker_pids)
    try:
        engine.add_request("warm", "hello", GREEDY)
        while engine.has_unfinished_requests():
            engine.step()  # healthy steps are far inside the timeout
        os.kill(pids[1], signal.SIGSTOP)
        engine.add_request("r", "hello", GREEDY)
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as failure:
            while engine.has_unfinished_requests():
                engine.step()
        waited = time.monotonic() - started
        assert f"Ray worker 1 (pid {pids[1]})" in str(failure.value)
        assert "did not answer execute within 3s (TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS" in str(failure.value)
        assert 3 <= waited < 3 + 10
        with pytest.raises(EngineDeadError, match="Ray worker 1"):
            engine.check_health()
        deadline = time.monotonic() + 30
        while any(running(pid) for pid in pids):  # killed at once, the stopped one too
            assert time.monotonic() < deadline, f"Ray workers outlived the timeout: {pids}"
            time.sleep(0.2)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        engine.shutdown()


def test_without_ray_the_error_names_the_extra(tiny_llama_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'tokenloom\[ray\]'"):
        LLM(model=tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
