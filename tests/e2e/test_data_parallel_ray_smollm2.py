"""`tokenloom serve smollm2 -dp 2 --data-parallel-size-local 1 --data-parallel-backend ray`
joining a two-node Ray cluster (``ray.cluster_utils.Cluster``, both nodes on this machine, one
CPU each): one replica actor per node behind the one API; a small request set (the full server
module runs against `-dp 2` under mp, tests/e2e/test_server_smollm2.py), then the server stops
and takes its actors with it, leaving the cluster up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from unittest import mock

import httpx
import openai
import psutil
import pytest

from tests.e2e.conftest import API_KEY, serve_smollm2, stop_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    # a trusted loopback cluster: no token to hand the server
    with mock.patch.dict(os.environ, {"RAY_AUTH_MODE": "disabled"}):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            cluster.shutdown()


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory, ray_cluster):
    with mock.patch.dict(os.environ, {"RAY_ADDRESS": ray_cluster.address, "RAY_AUTH_MODE": "disabled"}):
        yield from serve_smollm2(tmp_path_factory, ["-dp", "2", "-dpl", "1", "--data-parallel-backend", "ray"])


def replica_actors() -> list[psutil.Process]:
    """The replica actors' processes: the test's cluster runs them under this process."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "RayReplicaActor" in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


@pytest.fixture(scope="module")
def client(ray_server):
    return openai.OpenAI(base_url=ray_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_greedy_completion_streamed_equals_whole_and_chat_answers(client):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert whole.choices[0].text and streamed == whole.choices[0].text
    assert whole.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.content


def test_concurrent_requests_use_both_replicas_and_metrics_sum_them(ray_server):
    async def run():
        async with openai.AsyncOpenAI(
            base_url=ray_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=f"Count from {i}:", max_tokens=10, temperature=0)
                    for i in range(8)
                )
            )

    before = generation_tokens(ray_server)
    results = asyncio.run(run())
    assert all(result.usage.completion_tokens == 10 for result in results)
    assert generation_tokens(ray_server) - before == 80
    assert "data parallel: 2 replicas (ray backend) ready" in ray_server.log()


def generation_tokens(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    )


def test_one_replica_runs_on_each_node_and_stopping_the_server_ends_both(ray_server, ray_cluster):
    actors = replica_actors()
    # each actor is a worker of its node's raylet: two parents, two nodes
    assert len(actors) == 2 and len({actor.ppid() for actor in actors}) == 2
    stop_server(ray_server)
    deadline = time.monotonic() + 30
    while replica_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replica_actors() == []
    assert len(ray_cluster.list_all_nodes()) == 2 and ray_cluster.remaining_processes_alive()  # the cluster stays
