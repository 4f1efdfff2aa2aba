"""Issue 37, items 2 and 7, against the real `tokenloom serve smollm2`: a huge or deep JSON
schema is a 400 and the event loop keeps answering /health meanwhile; a compile that overran
is stopped (outlines) and remembered, so asking again is the same 400 at once; one client
(an API key) cannot take every runaway-compile slot; and the operator decides which
backends a request may name (--structured-outputs-request-backends)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
KEY_A = "tenant-a-key-3f9c"
KEY_B = "tenant-b-key-7d21"
COMPILE_TIMEOUT = 10  # the 8,500-property check takes ~3 s alone, over 5 s beside the other worker


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    running = start_server(
        [
            "smollm2",
            "--max-model-len",
            "1024",
            "--structured-outputs-compile-timeout",
            str(COMPILE_TIMEOUT),
            "--structured-outputs-request-backends",
            "outlines,stalling",
            "--api-key",
            KEY_A,
            "--api-key",
            KEY_B,
            "--plugin",
            "tests.core.grammar_test_backends",
        ],
        log_path,
    )
    yield running
    stop_server(running)


def chat(server, key: str, timeout: float = 120, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 4, **fields}
    return httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


class HealthWatch:
    """Asks /health every 0.2 s on a thread, from start to stop; keeps the slowest answer."""

    def __init__(self, server):
        self.url = server.base_url + "/health"
        self.slowest = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                status = httpx.get(self.url, timeout=30).status_code
                if status != 200:
                    self.failures.append(f"status {status}")
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
            self.slowest = max(self.slowest, time.monotonic() - started)
            self._stop.wait(0.2)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(60)


def wide_schema(num_properties: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(num_properties)}}


def test_a_huge_schema_is_a_400_and_health_answers_within_2s_meanwhile(server):
    # 50,000 properties (1.7 MB): jsonschema's check alone took 20 s on the event loop
    with HealthWatch(server) as watch:
        response = chat(server, KEY_A, response_format=schema_format(wide_schema(50_000)))
    assert not watch.failures and watch.slowest < 2.0, (watch.slowest, watch.failures)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "longer than 262144 characters of JSON" in error["message"]
    assert error["param"] == "structured_outputs" and error["type"] == "BadRequestError"


def test_a_schema_slow_to_check_is_checked_off_the_event_loop(server):
    # 8,500 properties fit the size cap, and jsonschema takes about 3 s to find the one bad
    # type at the end (no compile follows): the event loop answers /health meanwhile
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(8_500)}}
    schema["properties"]["f8499"] = {"type": 5}
    with HealthWatch(server) as watch:
        response = chat(server, KEY_A, response_format=schema_format(schema))
    assert not watch.failures and watch.slowest < 2.0, (watch.slowest, watch.failures)
    assert response.status_code == 400, response.text
    assert "invalid JSON schema at properties/f8499/type" in response.json()["error"]["message"]


def test_a_deep_schema_is_a_400_not_a_500(server):
    schema: dict = {"type": "string"}
    for _ in range(150):
        schema = {"type": "object", "properties": {"inner": schema}}
    for fields in ({"response_format": schema_format(schema)}, {"guided_json": json.dumps(schema)}):
        response = chat(server, KEY_A, **fields)
        assert response.status_code == 400, response.text
        assert "nests deeper than 64 levels" in response.json()["error"]["message"]


def test_an_exponential_outlines_compile_is_stopped_and_remembered(server):
    fields = {"guided_regex": "(a|b)*a(a|b){15}", "guided_decoding_backend": "outlines"}
    first = chat(server, KEY_A, **fields)
    assert first.status_code == 400, first.text
    message = first.json()["error"]["message"]
    assert f"took longer than the server's limit of {COMPILE_TIMEOUT}s" in message
    # the child process building the index is killed: its job ends instead of burning on
    deadline = time.monotonic() + 60
    while "ended after all: compiling a regex" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "ended after all: compiling a regex" in server.log()
    # asked again (by anyone), the remembered failure answers: no second compile overruns
    second = chat(server, KEY_B, **fields)
    assert second.status_code == 400 and second.json()["error"]["message"] == message
    assert server.log().count("compiling a regex overran") == 1


def test_a_request_may_name_only_the_backends_the_operator_allows(server):
    response = chat(server, KEY_A, guided_choice=["yes", "no"], guided_decoding_backend="guidance")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "does not let a request choose the guided-decoding backend 'guidance'" in error["message"]
    assert "outlines, stalling" in error["message"]
    assert error["param"] == "guided_decoding_backend"
    # the ones it allows, and no backend at all, still work
    allowed = chat(server, KEY_A, guided_choice=["yes", "no"], guided_decoding_backend="outlines")
    assert allowed.status_code == 200 and allowed.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert chat(server, KEY_A, guided_choice=["yes", "no"]).status_code == 200


def test_one_client_cannot_take_every_runaway_compile_slot(server):
    """Key A sends four schemas whose compiles stall for a minute (the test backend's stand-in
    for a pathological schema): two overrun and run away, the other two get a 429 instead of
    becoming runaways as well; key B's guided requests still compile. Before, all four ran
    away and every guided request of every client got a 429."""
    results: dict[int, httpx.Response] = {}

    def stall(index: int) -> None:
        schema = {"title": "stall", "type": "object", "properties": {f"field_{index}": {"type": "string"}}}
        results[index] = chat(server, KEY_A, response_format=schema_format(schema), guided_decoding_backend="stalling")

    threads = [threading.Thread(target=stall, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    statuses = sorted(response.status_code for response in results.values())
    assert statuses == [400, 400, 429, 429], [response.text for response in results.values()]
    for response in results.values():
        if response.status_code == 429:
            assert "2 of your constraints are still compiling" in response.json()["error"]["message"]
    # key A is refused new compiles while its runaways last...
    refused = chat(server, KEY_A, response_format=schema_format({"type": "object", "title": "a-new-one"}))
    assert refused.status_code == 429, refused.text
    # ...and key B is not
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    assert chat(server, KEY_B, response_format=schema_format(schema)).status_code == 200
