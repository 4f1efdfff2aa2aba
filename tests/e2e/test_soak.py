"""A bounded soak of the real server (issues 20 and 37): up to 64 concurrent loopback clients
mix ordinary completions, streamed chats, clients that disconnect mid-stream, requests aborted
by a client timeout, oversized and malformed bodies (non-finite numbers, deep schemas,
shadowing template kwargs, over-long metadata among them), per-request structured outputs,
tool calls, tokenization, pairs of requests sharing one id, requests full of invented fields
and stored Responses with full metadata. Afterwards every well-formed request got a complete
answer, every bad one a 4xx, `/metrics` shows nothing running or waiting and the KV cache back
at idle (no leaked blocks), the log grew by at most a line per request with unknown fields,
and the server's RSS has settled.

The CI run lasts ``TOKENLOOM_SOAK_SECONDS`` (default 25) of load; the long run is
``TOKENLOOM_SOAK_SECONDS=150 pytest -s tests/e2e/test_soak.py`` (see docs/hardening.md), which
prints the counts and, with ``TOKENLOOM_SOAK_REPORT=FILE``, writes them as JSON.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time

import httpx
import pytest

from tests.e2e.conftest import API_KEY, start_server, stop_server
from tests.e2e.test_server_smollm2 import metric

pytestmark = pytest.mark.slow

MODEL = "smollm2"
SOAK_SECONDS = float(os.environ.get("TOKENLOOM_SOAK_SECONDS", "25"))
CONCURRENCY = int(os.environ.get("TOKENLOOM_SOAK_CONCURRENCY", "64"))
MAX_BODY_BYTES = 64 * 1024
# A KV cache the engine maps completely while idle at start-up (its idle prefault maps up to
# 1 GiB), so the RSS measured once the server has settled already holds every KV page and any
# later growth is the server's own: allocator arenas and caches may still grow, but boundedly.
KV_CACHE_BYTES = "768M"
RSS_GROWTH_LIMIT_BYTES = 256 * 1024 * 1024
# the Responses store's bound, small enough that the soak fills it many times over
RESPONSES_STORE_BYTES = 2 * 1024 * 1024
UNKNOWN_FIELDS_LOG_LINE = "were present in the request but ignored"


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Explain what a KV cache is in one sentence.",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish:",
    "The three primary colours are",
]
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}


class Outcomes:
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []

    def ok(self, kind: str) -> None:
        self.counts[kind] += 1

    def fail(self, kind: str, detail: str) -> None:
        self.counts[f"{kind}:FAILED"] += 1
        if len(self.failures) < 50:
            self.failures.append(f"{kind}: {detail}")


def expect_status(outcomes: Outcomes, kind: str, response: httpx.Response, status: int) -> bool:
    if response.status_code != status:
        outcomes.fail(kind, f"status {response.status_code} (wanted {status}): {response.text[:300]}")
        return False
    return True


async def completion(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    max_tokens = rng.randint(1, 12)
    response = await http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": rng.choice(PROMPTS),
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": rng.randrange(1000),
            "n": rng.choice([1, 1, 1, 2]),
        },
    )
    if expect_status(outcomes, "completion", response, 200):
        body = response.json()
        if not all(choice["finish_reason"] in ("length", "stop") for choice in body["choices"]) or not 1 <= body[
            "usage"
        ]["completion_tokens"] <= max_tokens * len(body["choices"]):
            outcomes.fail("completion", f"incomplete answer: {body}")
        else:
            outcomes.ok("completion")


async def read_stream(response: httpx.Response) -> tuple[str, str | None, bool]:
    text, finish, done = "", None, False
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise AssertionError(f"error event: {chunk}")
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                text += delta.get("content") or choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
    return text, finish, done


async def chat_stream(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(1, 12),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if not expect_status(outcomes, "chat_stream", response, 200):
            await response.aread()
            return
        try:
            _, finish, done = await read_stream(response)
        except AssertionError as error:
            outcomes.fail("chat_stream", str(error))
            return
    if done and finish in ("length", "stop"):
        outcomes.ok("chat_stream")
    else:
        outcomes.fail("chat_stream", f"stream ended without a finish ({finish}) or [DONE] ({done})")


async def disconnect_mid_stream(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": 400, "stream": True, "ignore_eos": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if not expect_status(outcomes, "disconnect", response, 200):
            await response.aread()
            return
        num_chunks = 0
        async for line in response.aiter_lines():
            num_chunks += line.startswith("data: {")
            if num_chunks >= rng.randint(1, 3):
                break  # leaving the block closes the connection mid-stream
    outcomes.ok("disconnect")


async def abort_by_timeout(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": 400, "ignore_eos": True}
    try:
        response = await http.post("/v1/completions", json=body, timeout=rng.uniform(0.2, 2.0))
    except httpx.TimeoutException:
        outcomes.ok("abort")  # the client gave up; the server must abort and free the request
        return
    if expect_status(outcomes, "abort", response, 200):
        outcomes.ok("abort(finished first)")


async def oversized(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + rng.randint(1, 4096)), "max_tokens": 1})
    response = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    if expect_status(outcomes, "oversized", response, 413):
        outcomes.ok("oversized")


MALFORMED = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[" * 20000),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": 5}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 1_000_000}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "a\ud800", "max_tokens": 2}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stop": ["s"] * 100}).encode()),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode()),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": 7}},
            }
        ).encode(),
    ),
    ("/tokenize", json.dumps({"model": MODEL, "prompt": "\udfff"}).encode()),
    # issue 37: non-finite numbers, a schema too deep to walk, kwargs that shadow the
    # template's globals, metadata over OpenAI's limits
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": float("nan")}).encode(),
    ),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {"5": float("inf")}}).encode(),
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(150)}},
            }
        ).encode(),
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"raise_exception": "boom"},
            }
        ).encode(),
    ),
    ("/v1/responses", json.dumps({"model": MODEL, "input": "hi", "metadata": {"k": "v" * 513}}).encode()),
]


async def malformed(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    path, body = rng.choice(MALFORMED)
    response = await http.post(path, content=body, headers={"content-type": "application/json"})
    if expect_status(outcomes, "malformed", response, 400):
        if "error" not in response.json():
            outcomes.fail("malformed", f"not OpenAI's error shape: {response.text[:200]}")
        else:
            outcomes.ok("malformed")


async def structured(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    response = await http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Name a large city and its population as JSON."}],
            "max_tokens": 48,
            "temperature": 0.7,
            "seed": rng.randrange(1000),
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
        },
    )
    if not expect_status(outcomes, "structured", response, 200):
        return
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        try:
            value = json.loads(choice["message"]["content"])
            assert isinstance(value["city"], str) and isinstance(value["population"], int)
        except (ValueError, KeyError, AssertionError, TypeError):
            outcomes.fail("structured", f"output breaks the schema: {choice['message']['content']!r}")
            return
    elif choice["finish_reason"] != "length":
        outcomes.fail("structured", f"finish_reason {choice['finish_reason']!r}")
        return
    outcomes.ok("structured")


async def tools(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    response = await http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is the weather in Lisbon?"}],
            "max_tokens": 40,
            "temperature": 0.7,
            "seed": rng.randrange(1000),
            "tools": [WEATHER_TOOL],
            "tool_choice": rng.choice([{"type": "function", "function": {"name": "get_weather"}}, "required"]),
        },
    )
    if not expect_status(outcomes, "tools", response, 200):
        return
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "length":
        outcomes.ok("tools(length)")
        return
    calls = choice["message"]["tool_calls"]
    try:
        assert calls and all(call["function"]["name"] == "get_weather" for call in calls)
        assert all(isinstance(json.loads(call["function"]["arguments"])["city"], str) for call in calls)
    except (AssertionError, ValueError, KeyError, TypeError):
        outcomes.fail("tools", f"bad tool calls: {choice}")
        return
    outcomes.ok("tools")


async def duplicate_ids(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    """Two requests under one id at once (issue 37): both end, each with its answer or a 400
    naming request_id; neither hangs."""
    request_id = f"soak-dup-{rng.randrange(1 << 62):x}"
    body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 6)}
    responses = await asyncio.gather(
        *(http.post("/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=120) for _ in range(2))
    )
    statuses = sorted(response.status_code for response in responses)
    if statuses not in ([200, 200], [200, 400]):
        outcomes.fail("duplicate_ids", f"statuses {statuses}: {[r.text[:200] for r in responses]}")
    elif (
        statuses == [200, 400]
        and responses[[r.status_code for r in responses].index(400)].json()["error"]["param"] != "request_id"
    ):
        outcomes.fail("duplicate_ids", f"a 400 that does not name request_id: {responses}")
    else:
        outcomes.ok("duplicate_ids")


async def unknown_fields(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    """A request with a thousand invented fields is served; the server logs one line for it."""
    body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": 2}
    body.update({f"invented_{rng.randrange(1 << 40):x}_{index}": index for index in range(1000)})
    response = await http.post("/v1/completions", json=body)
    if expect_status(outcomes, "unknown_fields", response, 200):
        outcomes.ok("unknown_fields")


async def stored_response(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    """A Response stored with OpenAI's largest metadata (16 keys of 512 characters)."""
    metadata = {f"key{index}": f"{rng.randrange(1 << 30):x}".ljust(512, "v") for index in range(16)}
    response = await http.post(
        "/v1/responses",
        json={"model": MODEL, "input": rng.choice(PROMPTS), "max_output_tokens": 2, "metadata": metadata},
    )
    if expect_status(outcomes, "stored_response", response, 200):
        outcomes.ok("stored_response")


