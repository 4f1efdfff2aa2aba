"""POST /v1/completions against the fake engine: response and chunk shapes, prompts of
every form, echo, logprobs, best_of, usage, errors, and aborts on disconnect."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from tests.api.conftest import client_for, sse_events
from tokenloom.core.sampling_params import RequestOutputKind

pytestmark = pytest.mark.anyio


async def test_completion_response_shape(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hello there", "max_tokens": 4})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "smollm2"
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["text"] == " The quick brown fox"
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    prompt_ids = tokenizer("Hello there")["input_ids"]
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 4,
        "total_tokens": len(prompt_ids) + 4,
    }
    [recorded] = engine.requests
    assert recorded.prompt == prompt_ids  # the API tokenizes and passes ids
    assert recorded.params.max_tokens == 4
    assert recorded.params.output_kind is RequestOutputKind.DELTA


async def test_model_alias_is_accepted_and_echoed(client):
    response = await client.post("/v1/completions", json={"model": "smol-alias", "prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200
    assert response.json()["model"] == "smol-alias"


async def test_max_tokens_defaults_to_the_rest_of_the_context(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert response.status_code == 200
    prompt_len = len(tokenizer("Hi")["input_ids"])
    assert engine.requests[0].params.max_tokens == engine.max_model_len - prompt_len


async def test_sampling_extras_reach_sampling_params(client, engine):
    body = {
        "prompt": "Hi",
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.3,
        "seed": 11,
        "stop": "xyz",
        "stop_token_ids": [2],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "min_tokens": 1,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "allowed_token_ids": [5, 6, 7],
        "bad_words": ["bad"],
        "logit_bias": {"5": 1.5},
        "priority": 3,
        "truncate_prompt_tokens": 5,
    }
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    recorded = engine.requests[0]
    params = recorded.params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 7, 0.05)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.1, 0.2, 0.3)
    assert params.seed == 11 and params.stop == ["xyz"] and params.stop_token_ids == [2]
    assert params.include_stop_str_in_output and params.ignore_eos and params.min_tokens == 1
    assert not params.skip_special_tokens and not params.spaces_between_special_tokens
    assert params.allowed_token_ids == [5, 6, 7] and params.bad_words == ["bad"]
    assert params.logit_bias == {5: 1.5}
    assert params.truncate_prompt_tokens == 5
    assert recorded.priority == 3


async def test_request_id_from_body_names_the_engine_request(client, engine):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "request_id": "abc"})
    assert response.json()["id"] == "cmpl-abc"
    assert engine.requests[0].request_id == "cmpl-abc"


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3], [4, 5]], ["Hello", "Goodbye"]])
async def test_prompt_forms_and_choice_indexes(client, engine, prompt):
    response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": 2})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    num_prompts = 1 if isinstance(prompt[0], int) else len(prompt)
    assert [choice["index"] for choice in choices] == list(range(2 * num_prompts))
    # output i of every prompt replays reply i
    assert [choice["text"] for choice in choices] == [" The quick", " Once upon"] * num_prompts
    if isinstance(prompt[0], list):
        assert [r.prompt for r in engine.requests] == prompt


async def test_echo_prepends_the_prompt(client):
    response = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "echo": True})
    assert response.json()["choices"][0]["text"] == "Hello The quick"


async def test_echo_of_token_ids_decodes_them(client, tokenizer):
    ids = tokenizer("Good morning")["input_ids"]
    response = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "echo": True})
    assert response.json()["choices"][0]["text"] == "Good morning The"


async def test_legacy_logprobs_format(client, tokenizer):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "logprobs": 1})
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [" The", " quick", " brown"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [0, 4, 10]
    assert logprobs["token_logprobs"] == pytest.approx([-0.6, -0.7, -0.8])
    # top 1 plus the chosen token when it is not the top one (step 1 puts it at rank 2)
    assert len(logprobs["top_logprobs"][0]) == 1 and " The" in logprobs["top_logprobs"][0]
    assert len(logprobs["top_logprobs"][1]) == 2 and " quick" in logprobs["top_logprobs"][1]


async def test_echo_with_logprobs_covers_the_prompt(client, engine, tokenizer):
    prompt_ids = tokenizer("Good morning to you")["input_ids"]
    response = await client.post(
        "/v1/completions", json={"prompt": prompt_ids, "max_tokens": 2, "logprobs": 1, "echo": True}
    )
    logprobs = response.json()["choices"][0]["logprobs"]
    assert engine.requests[0].params.prompt_logprobs == 1
    assert len(logprobs["tokens"]) == len(prompt_ids) + 2
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1] == pytest.approx(-1.5)


async def test_prompt_logprobs_are_returned(client):
    response = await client.post(
        "/v1/completions", json={"prompt": "Good morning", "max_tokens": 1, "prompt_logprobs": 1}
    )
    prompt_logprobs = response.json()["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    first = next(iter(prompt_logprobs[1].values()))
    assert set(first) == {"logprob", "rank", "decoded_token"}


async def test_best_of_returns_the_best_samples(client, engine):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "n": 1, "best_of": 3})
    assert response.status_code == 200
    choices = response.json()["choices"]
    # the fake engine gives output 1 the highest cumulative logprob, then output 2
    assert [(c["index"], c["text"]) for c in choices] == [(0, " Once upon a")]
    params = engine.requests[0].params
    assert params.n == 3 and params.logprobs == 0
    assert choices[0]["logprobs"] is None  # asked for internally only
    assert response.json()["usage"]["completion_tokens"] == 9


async def test_streaming_chunks_done_and_usage(client):
    response = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.startswith("data: {")  # no comment or ping lines first
    events = sse_events(response.text)
    content = events[:-1]
    assert all(event["object"] == "text_completion" and "usage" not in event for event in content)
    assert "".join(event["choices"][0]["text"] for event in content) == " The quick brown"
    assert [event["choices"][0]["finish_reason"] for event in content] == [None, None, "length"]
    assert len({event["id"] for event in events}) == 1
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 3


async def test_streaming_continuous_usage(client):
    response = await client.post(
        "/v1/completions",
        json={
            "prompt": "Hi",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True},
        },
    )
    events = sse_events(response.text)
    assert [event["usage"]["completion_tokens"] for event in events] == [1, 2, 3]


async def test_streaming_logprobs_and_echo(client):
    response = await client.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": True, "logprobs": 0, "echo": True}
    )
    events = sse_events(response.text)
    texts = [event["choices"][0]["text"] for event in events]
    assert "".join(texts) == "Hello The quick"
    assert texts[0] == "Hello The"
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert events[1]["choices"][0]["logprobs"]["tokens"] == [" quick"]
    assert events[1]["choices"][0]["logprobs"]["text_offset"] == [len("Hello The")]


async def test_streaming_echo_logprobs_of_a_choice_that_starts_late(make_app, engine):
    """The engine sends prompt logprobs once, with a request's first output; a choice whose
    first token comes in a later output still echoes them."""
    inner_generate = engine.generate

    async def staggered(prompt, sampling_params, request_id, **kwargs):
        first = True
        async for output in inner_generate(prompt, sampling_params, request_id, **kwargs):
            if first and len(output.outputs) > 1:  # choice 1 starts in the next output
                yield dataclasses.replace(output, outputs=output.outputs[:1])
                output = dataclasses.replace(output, outputs=output.outputs[1:], prompt_logprobs=None)
            first = False
            yield output

    engine.generate = staggered
    async with client_for(make_app()) as http_client:
        response = await http_client.post(
            "/v1/completions",
            json={"prompt": "Hello there", "max_tokens": 2, "n": 2, "stream": True, "logprobs": 0, "echo": True},
        )
    events = sse_events(response.text)
    for index in (0, 1):
        first = next(event["choices"][0] for event in events if event["choices"][0]["index"] == index)
        assert first["text"].startswith("Hello there")
        token_logprobs = first["logprobs"]["token_logprobs"]
        assert token_logprobs[0] is None
        assert token_logprobs[1] == pytest.approx(-1.5)  # the fake engine's prompt logprob


async def test_stop_string_reported(client):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "stop": [" brown"], "max_tokens": 10})
    choice = response.json()["choices"][0]
    assert choice["text"] == " The quick"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", " brown")


async def test_prompt_tokens_details(make_app, engine):
    engine.num_cached_tokens = 16
    async with client_for(make_app(enable_prompt_tokens_details=True)) as http_client:
        response = await http_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


async def test_return_tokens_as_token_ids(make_app, tokenizer):
    async with client_for(make_app(return_tokens_as_token_ids=True)) as http_client:
        response = await http_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 0})
    token_id = tokenizer(" The", add_special_tokens=False)["input_ids"][0]
    assert response.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{token_id}"]


# -- errors --------------------------------------------------------------------------------


def assert_error(response, status: int, param: str | None = None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    for word in words:
        assert word in error["message"]
    return error


async def test_suffix_is_a_clear_400(client):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "suffix": "end"})
    assert_error(response, 400, "suffix", "suffix is not supported")


async def test_unknown_model_is_404(client):
    response = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"})
    error = assert_error(response, 404, "model", "gpt-4", "smollm2")
    assert error["type"] == "NotFoundError"


async def test_prompt_longer_than_context_names_both_lengths(client, engine):
    prompt = [100] * (engine.max_model_len + 5)
    response = await client.post("/v1/completions", json={"prompt": prompt})
    assert_error(response, 400, None, str(engine.max_model_len), str(engine.max_model_len + 5))


async def test_prompt_plus_max_tokens_over_context(client, engine):
    response = await client.post("/v1/completions", json={"prompt": [100] * 500, "max_tokens": 20})
    assert_error(response, 400, "max_tokens", "512", "500", "20")


async def test_invalid_sampling_parameter_names_it(client):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "top_p": 1.5})
    assert_error(response, 400, "top_p", "top_p")


async def test_validation_error_lists_field_paths_without_echoing_input(client):
    huge = "x" * 100_000
    response = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "n": huge, "max_tokens": huge, "temperature": "hot", "top_k": "many", "seed": "s"},
    )
    error = assert_error(response, 400, "n", "n:", "max_tokens:", "more problem")
    assert huge not in error["message"] and len(error["message"]) < 1000


async def test_invalid_json_is_400(client):
    response = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(response, 400, None, "not valid JSON")


async def test_logprobs_over_the_server_limit(client):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 21})
    assert_error(response, 400, "logprobs", "20")


async def test_token_id_outside_vocabulary(client, tokenizer):
    response = await client.post("/v1/completions", json={"prompt": [1, len(tokenizer) + 5]})
    assert_error(response, 400, "prompt", str(len(tokenizer) + 5))


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "Hi", "stream": True, "best_of": 2}, "best_of"),
        ({"prompt": "Hi", "best_of": 1, "n": 2}, "best_of"),
        ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "Hi", "n": 0}, "n"),
    ],
)
async def test_invalid_combinations(client, body, param):
    assert_error(await client.post("/v1/completions", json=body), 400, param)


async def test_unknown_fields_are_ignored_with_one_short_line_per_request(client, caplog):
    # issue 37: each new name was logged on a line of its own and remembered for good, so
    # requests inventing thousands of fields wrote thousands of lines and grew the server
    caplog.set_level("WARNING", logger="tokenloom.api")
    invented = {f"field_{index}": 1 for index in range(2000)}
    invented["X" * 1000] = 1  # upper case: named first (the names are sorted)
    invented["Line\nbreak"] = 1
    for _ in range(3):
        response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **invented})
        assert response.status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 3
    for message in warnings:
        assert message.startswith("/v1/completions: the following fields were present in the request but ignored: ")
        assert "\n" not in message and len(message) < 2000
        assert message.endswith(" and 1986 more")
    assert "'Line\\nbreak'" in warnings[0] and "'" + "X" * 61 + "...'" in warnings[0]
    known = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert known.status_code == 200
    assert len([r for r in caplog.records if "ignored" in r.getMessage()]) == 3


async def test_engine_not_running_is_503(client, engine):
    engine.is_running = False
    response = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert_error(response, 503)
    engine.is_running, engine.errored = True, True
    assert_error(await client.post("/v1/completions", json={"prompt": "Hi"}), 503, None, "stopped")


async def test_engine_validation_error_before_first_output_is_a_400(client, engine):
    from tokenloom.errors import InvalidRequestError

    engine.fail_at_start = InvalidRequestError("structured output constraint is invalid", param="guided_json")
    for stream in (False, True):
        response = await client.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
        assert_error(response, 400, "guided_json")


async def test_unexpected_failure_is_a_generic_500_and_others_still_work(client, engine, caplog):
    engine.fail_at_start = RuntimeError("secret internal detail")
    response = await client.post("/v1/completions", json={"prompt": "Hi"}, headers={"X-Request-Id": "req-9"})
    error = assert_error(response, 500, None, "req-9")
    assert "secret" not in error["message"]
    assert any("req-9" in r.getMessage() for r in caplog.records)
    engine.fail_at_start = None
    assert (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).status_code == 200


async def test_failure_midway_through_a_stream_sends_an_error_event(client, engine):
    engine.fail_after_steps = 2
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "stream": True})
    events = sse_events(response.text)
    assert [e["choices"][0]["text"] for e in events[:2]] == [" The", " quick"]
    assert events[-1]["error"]["code"] == 500


# -- disconnects ---------------------------------------------------------------------------


async def call_and_disconnect(app, path: str, body: dict, disconnect_after_chunks: int | None):
    """Drives the ASGI app directly: the client disconnects after some body chunks (or,
    for a non-streaming request, while it waits), and the app must return promptly."""
    payload = json.dumps(body).encode()
    sent_body = False
    disconnect = asyncio.Event()
    chunks: list[bytes] = []

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if disconnect_after_chunks is not None and len(chunks) >= disconnect_after_chunks:
                disconnect.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("test", 1),
        "server": ("test", 80),
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    if disconnect_after_chunks is None:
        await asyncio.sleep(0.2)
        disconnect.set()
    await asyncio.wait_for(task, timeout=5)
    return chunks


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 50, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "stream": True}),
    ],
)
async def test_stream_disconnect_aborts_the_request(make_app, engine, path, body):
    engine.step_delay = 0.02
    chunks = await call_and_disconnect(make_app(), path, body, disconnect_after_chunks=2)
    assert len(chunks) < 10
    assert len(engine.aborted) == 1 and engine.aborted[0] == engine.requests[0].request_id


async def test_non_streaming_disconnect_aborts_the_request(make_app, engine):
    engine.step_delay = 0.05
    await call_and_disconnect(
        make_app(), "/v1/completions", {"prompt": "Hi", "max_tokens": 50}, disconnect_after_chunks=None
    )
    assert engine.aborted == [engine.requests[0].request_id]


async def test_multi_prompt_stream_disconnect_aborts_every_prompt(make_app, engine):
    engine.step_delay = 0.02
    await call_and_disconnect(
        make_app(),
        "/v1/completions",
        {"prompt": ["Hi", "Bye", "Yo"], "max_tokens": 50, "stream": True},
        disconnect_after_chunks=3,
    )
    assert sorted(engine.aborted) == sorted(r.request_id for r in engine.requests)
    assert len(engine.aborted) == 3


async def test_null_fields_mean_the_default(client, engine):
    response = await client.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "n": None, "stream": None, "temperature": None, "echo": None},
    )
    assert response.status_code == 200, response.text
    assert engine.requests[0].params.n == 1 and engine.requests[0].params.temperature == 1.0


async def test_requests_are_logged_only_with_enable_log_requests_and_max_log_len_honoured(make_app, caplog):
    caplog.set_level("INFO", logger="tokenloom.api")
    async with client_for(make_app(enable_log_requests=True, max_log_len=5)) as http_client:
        await http_client.post("/v1/completions", json={"prompt": "abcdefghijklmnop", "max_tokens": 1})
    [logged] = [r.getMessage() for r in caplog.records if "received request" in r.getMessage()]
    assert "'abcde'" in logged and "abcdef" not in logged
    assert "prompt_token_ids: [" in logged and logged.split("prompt_token_ids: [")[1].split("]")[0].count(",") <= 4
    caplog.clear()
    async with client_for(make_app()) as http_client:  # the default: prompts are private data, never logged
        await http_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert not [r for r in caplog.records if "received request" in r.getMessage() or "'Hi'" in r.getMessage()]


# -- issue 19: fields that are honoured or refused by name, never dropped -------------------------


async def test_priority_is_refused_under_fcfs_and_passed_on_under_priority(client, engine):
    engine.scheduling_policy = "fcfs"
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "priority": -2})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in response.json()["error"]["message"]
    assert not engine.requests
    engine.scheduling_policy = "priority"
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "priority": -2})
    assert response.status_code == 200 and engine.requests[0].priority == -2


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"stop": ["."]}, "stop"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"top_p": 0.5}, "top_p"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"guided_choice": ["a", "b"]}, "use_beam_search"),
        ({"n": 11}, "n"),  # 22 logprobs per step, over --max-logprobs 20
    ],
)
async def test_beam_search_refuses_what_it_cannot_honour(client, engine, extra, param):
    body = {"prompt": "Hi", "max_tokens": 2, "use_beam_search": True, **extra}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not engine.requests


async def test_logits_processors_on_an_engine_without_them_are_refused(client, engine):
    response = await client.post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logits_processors": ["no_repeat_ngram"]}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "logits_processors"


async def test_logits_processors_reach_sampling_params_as_specs(client, engine):
    from tokenloom.core.logits_processors import LogitsProcessorResolver, LogitsProcessorSpec
    from tokenloom.plugins.registry import Registry

    registry = Registry("logits_processor")
    registry.register("ban", "tests.core.test_logits_processors:BanTokens", plugin_name="test")
    engine.logits_processor_resolver = LogitsProcessorResolver(registry, None)
    body = {"prompt": "Hi", "max_tokens": 1, "logits_processors": [{"qualname": "ban", "args": [4]}]}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert engine.requests[0].params.logits_processors == [
        LogitsProcessorSpec("ban", "tests.core.test_logits_processors:BanTokens", (4,), {})
    ]


@pytest.mark.parametrize("extra", [{"length_penalty": 0.5}, {"early_stopping": True}], ids=["length_penalty", "early"])
async def test_beam_search_options_without_beam_search_are_refused(client, engine, extra):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == next(iter(extra))
    assert "use_beam_search" in response.json()["error"]["message"]
