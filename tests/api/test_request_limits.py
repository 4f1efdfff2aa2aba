"""Request fields whose cost grows with their size are capped with a 400 that names the field;
text that is not valid Unicode is a 400 wherever it hides; a full queue is a 429 with
Retry-After; cache_salt reaches the engine (against the fake engine)."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import client_for
from tests.api.fake_engine import FakeEngine, LoopRecordingTokenizer
from tokenloom.api.prompt_inputs import OFF_LOOP_DETOKENIZE_TOKENS, OFF_LOOP_TOKENIZE_CHARS
from tokenloom.core.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tokenloom.errors import OverloadedError

pytestmark = pytest.mark.anyio

COMPLETION = {"prompt": "Hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def raw_json(body: dict) -> dict:
    """Request kwargs sending ``body`` as JSON with \\u escapes, so lone surrogates survive."""
    return {"content": json.dumps(body).encode("ascii"), "headers": {"content-type": "application/json"}}


async def assert_bad_request(response, param_fragment: str, message_fragment: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param_fragment in (error["param"] or "") + error["message"]
    assert message_fragment in error["message"]


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n", 257, "at most 256 (the server's --max-num-seqs)"),
        ("best_of", 1_000_000, "at most 256"),
        ("stop", [f"s{index}" for index in range(MAX_STOP_STRINGS + 1)], f"at most {MAX_STOP_STRINGS}"),
        ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)], f"at most {MAX_STOP_STRING_CHARS}"),
        (
            "logit_bias",
            {str(token): 1.0 for token in range(MAX_LOGIT_BIAS_ENTRIES + 1)},
            f"at most {MAX_LOGIT_BIAS_ENTRIES}",
        ),
        ("allowed_token_ids", list(range(49153)), "more than the vocabulary's 49152"),
        ("cache_salt", "", "non-empty string"),
    ],
)
async def test_oversized_fields_are_400s_naming_the_field(client, engine, path, body, field, value, message):
    response = await client.post(path, json={**body, field: value})
    await assert_bad_request(response, field, message)
    assert engine.requests == []


async def test_n_is_capped_by_the_engines_max_num_seqs(make_app, engine):
    engine.max_num_seqs = 4
    async with client_for(make_app()) as http_client:
        await assert_bad_request(
            await http_client.post("/v1/completions", json={**COMPLETION, "n": 5}), "n", "at most 4"
        )
        assert (await http_client.post("/v1/completions", json={**COMPLETION, "n": 4})).status_code == 200


NON_FINITE_CASES = [
    (path, body, field, literal)
    for path, body, fields in (
        ("/v1/completions", COMPLETION, ("temperature", "top_p", "logit_bias")),
        ("/v1/chat/completions", CHAT, ("temperature", "top_p", "logit_bias")),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}, ("temperature", "top_p")),
        ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, ("temperature",)),
    )
    for field in fields
    for literal in (("NaN", "Infinity") if field != "logit_bias" else ('{"42": Infinity}', '{"42": NaN}'))
]


@pytest.mark.parametrize("path, body, field, literal", NON_FINITE_CASES)
async def test_nan_and_infinity_are_400s_naming_the_field(client, engine, path, body, field, literal):
    # issue 37: Python's JSON reader takes NaN and Infinity; they were accepted and emptied the output
    text = json.dumps(body)[:-1] + f', "{field}": {literal}}}'
    response = await client.post(path, content=text.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert field in message and "finite" in message
    assert engine.requests == []


LONE_SURROGATE = "\ud800"


@pytest.mark.parametrize(
    "path, body, where",
    [
        ("/v1/completions", {**COMPLETION, "prompt": f"a{LONE_SURROGATE}b"}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["ok", LONE_SURROGATE]}, "prompt.1"),
        ("/v1/completions", {**COMPLETION, "stop": [LONE_SURROGATE]}, "stop.0"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": LONE_SURROGATE}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages.0.content.0.text",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {LONE_SURROGATE: {"type": "string"}}},
                        },
                    }
                ],
            },
            "tools.0.function.parameters.properties",
        ),
        ("/v1/chat/completions", {**CHAT, "cache_salt": LONE_SURROGATE}, "cache_salt"),
        ("/tokenize", {"prompt": LONE_SURROGATE}, "prompt"),
        ("/detokenize", {"tokens": [1], "model": LONE_SURROGATE}, "model"),
    ],
)
async def test_unencodable_text_is_a_400_wherever_it_is(client, engine, path, body, where):
    response = await client.post(path, **raw_json(body))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert where in message and "not valid Unicode" in message
    assert engine.requests == []


async def test_a_full_queue_is_a_429_with_retry_after(make_app, engine):
    engine.fail_at_start = OverloadedError("1024 requests are already waiting (--max-waiting-requests 1024)")
    async with client_for(make_app()) as http_client:
        response = await http_client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "RateLimitError"


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_cache_salt_reaches_the_engine(client, engine, path, body):
    assert (await client.post(path, json={**body, "cache_salt": "tenant-7f3a"})).status_code == 200
    assert engine.requests[-1].params.cache_salt == "tenant-7f3a"
    assert (await client.post(path, json=body)).status_code == 200
    assert engine.requests[-1].params.cache_salt is None


# -- large request input is tokenized and detokenized off the event loop (issue 37) ----------


@pytest.fixture
def recording(tokenizer):
    return LoopRecordingTokenizer(tokenizer)


@pytest.fixture
async def recording_client(make_app, recording, tokenizer):
    app = make_app(engine=FakeEngine(tokenizer, max_model_len=1024))
    app.state.serving.tokenizer = recording  # the server's calls only, not the fake engine's
    async with client_for(app) as http_client:
        yield http_client


LARGE_TEXT = "tokenize me " * (OFF_LOOP_TOKENIZE_CHARS // 12 + 1)


async def test_a_large_completion_prompt_is_tokenized_off_the_loop(recording_client, recording):
    # issue 37: /v1/completions tokenized on the loop, so an 8 MiB prompt stalled /health 17 s
    response = await recording_client.post("/v1/completions", json={"prompt": LARGE_TEXT, "max_tokens": 1})
    await assert_bad_request(response, "prompt", "maximum context length")
    assert recording.on_loop("encode") == [False]
    recording.calls.clear()
    batch = ["tokenize me " * 40] * (OFF_LOOP_TOKENIZE_CHARS // 480 + 1)  # many short prompts: large together
    response = await recording_client.post("/v1/completions", json={"prompt": batch, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert set(recording.on_loop("encode")) == {False}
    recording.calls.clear()
    assert (await recording_client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert set(recording.on_loop("encode")) == {True}  # small prompts skip the thread hop


async def test_many_token_id_prompts_are_decoded_off_the_loop(recording_client, recording):
    prompts = [[42] * 1000] * (OFF_LOOP_DETOKENIZE_TOKENS // 1000 + 1)
    response = await recording_client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert set(recording.on_loop("decode")) == {False}


async def test_tokenize_and_detokenize_large_input_off_the_loop(recording_client, recording, tokenizer):
    response = await recording_client.post(
        "/tokenize", json={"prompt": LARGE_TEXT, "add_special_tokens": False, "return_token_strs": True}
    )
    expected = tokenizer(LARGE_TEXT, add_special_tokens=False)["input_ids"]
    assert response.json()["tokens"] == expected
    assert response.json()["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    assert recording.on_loop("encode") == [False] and recording.on_loop("tokens") == [False]
    tokens = [42] * OFF_LOOP_DETOKENIZE_TOKENS
    response = await recording_client.post("/detokenize", json={"tokens": tokens})
    assert response.json()["prompt"] == tokenizer.decode(tokens)
    assert recording.on_loop("decode") == [False]
    # the vocabulary check runs with them and is still a 400
    response = await recording_client.post("/detokenize", json={"tokens": tokens + [10**9]})
    await assert_bad_request(response, "tokens", "outside the vocabulary")
