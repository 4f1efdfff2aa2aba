"""Issue 20 against the real `tokenloom serve smollm2`: cache_salt keeps tenants' prefix caches
apart, fan-out and size caps are 400s naming the field, unencodable text is a 400, a
pathological JSON schema is a 400 while the compile pool goes on, the waiting queue answers
429 with Retry-After, the shared fast tokenizer holds up under concurrent tokenize and generate
requests, and a server without a key warns about CORS at start-up."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import openai
import pytest

from tests.e2e.conftest import start_server, stop_server
from tests.e2e.test_server_smollm2 import metric

pytestmark = pytest.mark.slow

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    running = start_server(
        [
            "smollm2",
            "--max-model-len",
            "1024",
            "--enable-prompt-tokens-details",
            "--structured-outputs-compile-timeout",
            "5",
            "--plugin",
            "tests.core.grammar_test_backends",
        ],
        log_path,
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def wait_idle(server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:num_requests_waiting") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the server did not become idle")


def test_start_up_warns_that_any_web_page_can_use_a_server_without_a_key(server):
    assert "allows every CORS origin" in server.log()


def cached_tokens(client, prompt: str, **extra) -> int:
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
    return completion.usage.prompt_tokens_details.cached_tokens


def test_cache_salt_keeps_tenants_apart(client):
    # a prompt no other test sent, several 16-token blocks long
    prompt = f"Tenant note {uuid.uuid4().hex}: " + "the quarterly figures were reviewed in detail. " * 8
    assert cached_tokens(client, prompt, cache_salt="tenant-a-0f1e2d") == 0
    assert cached_tokens(client, prompt, cache_salt="tenant-a-0f1e2d") >= 64  # the same tenant hits
    assert cached_tokens(client, prompt, cache_salt="tenant-b-9c8b7a") == 0  # another tenant does not
    assert cached_tokens(client, prompt) == 0  # nor an unsalted request
    assert cached_tokens(client, prompt) >= 64
    messages = [{"role": "user", "content": prompt}]
    chat = [
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        ).usage.prompt_tokens_details.cached_tokens
        for salt in ("chat-salt-1", "chat-salt-1", "chat-salt-2")
    ]
    assert chat[0] == 0 and chat[1] >= 64 and chat[2] == 0


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n", 1_000_000, "n must be at most 256"),
        ("best_of", 300, "best_of must be at most 256"),
        ("stop", [f"stop{index}" for index in range(65)], "at most 64"),
        ("logit_bias", {str(token): -1 for token in range(2000)}, "at most 1024"),
        ("allowed_token_ids", list(range(60000)), "allowed_token_ids"),
        ("cache_salt", "", "cache_salt must be a non-empty string"),
    ],
)
def test_caps_are_400s_naming_the_field(client, field, value, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={field: value})
    assert message in str(error.value)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": ["\udc00"], "max_tokens": 2}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\ud83d"}]}),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [{"type": "function", "function": {"name": "f", "description": "\udfff", "parameters": {}}}],
            },
        ),
        ("/tokenize", {"model": MODEL, "prompt": "\ud800"}),
    ],
)
def test_unencodable_text_is_a_400(server, path, body):
    response = httpx.post(
        server.base_url + path,
        content=json.dumps(body).encode("ascii"),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert "not valid Unicode" in response.json()["error"]["message"]


def test_a_schema_that_compiles_too_long_is_a_400_and_others_still_compile(client, server):
    # the "stalling" test backend takes a minute over a schema titled "stall": how long a real
    # pathological schema takes depends on the machine, this does not
    slow_schema = {"title": "stall", "type": "object", "properties": {"text": {"type": "string"}}}
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write."}],
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema}},
            extra_body={"guided_decoding_backend": "stalling"},
        )
    assert "took longer than the server's limit of 5s" in str(error.value)
    assert time.monotonic() - started < 60
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    ok_schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "2+2? Answer in JSON."}],
        max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": ok_schema}},
    )
    assert isinstance(json.loads(reply.choices[0].message.content)["answer"], int)


MULTILINGUAL = "Héllo wörld, naïve café! 😀 日本語のテキスト 🎉👍🏽 Ωμέγα — “quotes” 한국어 "


def test_the_shared_tokenizer_under_concurrent_tokenize_and_generate(server):
    """The event loop tokenizes while the engine thread detokenizes 32 streams, with the same
    fast tokenizer: every tokenization equals the one made alone, every stream completes, and
    the log holds no tokenizer error ("Already borrowed")."""
    texts = [f"{index}: " + MULTILINGUAL * (2 + index % 5) for index in range(32)]
    expected = [
        httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=60).json()["tokens"]
        for text in texts
    ]

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:

            async def tokenize(text: str) -> list[int]:
                results = []
                for _ in range(3):
                    response = await http.post("/tokenize", json={"model": MODEL, "prompt": text})
                    assert response.status_code == 200, response.text
                    results.append(response.json()["tokens"])
                return results

            async def generate(index: int) -> tuple[str, str | None]:
                body = {
                    "model": MODEL,
                    "prompt": texts[index],
                    "max_tokens": 16,
                    "temperature": 0.9,
                    "seed": index,
                    "stream": True,
                    "ignore_eos": True,
                }
                text, finish = "", None
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            choice = json.loads(line[6:])["choices"][0]
                            text += choice["text"]
                            finish = choice["finish_reason"] or finish
                return text, finish

            tokenized = asyncio.gather(*(tokenize(text) for text in texts))
            generated = asyncio.gather(*(generate(index) for index in range(32)))
            return await tokenized, await generated

    tokenized, generated = asyncio.run(run())
    for expected_ids, results in zip(expected, tokenized):
        assert all(result == expected_ids for result in results)
    assert all(finish == "length" and text for text, finish in generated)
    log = server.log()
    assert "Already borrowed" not in log and "Traceback" not in log
    wait_idle(server)


def test_a_full_waiting_queue_answers_429_with_retry_after(tmp_path):
    log_path = str(tmp_path / "serve.log")
    queued = start_server(
        ["smollm2", "--max-model-len", "512", "--max-num-seqs", "1", "--max-waiting-requests", "2"], log_path
    )
    try:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=queued.base_url, timeout=300) as http:
                body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 32, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(10)))

        responses = asyncio.run(run())
        statuses = sorted(response.status_code for response in responses)
        assert set(statuses) == {200, 429}, statuses
        for response in responses:
            if response.status_code == 429:
                assert response.headers["retry-after"] == "1"
                assert "--max-waiting-requests 2" in response.json()["error"]["message"]
            else:
                assert response.json()["choices"][0]["finish_reason"] == "length"
        wait_idle(queued)
        assert metric(queued, "vllm:kv_cache_usage_perc") == 0
    finally:
        stop_server(queued)
