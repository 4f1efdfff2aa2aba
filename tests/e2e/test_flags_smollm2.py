"""Issue 19's flags at the boundary users touch: the real ``tokenloom serve`` with SmolLM2, the
``openai`` client and plain HTTP. One server carries the generation-config, logprobs, load,
logging and noop flags; a second runs with ``--skip-tokenizer-init``; refusals run the real
command, which exits before loading a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import REPO_ROOT, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
CAP = 6  # max_new_tokens of the generation config below
SECRET_PROMPT = "The secret passphrase is swordfish, said the"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation-config")
    # temperature 0.8 from the folder, overridden to greedy: defaults for requests that set none
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.8, "max_new_tokens": CAP}))
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    running = start_server(
        [
            MODEL,
            "--max-model-len",
            "512",
            "--generation-config",
            str(folder),
            "--override-generation-config",
            '{"temperature": 0.0}',
            "--max-logprobs",
            "-1",
            "--enable-server-load-tracking",
            "--enable-log-requests",
            "--max-log-len",
            "10",
            "--disable-uvicorn-access-log",
            "--trust-remote-code",
            "--enforce-eager",
        ],
        log_path,
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_generation_config_folder_sets_defaults_and_caps_max_tokens(client, server):
    first = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    second = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    # temperature 0 (the override) by default: the same text twice; max_new_tokens caps the length
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.completion_tokens == CAP
    asked_for_more = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=50, extra_body={"ignore_eos": True}
    )
    assert asked_for_more.usage.completion_tokens == CAP  # as in vLLM, the cap wins
    # a request's own temperature still wins over the default
    sampled = {
        client.completions.create(
            model=MODEL, prompt="Once upon a time", temperature=2.0, seed=seed, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for seed in range(4)
    }
    assert len(sampled) > 1
    # the start-up log says which defaults are in force
    assert "request defaults from the generation config" in server.log()
    assert "max_tokens=6, temperature=0.0" in server.log()


def test_max_logprobs_minus_one_means_no_cap(client):
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, logprobs=50)
    assert len(completion.choices[0].logprobs.top_logprobs[0]) == 50  # above vLLM's default cap of 20


def test_load_counts_a_request_while_it_streams(server, client):
    """/load reads 1 while a streamed request is in flight and 0 once it is done. The generation
    config caps every request at CAP tokens, so the request is short: /load is polled from a
    thread for the whole request (a long prompt makes its prefill the window) instead of once
    after its first chunk, when the few tokens left may all have been sent already."""
    assert httpx.get(server.base_url + "/load").json() == {"server_load": 0}
    seen: list[int] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.base_url) as http:
            while not done.is_set():
                seen.append(http.get("/load").json()["server_load"])

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        while not seen:  # the poller is reading before the request is sent
            time.sleep(0.01)
        stream = client.completions.create(
            model=MODEL, prompt="Count to twenty: " + "one two three " * 100, max_tokens=CAP, stream=True
        )
        chunks = list(stream)
    finally:
        done.set()
        poller.join()
    assert chunks and 1 in seen and max(seen) == 1
    deadline = time.monotonic() + 30
    while httpx.get(server.base_url + "/load").json() != {"server_load": 0}:
        assert time.monotonic() < deadline, "the request was still counted 30 s after it ended"
        time.sleep(0.05)


def test_prompts_are_logged_only_with_enable_log_requests(client, server):
    client.completions.create(model=MODEL, prompt=SECRET_PROMPT, max_tokens=1)
    log = server.log()
    assert "received request" in log and repr(SECRET_PROMPT[:10]) in log  # --max-log-len 10
    assert "swordfish" not in log
    # --disable-uvicorn-access-log: no line per HTTP request
    assert '"POST /v1/completions HTTP/1.1" 200' not in log


def test_noop_flags_are_warned_at_start_up(server):
    log = server.log()
    assert "--trust-remote-code has no effect in tokenloom (tokenloom never runs code shipped with a model" in log
    assert "--enforce-eager has no effect in tokenloom (tokenloom always runs the model eagerly" in log


@pytest.fixture(scope="module")
def no_tokenizer_server(tmp_path_factory):
    """--skip-tokenizer-init, and no --enable-log-requests (vLLM's default)."""
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    running = start_server([MODEL, "--max-model-len", "256", "--skip-tokenizer-init"], log_path)
    yield running
    stop_server(running)


def test_requests_are_not_logged_by_default(no_tokenizer_server):
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2, "return_token_ids": True}
    response = httpx.post(no_tokenizer_server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    log = no_tokenizer_server.log()
    assert "received request" not in log and "[1, 2, 3, 4]" not in log


def check_skip_tokenizer_init(running) -> None:
    """--skip-tokenizer-init: token ids in, token ids out, text fields empty; text prompts and
    chat get a 400 that says why."""
    url = running.base_url
    body = {
        "model": MODEL,
        "prompt": [1, 504, 3458, 314],
        "max_tokens": 4,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 4
    assert choice["prompt_token_ids"] == [1, 504, 3458, 314]
    # greedy twice: the same ids (the ids are the model's, not placeholders)
    again = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=60).json()["choices"][0]
    once_more = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=60).json()["choices"][0]
    assert again["token_ids"] == once_more["token_ids"]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    streamed_ids = [token for chunk in chunks for token in chunk["choices"][0]["token_ids"] or []]
    assert len(streamed_ids) == 4 and chunks[0]["choices"][0]["prompt_token_ids"] == body["prompt"]
    for path, request, param in (
        ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "stop": ["x"]}, "stop"),
        ("/tokenize", {"model": MODEL, "prompt": "Hello"}, "prompt"),
    ):
        response = httpx.post(url + path, json=request, timeout=60)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert "--skip-tokenizer-init" in error["message"] and error["param"] == param
        assert "token ids" in error["message"]


def test_skip_tokenizer_init_serves_token_ids_and_refuses_text(no_tokenizer_server):
    check_skip_tokenizer_init(no_tokenizer_server)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-tp", "0"], "--tensor-parallel-size: must be a whole number of at least 1, got 0"),
        (
            ["--pipeline-parallel-size", "2", "--distributed-executor-backend", "uni"],
            "--distributed-executor-backend uni runs one worker in the engine's process, but -tp 1 -pp 2 needs 2 workers",
        ),
        (
            ["-dp", "2", "-dpl", "1"],
            "--data-parallel-address: 1 of 2 replicas on this node: the others run on other nodes",
        ),
        (["-dp", "2", "-dpb", "slurm"], "argument --data-parallel-backend/-dpb: invalid choice: 'slurm'"),
        (["--tokenizer-mode", "mistral"], "--tokenizer-mode: 'mistral' is not implemented"),
        (["--tokenizer-revision", "v2"], "tokenloom does not implement --tokenizer-revision yet"),
        (["--model-loader-extra-config", '{"a": 1}'], "tokenloom does not implement --model-loader-extra-config"),
        (["--override-generation-config", '{"do_sample": true}'], "'do_sample' is not a request default"),
        (["--generation-config", "/no/such/folder"], "--generation-config: '/no/such/folder' is neither"),
        (["--enable-log-requests", "--disable-log-requests"], "contradict; give one"),
    ],
)
def test_refused_flags_name_themselves_before_a_model_loads(argv, message):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-m", "tokenloom", "serve", MODEL, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
