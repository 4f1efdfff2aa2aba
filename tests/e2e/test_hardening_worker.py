"""A worker that stops answering (issue 37, item 8): `tokenloom serve smollm2 -pp 2` (the ``mp``
executor) with a short step timeout (``TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS``) and one worker
``SIGSTOP``ped mid-generation. While the step waits, /health still answers at once (it never
waits on the engine thread); once the timeout passes the open streaming and non-streaming
requests end with an error naming the worker, /health and new requests answer 503, the stopped
worker is killed, and the server stops promptly.

The tests run in file order: the last one stops a worker of the module's server."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import httpx
import openai
import psutil
import pytest

from tests.e2e.conftest import start_server

pytestmark = pytest.mark.slow

STEP_TIMEOUT_SECONDS = 8
# what the machine may add to the timeout before a waiting request sees the error: the reader's
# one-second check, the engine thread ending every stream, the event loop delivering it
SLACK_SECONDS = 7


def worker_pids(server) -> list[int]:
    """The worker pids by rank, from the executor's start-up line."""
    match = re.search(r"mp executor ready .* \(pids (\d+), (\d+)\)", server.log())
    assert match, server.log()[-3000:]
    return [int(match.group(1)), int(match.group(2))]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"worker processes outlived the engine: {pids}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def pp_server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("pp-worker") / "serve.log")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(STEP_TIMEOUT_SECONDS))
        server = start_server(
            ["smollm2", "-pp", "2", "--dtype", "float32", "--max-model-len", "512"], log_path, timeout=360.0
        )
    pids = worker_pids(server)
    yield server
    # nothing stays stopped, whatever the test did: resumed (or killed) so nothing is left behind
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=30)
        except Exception:
            server.process.kill()
            server.process.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_healthy_server_with_a_short_step_timeout_answers(pp_server):
    client = openai.OpenAI(base_url=pp_server.base_url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4)
    assert completion.choices[0].finish_reason == "length"
    assert f"step timeout {STEP_TIMEOUT_SECONDS:g}s" in pp_server.log()


def test_a_stopped_worker_ends_open_requests_health_turns_503_and_the_server_stops(pp_server):
    pids = worker_pids(pp_server)
    client = openai.OpenAI(
        base_url=pp_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=STEP_TIMEOUT_SECONDS + 60
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # a non-streaming request in the same batches as the stream
        pending = pool.submit(
            client.completions.create,
            model="smollm2",
            prompt="Once upon a time",
            max_tokens=400,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
            max_tokens=400,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = 0
        stopped_at = 0.0
        with pytest.raises(openai.APIError) as stream_failure:
            for _ in stream:
                chunks += 1
                if chunks == 3:
                    os.kill(pids[1], signal.SIGSTOP)
                    stopped_at = time.monotonic()
                    # the engine thread now waits for the stopped worker; /health does not
                    health = httpx.get(pp_server.base_url + "/health", timeout=2)
                    assert health.status_code == 200
        waited = time.monotonic() - stopped_at
        with pytest.raises(openai.APIStatusError) as request_failure:
            pending.result(timeout=SLACK_SECONDS)
    assert waited < STEP_TIMEOUT_SECONDS + SLACK_SECONDS
    # the stream's error event and the plain request's 503 both name the worker that hung
    named = f"worker 1 (pid {pids[1]}"
    assert named in str(stream_failure.value) and "did not answer" in str(stream_failure.value)
    assert request_failure.value.status_code == 503
    assert named in request_failure.value.response.json()["error"]["message"]
    health = httpx.get(pp_server.base_url + "/health", timeout=2)
    assert health.status_code == 503 and named in health.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    assert refused.value.status_code == 503
    # the stopped worker was killed with the rest, not left behind; the server stops at once
    assert_gone(pids)
    pp_server.process.terminate()
    assert pp_server.process.wait(timeout=20) is not None