async def tokenize(http: httpx.AsyncClient, rng: random.Random, outcomes: Outcomes) -> None:
    response = await http.post("/tokenize", json={"model": MODEL, "prompt": rng.choice(PROMPTS) * rng.randint(1, 20)})
    if expect_status(outcomes, "tokenize", response, 200) and response.json()["count"] > 0:
        outcomes.ok("tokenize")


KINDS = [
    (completion, 20),
    (chat_stream, 14),
    (disconnect_mid_stream, 10),
    (abort_by_timeout, 8),
    (oversized, 4),
    (malformed, 10),
    (structured, 8),
    (tools, 8),
    (tokenize, 6),
    (duplicate_ids, 4),
    (unknown_fields, 3),
    (stored_response, 4),
]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def soak(base_url: str, seconds: float, concurrency: int, outcomes: Outcomes, on_warm) -> None:
    deadline = time.monotonic() + seconds
    warm_at = time.monotonic() + seconds / 3
    functions, weights = zip(*KINDS)

    async def worker(index: int) -> None:
        rng = random.Random(index)
        async with httpx.AsyncClient(
            base_url=base_url, timeout=600, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http:
            while time.monotonic() < deadline:
                kind = rng.choices(functions, weights)[0]
                try:
                    await kind(http, rng, outcomes)
                except httpx.HTTPError as error:  # a well-formed request that got no answer
                    outcomes.fail(kind.__name__, f"{type(error).__name__}: {error}")

    async def warm_probe() -> None:
        await asyncio.sleep(max(0.0, warm_at - time.monotonic()))
        on_warm()

    await asyncio.gather(warm_probe(), *(worker(index) for index in range(concurrency)))


def settled_rss(pid: int, timeout: float = 120.0, window: int = 3, tolerance: int = 16 * 2**20) -> int:
    """RSS once it stops moving: ``window`` samples 2 s apart within ``tolerance``."""
    samples = [rss_bytes(pid)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(2)
        samples.append(rss_bytes(pid))
        recent = samples[-window:]
        if len(recent) == window and max(recent) - min(recent) < tolerance:
            return recent[-1]
    raise AssertionError(f"the server's RSS did not settle in {timeout}s: {[s // 2**20 for s in samples]} MiB")


def wait_idle(server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:num_requests_waiting") == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"requests still running or waiting {timeout}s after the load stopped")


def test_soak(tmp_path):
    server = start_server(
        [
            "smollm2",
            "--max-model-len",
            "1024",
            "--api-key",
            API_KEY,
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--max-request-body-bytes",
            str(MAX_BODY_BYTES),
            "--kv-cache-memory-bytes",
            KV_CACHE_BYTES,
            "--responses-store-max-bytes",
            str(RESPONSES_STORE_BYTES),
        ],
        str(tmp_path / "serve.log"),
    )
    try:
        pid = server.process.pid
        idle_kv = metric(server, "vllm:kv_cache_usage_perc")
        outcomes = Outcomes()
        rss: dict[str, int] = {"start": settled_rss(pid)}
        started = time.monotonic()
        asyncio.run(
            soak(server.base_url, SOAK_SECONDS, CONCURRENCY, outcomes, lambda: rss.__setitem__("warm", rss_bytes(pid)))
        )
        load_seconds = time.monotonic() - started
        rss["end_of_load"] = rss_bytes(pid)
        wait_idle(server, timeout=180)
        rss["idle"] = settled_rss(pid)
        report = {
            "seconds_of_new_requests": SOAK_SECONDS,
            "seconds_until_all_answered": round(load_seconds, 1),
            "concurrency": CONCURRENCY,
            "requests": sum(outcomes.counts.values()),
            "outcomes": dict(sorted(outcomes.counts.items())),
            "failures": outcomes.failures,
            "rss_mib": {k: round(v / 2**20) for k, v in rss.items()},
            "kv_cache_usage_after": metric(server, "vllm:kv_cache_usage_perc"),
            "running_after": metric(server, "vllm:num_requests_running"),
            "waiting_after": metric(server, "vllm:num_requests_waiting"),
        }
        print("soak report:", json.dumps(report, indent=2))
        if os.environ.get("TOKENLOOM_SOAK_REPORT"):
            with open(os.environ["TOKENLOOM_SOAK_REPORT"], "w") as handle:
                json.dump(report, handle, indent=2)

        assert outcomes.failures == []
        for kind in (
            "completion",
            "chat_stream",
            "disconnect",
            "malformed",
            "structured",
            "tokenize",
            "duplicate_ids",
            "unknown_fields",
            "stored_response",
        ):
            assert outcomes.counts[kind] > 0, f"the soak never exercised {kind}"
        # one log line per request with unknown fields, whatever their number
        assert server.log().count(UNKNOWN_FIELDS_LOG_LINE) <= outcomes.counts["unknown_fields"]
        assert report["running_after"] == 0 and report["waiting_after"] == 0
        assert report["kv_cache_usage_after"] == idle_kv == 0  # every block came back
        assert rss["idle"] - rss["warm"] < RSS_GROWTH_LIMIT_BYTES, report["rss_mib"]
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        assert "Traceback" not in server.log()
    finally:
        stop_server(server)
