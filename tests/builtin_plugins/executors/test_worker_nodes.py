"""One engine's ``-tp`` workers on two "nodes" without Ray, as vLLM's mp backend runs them with
``--nnodes``/``--node-rank``: node 0's server (the engine and worker 0) and `tokenloom serve
--node-rank 1 --headless` (worker 1) in its own process group on this machine, meeting over
authenticated TCP. Greedy ids over HTTP equal a single-process run; the node going away is the
503 path a dead local worker takes; the flags are checked together."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import httpx
import openai
import pytest

from tests.e2e.conftest import REPO_ROOT, free_port, free_port_pair, start_server, stop_server
from tokenloom.api.serve_args import parse_serve_args
from tokenloom.builtin_plugins.executors.worker_host import WorkerLaunch
from tokenloom.builtin_plugins.executors.worker_nodes import WorkerHello, accept_node_workers
from tokenloom.core.config import EngineArgs
from tokenloom.core.executor import NODE_AUTHKEY_ENV
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import ConfigError, EngineDeadError
from tokenloom.llm import LLM

SECRET = "worker-nodes-test-secret"
PROMPTS = ["A short story about a robot:", "Numbers: 1, 2,", "The sky is"]
NUM_TOKENS = 8


def parallel_of(**args):
    return EngineArgs(**args).create_engine_config().parallel


# -- the flags -----------------------------------------------------------------------------------


def test_each_node_runs_an_equal_share_of_the_workers():
    parallel = parallel_of(model="m", tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1)
    assert (parallel.workers_per_node, parallel.worker_control_port) == (2, 29502)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(tensor_parallel_size=3, nnodes=2), "--nnodes: -tp 3 -pp 1 makes 3 workers, which 2 nodes cannot share"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), r"--node-rank: must be between 0 and --nnodes - 1 \(1\)"),
        (dict(nnodes=0), "--nnodes: must be a whole number of at least 1"),
        (dict(tensor_parallel_size=2, nnodes=2, master_port=65535), "--master-port: must be a TCP port"),
        (
            dict(tensor_parallel_size=2, nnodes=2, distributed_executor_backend="ray"),
            "--nnodes: spreads the mp executor's workers over nodes, not ray's",
        ),
        (dict(tensor_parallel_size=2, nnodes=2, data_parallel_size=2), "--nnodes: .* does not combine with -dp"),
    ],
)
def test_node_flags_that_do_not_fit_are_refused_naming_the_flag(args, message):
    with pytest.raises(ConfigError, match=message):
        parallel_of(model="m", **args)


def test_a_node_other_than_0_must_be_headless_and_node_0_must_not_be():
    with pytest.raises(ConfigError, match="--node-rank 1 runs this node's share of the workers .* add --headless"):
        parse_serve_args(["m", "-tp", "2", "--nnodes", "2", "--node-rank", "1"])
    with pytest.raises(ConfigError, match="--headless with --nnodes runs a node's workers .* --node-rank"):
        parse_serve_args(["m", "-tp", "2", "--nnodes", "2", "--headless"])
    parsed = parse_serve_args(["m", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--headless"])
    assert parsed.server.headless and parsed.engine_args.node_rank == 1


def test_a_node_without_the_shared_secret_is_refused_before_it_starts_anything(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(NODE_AUTHKEY_ENV, raising=False)
    run = subprocess.run(
        [sys.executable, "-m", "tokenloom", "serve", tiny_llama_dir, "-tp", "2", "--nnodes", "2", "--node-rank", "1"]
        + ["--headless", "--master-port", str(free_port())],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
        timeout=120,
    )
    assert run.returncode != 0
    assert f"set {NODE_AUTHKEY_ENV} to the same secret on every node" in run.stderr


def test_node_0_takes_only_authenticated_workers_it_waits_for_and_sends_each_its_launch(monkeypatch):
    monkeypatch.setenv(NODE_AUTHKEY_ENV, SECRET)
    config = EngineArgs(
        model="m", tensor_parallel_size=2, nnodes=2, master_port=free_port_pair()
    ).create_engine_config()
    launch = WorkerLaunch(spec=None, rank=1, init_method="tcp://127.0.0.1:1", distributed_backend="gloo")
    accepted = []
    listening = threading.Thread(target=lambda: accepted.append(accept_node_workers(config, [launch], timeout=60)))
    listening.start()
    address = ("127.0.0.1", config.parallel.worker_control_port)
    deadline = time.monotonic() + 30
    while True:  # the listener starts on its thread
        try:
            with pytest.raises(AuthenticationError):
                Client(address, authkey=b"not the secret")
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for wrong in (WorkerHello(1, 1, 4242, "another-model"), WorkerHello(0, 1, 4242, "m")):
        refused = Client(address, authkey=SECRET.encode())
        refused.send(wrong)
        with pytest.raises(EOFError):
            refused.recv()
    joined = Client(address, authkey=SECRET.encode())
    joined.send(WorkerHello(1, 1, 4242, "m"))
    assert joined.recv() == launch
    listening.join(timeout=30)
    ((remote, connection),) = accepted[0]
    assert (remote.pid, remote.node_rank, remote.is_alive()) == (4242, 1, True)
    remote.kill()
    assert not remote.is_alive() and connection.closed
    with pytest.raises(EOFError):
        joined.recv()  # the worker sees its end


def test_node_0_gives_up_on_workers_that_never_connect_naming_them(monkeypatch):
    monkeypatch.setenv(NODE_AUTHKEY_ENV, SECRET)
    config = EngineArgs(
        model="m", tensor_parallel_size=2, nnodes=2, master_port=free_port_pair()
    ).create_engine_config()
    launch = WorkerLaunch(spec=None, rank=1, init_method="tcp://127.0.0.1:1", distributed_backend="gloo")
    with pytest.raises(EngineDeadError, match=r"workers 1 of the other nodes did not connect .* within 1s"):
        accept_node_workers(config, [launch], timeout=1)


# -- node 0's server and a headless node -----------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes(tiny_llama_dir, tmp_path_factory):
    """Node 0's server and node 1 (`--headless`, its own session: killing the group is the node
    going away), and the greedy ids of the same prompts from one process."""
    uni = LLM(model=tiny_llama_dir, dtype="float32")
    expected = [output.outputs[0].token_ids for output in uni.generate(PROMPTS, _greedy())]
    uni.engine.shutdown()
    logs = tmp_path_factory.mktemp("nodes")
    master_port = free_port_pair()  # the control port is the one after it
    common = [tiny_llama_dir, "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    common += ["--master-port", str(master_port), "--dtype", "float32", "--served-model-name", "tiny"]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[NODE_AUTHKEY_ENV] = SECRET
    node1_log = logs / "node1.log"
    with open(node1_log, "w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "tokenloom", "serve", *common, "--node-rank", "1", "--headless"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
        )
    previous = os.environ.get(NODE_AUTHKEY_ENV)
    os.environ[NODE_AUTHKEY_ENV] = SECRET  # start_server passes this process's environment on
    try:
        server = start_server(common, str(logs / "node0.log"))
    except BaseException:
        os.killpg(node1.pid, signal.SIGKILL)
        raise
    finally:
        if previous is None:
            del os.environ[NODE_AUTHKEY_ENV]
        else:
            os.environ[NODE_AUTHKEY_ENV] = previous
    yield server, node1, node1_log, master_port, expected
    stop_server(server)
    if node1.poll() is None:
        os.killpg(node1.pid, signal.SIGKILL)
    node1.wait()


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_workers_on_two_nodes_give_the_single_process_greedy_ids(two_nodes):
    server, node1, node1_log, _, expected = two_nodes
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(
        model="tiny",
        prompt=PROMPTS,
        max_tokens=NUM_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choices = sorted(completion.choices, key=lambda choice: choice.index)
    assert [choice.model_extra["token_ids"] for choice in choices] == expected
    assert "headless: node 1 of 2, workers 1 of 2, for the engine at 127.0.0.1:" in node1_log.read_text()
    assert "mp executor: worker 1 (pid " in server.log() and "on node 1) connected" in server.log()


def test_node_0_stops_listening_once_its_workers_joined_and_keeps_serving(two_nodes):
    server, _, _, master_port, _ = two_nodes
    with pytest.raises((ConnectionError, OSError)):
        Client(("127.0.0.1", master_port + 1), authkey=SECRET.encode())
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=NUM_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text


def test_the_node_going_away_turns_the_server_to_503_naming_the_worker(two_nodes):
    server, node1, _, _, _ = two_nodes
    os.killpg(node1.pid, signal.SIGKILL)  # node 1 goes away, its worker with it
    deadline = time.monotonic() + 30
    while httpx.get(server.base_url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health did not turn 503 after node 1 went away"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert refused.value.status_code == 503
    message = refused.value.response.json()["error"]["message"]
    assert "worker 1 (pid" in message and "on node 1) disconnected" in message
