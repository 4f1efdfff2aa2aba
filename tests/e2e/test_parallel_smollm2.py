"""`tokenloom serve smollm2 -tp 3` (the ``mp`` executor, its default for several workers) over
HTTP with the openai client: greedy token ids identical to a one-process (``uni``) run; then a
worker killed: the open stream ends with an OpenAI-shaped error, /health and new requests answer
503, and stopping the server leaves no worker process behind.

Until tensor-parallel layers are merged each of the three ranks computes the whole model; the
ids must stay identical once they shard. The tests run in file order: the last one kills a worker
of the module's server."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import psutil
import pytest

from tests.e2e.conftest import start_server, stop_server
from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Q: What is 12 times 7?\nA:", "Les fleurs du printemps"]
NUM_TOKENS = 24
MAX_MODEL_LEN = "512"


def worker_processes(server) -> list[psutil.Process]:
    """The server's worker processes: the children of its forkserver (not the forkserver itself,
    nor multiprocessing's resource tracker)."""
    children = psutil.Process(server.process.pid).children(recursive=True)
    forkservers = {child.pid for child in children if "multiprocessing.forkserver" in " ".join(child.cmdline())}
    return [child for child in children if child.ppid() in forkservers]


@pytest.fixture(scope="module")
def tp3_server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    server = start_server(["smollm2", "-tp", "3", "--dtype", "float32", "--max-model-len", MAX_MODEL_LEN], log_path)
    yield server
    workers = worker_processes(server)
    stop_server(server)
    gone, alive = psutil.wait_procs(workers, timeout=15)
    assert alive == [], f"worker processes outlived the server: {[p.pid for p in alive]}"


@pytest.fixture(scope="module")
def uni_greedy(smollm2_gguf):
    llm = LLM(model="smollm2", dtype="float32", max_model_len=int(MAX_MODEL_LEN))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    results = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]
    llm.engine.shutdown()
    return results


def test_tp3_greedy_ids_equal_a_one_process_run(tp3_server, uni_greedy):
    assert len(worker_processes(tp3_server)) == 3
    assert "mp executor ready" in tp3_server.log() and "worker 2: model loaded in" in tp3_server.log()
    client = openai.OpenAI(base_url=tp3_server.base_url + "/v1", api_key="unused")
    # the prompts in one request, decoded together as the uni run decodes them (one step a token
    # for the three, where one request each took three)
    completion = client.completions.create(
        model="smollm2",
        prompt=PROMPTS,
        max_tokens=NUM_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choices = sorted(completion.choices, key=lambda choice: choice.index)
    assert [choice.model_extra["token_ids"] for choice in choices] == uni_greedy


def test_a_killed_worker_ends_the_open_stream_and_the_server_answers_503(tp3_server):
    client = openai.OpenAI(base_url=tp3_server.base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        max_tokens=400,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    victim = worker_processes(tp3_server)[1]
    chunks = 0
    with pytest.raises(openai.APIError) as failure:
        for _ in stream:
            chunks += 1
            if chunks == 3:
                os.kill(victim.pid, signal.SIGKILL)
    assert chunks >= 3
    assert "worker" in str(failure.value) and "SIGKILL" in str(failure.value)
    deadline = time.monotonic() + 10
    while httpx.get(tp3_server.base_url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/health did not turn 503 after a worker died"
        time.sleep(0.2)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    assert refused.value.status_code == 503
    error = refused.value.response.json()["error"]
    assert "stopped after an error" in error["message"] and "SIGKILL" in error["message"]
    health = httpx.get(tp3_server.base_url + "/health", timeout=5)
    assert health.status_code == 503 and "worker" in health.json()["error"]["message"]
