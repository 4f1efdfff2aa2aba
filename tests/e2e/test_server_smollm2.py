"""The real `tokenloom serve smollm2` process driven with the official `openai` client and httpx:
endpoints, streaming equal to non-streaming, usage, stops, logprobs, n > 1, the API key, a
--middleware module, the CLI clients, concurrency, disconnects freeing KV blocks, and error
statuses; every test that reaches the engine once more against a data-parallel server (``-dp 2``:
two engine replicas behind the one API). The API key, the middleware and the CLI clients live in
the API process and talk HTTP: what is behind it changes nothing there, so they run once."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, serve_smollm2

pytestmark = pytest.mark.slow

MODEL = "smollm2"


@pytest.fixture(scope="module", params=[[], ["--data-parallel-size", "2"]], ids=["one-engine", "dp2"])
def smollm2_server(request, smollm2_server, tmp_path_factory):
    # the API must not tell one engine from two replicas: the same tests pass against both
    # (one engine: the session's shared server, from tests/e2e/conftest.py)
    if request.param:
        yield from serve_smollm2(tmp_path_factory, request.param)
    else:
        yield smollm2_server


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


# for the tests whose proof lives wholly in the API process (the -dp 2 server runs the same code there)
one_engine_only = pytest.mark.parametrize("smollm2_server", [[]], ids=["one-engine"], indirect=True)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_models_lists_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="The three primary colours are", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    pieces = [chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs) if chunk.choices]
    assert "".join(pieces) == full.choices[0].text
    assert full.usage.completion_tokens == 24
    assert full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    assert full.choices[0].finish_reason == "length"


def test_chat_greedy_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert "Paris" in text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.choices[0].message.role == "assistant"


def test_stop_string_truncates_output(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, stop=[" 8"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text.endswith("7,")
    assert " 8" not in out.choices[0].text


def test_logprobs_shape(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    # greedy: the chosen token is the most likely one
    for logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_n_greater_than_one_with_seed(client):
    out = client.completions.create(
        model=MODEL, prompt="My favourite animal is", max_tokens=12, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    again = client.completions.create(
        model=MODEL, prompt="My favourite animal is", max_tokens=12, n=3, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]


@one_engine_only
def test_api_key_is_enforced(smollm2_server):
    url = smollm2_server.base_url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    missing = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"]
    wrong = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 401
    for public in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(url + public, timeout=30).status_code == 200


@one_engine_only
def test_middleware_module_adds_header(smollm2_server):
    response = httpx.get(smollm2_server.base_url + "/health", timeout=30)
    assert response.headers["X-Served-By"] == "tokenloom-e2e"


def test_tokenize_detokenize_roundtrip(smollm2_server):
    url = smollm2_server.base_url
    tokens = httpx.post(
        url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}, headers=auth(), timeout=30
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(
        url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, headers=auth(), timeout=30
    ).json()
    assert text["prompt"].endswith("Hello world")


def test_error_statuses(client, smollm2_server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="word " * 2000, max_tokens=2)
    assert "1024" in str(too_long.value)
    with pytest.raises(openai.BadRequestError) as bad_param:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    assert "temperature" in str(bad_param.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, suffix="!")
    # the engine is still fine after all that
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_32_concurrent_streams_all_finish(smollm2_server):
    async def one(async_client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await async_client.completions.create(
            model=MODEL,
            prompt=f"Story number {i}:",
            max_tokens=16,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        # opened and closed in this event loop: an unclosed async client is closed by its finaliser
        # in whatever loop runs later, and that loop's test fails on the dead transport
        async with openai.AsyncOpenAI(
            base_url=smollm2_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as async_client:
            return await asyncio.gather(*(one(async_client, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert len(results) == 32
    assert all(finish == "length" and text for text, finish in results)


def test_disconnected_stream_frees_its_blocks(smollm2_server):
    url = smollm2_server.base_url
    body = {
        "model": MODEL,
        "prompt": "Count to a thousand: 1, 2,",
        "max_tokens": 900,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth(), timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(smollm2_server, "vllm:num_requests_running") == 1
        assert metric(smollm2_server, "vllm:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric(smollm2_server, "vllm:num_requests_running") != 0:
        time.sleep(0.2)
    assert metric(smollm2_server, "vllm:num_requests_running") == 0
    assert metric(smollm2_server, "vllm:kv_cache_usage_perc") == 0


def run_client(server, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenloom",
            *args,
            "--url",
            server.base_url + "/v1",
            "--api-key",
            API_KEY,
            "--max-tokens",
            "12",
        ],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


@one_engine_only
def test_chat_and_complete_clients(smollm2_server):
    quick = run_client(smollm2_server, "chat", "--quick", "What is the capital of France?")
    assert quick.returncode == 0, quick.stderr
    assert quick.stdout.strip()
    interactive = run_client(smollm2_server, "chat", "--model-name", MODEL, stdin="Hello!\nWhat did I just say?\n")
    assert interactive.returncode == 0, interactive.stderr
    assert len([line for line in interactive.stdout.splitlines() if line.strip()]) >= 2
    completed = run_client(smollm2_server, "complete", "--quick", "1, 2, 3, 4,")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip()
    unreachable = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenloom",
            "complete",
            "--url",
            "http://127.0.0.1:9/v1",
            "--model-name",
            MODEL,
            "--quick",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unreachable.returncode == 1 and "cannot reach the server" in unreachable.stderr
