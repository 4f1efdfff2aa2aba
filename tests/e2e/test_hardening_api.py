"""Issue 37's API-layer items against the real `tokenloom serve smollm2`: a large prompt is
tokenized while /health still answers, two requests with one id both end (one 400 naming
request_id if they meet), the Responses store stays within --responses-store-max-bytes,
unknown fields cost one log line per request, and NaN / Infinity / shadowing template
kwargs are 400s."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
STORE_MAX_BYTES = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    running = start_server(
        [
            "smollm2",
            "--max-model-len",
            "1024",
            "--responses-store-max-bytes",
            str(STORE_MAX_BYTES),
            # the log test counts lines: no access log and no periodic stats line in between
            "--disable-uvicorn-access-log",
            "--disable-log-stats",
        ],
        log_path,
    )
    yield running
    stop_server(running)


def test_health_answers_within_2_s_while_an_8_mib_prompt_is_tokenized(server):
    # item 6: /v1/completions tokenized on the event loop; an 8 MiB prompt stalled /health 16.9 s
    prompt = "All work and no play makes Jack a dull boy. " * (8 * 1024 * 1024 // 44)

    async def run() -> tuple[httpx.Response, list[float]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as http:
            hostile = asyncio.ensure_future(
                http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            )
            waits = []
            while not hostile.done():
                started = time.monotonic()
                health = await http.get("/health", timeout=30)
                waits.append(time.monotonic() - started)
                assert health.status_code == 200
                await asyncio.sleep(0.25)
            return await hostile, waits

    hostile, waits = asyncio.run(run())
    assert hostile.status_code == 400 and "maximum context length" in hostile.json()["error"]["message"]
    assert max(waits) < 2.0, f"/health took up to {max(waits):.1f} s while the prompt was tokenized"
    assert len(waits) >= 3, "the prompt was tokenized too fast to watch /health meanwhile"


def fresh_schema() -> dict:
    """A schema no request has compiled yet (so the request waits for its compile)."""
    tag = uuid.uuid4().hex[:8]
    properties = {f"field_{tag}_{index}": {"type": "string", "maxLength": 12} for index in range(24)}
    return {"type": "object", "properties": properties, "required": list(properties)[:4]}


@pytest.mark.parametrize("how", ["body", "header"])
def test_two_requests_with_one_id_both_end_and_a_loser_is_a_400(server, how):
    # item 4: the id check and the stream's registration were split by the schema's compile: the
    # second request took over the first one's stream and the first never answered (3 of 3)
    request_id = f"dup-{uuid.uuid4().hex}"

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:

            async def send() -> httpx.Response:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Fill in the form."}],
                    "max_tokens": 8,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": fresh_schema()}},
                }
                if how == "body":
                    return await http.post("/v1/chat/completions", json={**body, "request_id": request_id})
                return await http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": request_id})

            return await asyncio.wait_for(asyncio.gather(send(), send()), 60)

    responses = asyncio.run(run())  # a hang fails here, after a minute
    statuses = sorted(response.status_code for response in responses)
    assert statuses in ([200, 200], [200, 400]), [response.text for response in responses]
    for response in responses:
        if response.status_code == 400:
            error = response.json()["error"]
            assert error["param"] == "request_id" and "already in use" in error["message"]
    # the id is free again once both ended
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "request_id": request_id}
    assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_the_responses_store_stays_within_its_bound(server):
    # item 5: 1,000 entries of any size; reasoning (and text.format) still take any JSON, so the
    # store must be bounded by bytes: 12 responses of about 1 MiB each into a 4 MiB store
    junk = "x" * (1024 * 1024)
    made = []
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for index in range(12):
            body = {
                "model": MODEL,
                "input": f"Say {index}.",
                "max_output_tokens": 2,
                "reasoning": {"effort": None, "note": junk},
                "metadata": {f"k{key}": "v" * 512 for key in range(16)},
            }
            response = http.post("/v1/responses", json=body)
            assert response.status_code == 200, response.text
            made.append(response.json()["id"])
        kept = [http.get(f"/v1/responses/{response_id}") for response_id in made]
        stored = [response for response in kept if response.status_code == 200]
        assert 0 < len(stored) < len(made)
        assert sum(len(response.content) for response in stored) <= STORE_MAX_BYTES
        assert [response.json()["id"] for response in stored] == made[-len(stored) :]  # the newest stay
        # OpenAI's metadata limits
        too_long = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "metadata": {"k": "v" * 513}})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "metadata.k"


def test_unknown_fields_grow_the_log_by_at_most_a_line_per_request(server):
    # item 9: each new field name was logged on a line of its own and remembered for good
    def num_lines() -> int:
        return server.log().count("\n")

    before = num_lines()
    for request in range(3):
        invented = {f"invented_{request}_{index}": index for index in range(20_000)}
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **invented}
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
    time.sleep(0.5)  # the log is written by the server process
    assert num_lines() - before <= 3
    assert server.log().count("were present in the request but ignored") >= 3


@pytest.mark.parametrize(
    "path, text, param",
    [
        ("/v1/completions", '{"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "temperature": NaN}', "temperature"),
        (
            "/v1/chat/completions",
            '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
            '"logit_bias": {"42": Infinity}}',
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
            '"chat_template_kwargs": {"raise_exception": "nothing"}}',
            "chat_template_kwargs",
        ),
    ],
)
def test_non_finite_numbers_and_shadowing_template_kwargs_are_400s(server, path, text, param):
    # item 12: NaN and Infinity were accepted (an empty output); kwargs could replace template globals
    response = httpx.post(
        server.base_url + path, content=text.encode(), headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") + error["message"]


def test_an_image_to_a_text_only_model_is_a_400_naming_the_part(server):
    # issue 35: the chat image part is read, and refused by the model that cannot see it
    image_url = "data:image/png;base64,iVBORw0KGgo="
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": image_url}}],
        }
    ]
    response = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 1},
        timeout=60,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and f"{MODEL} takes text only" in error["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200
