"""POST /v1/messages and /v1/messages/count_tokens against the fake engine: system prompt and
content blocks to chat messages, tools / tool_choice / thinking / output_config to the chat
request, content blocks and stop reasons whole and streamed (any split gives the whole text's
blocks), Anthropic's event order, ``x-api-key``, and every error in Anthropic's shape."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import client_for
from tests.api.test_serving_chat_tools import (
    CALLS_REPLY,
    THINKING_REPLY,
)
from tests.api.test_serving_responses import (  # noqa: F401 (chat_handler: a fixture)
    app_with,
    chat_handler,
    output_of,
    random_splits,
    sse_blocks,
)
from tests.builtin_plugins.tool_parsers.formats import TIME, WEATHER
from tokenloom.api.messages_protocol import (
    MessagesInput,
    MessagesRequest,
    content_blocks,
    stop_reason_of,
)
from tokenloom.api.protocol import ChatCompletionRequest
from tokenloom.api.serving_base import ChoiceState
from tokenloom.api.serving_messages import MessagesEventWriter
from tokenloom.core.outputs import CompletionOutput
from tokenloom.errors import InvalidRequestError

TOOLS = [
    {
        "name": name,
        "description": f"{name} of a place",
        "input_schema": {"type": "object", "properties": {key: {"type": "string"} for key in arguments}},
    }
    for name, arguments in (WEATHER, TIME)
]


def test_blocks_become_chat_messages():
    request = MessagesInput(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "22 C"}]},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "22 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "system", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0].source"),
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages[0].content[0].type"),
        (
            [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"type": "tool_result"}]}], "messages[0].content[0].tool_use_id"),
    ],
)
def test_bad_blocks_name_the_block(messages, param):
    with pytest.raises(InvalidRequestError) as caught:
        MessagesInput(messages=messages).chat_messages()
    assert caught.value.param == param


def test_tools_tool_choice_thinking_and_output_config_map_to_chat():
    request = MessagesRequest(
        max_tokens=5,
        messages=[{"role": "user", "content": "x"}],
        tools=TOOLS,
        thinking={"type": "disabled"},
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "low"},
    )
    assert request.chat_tools()[0]["function"] == {
        "name": "get_weather",
        "description": "get_weather of a place",
        "parameters": TOOLS[0]["input_schema"],
    }
    assert request.template_kwargs() == {"enable_thinking": False, "reasoning_effort": "low"}
    assert request.response_format().json_schema["schema"] == {"type": "object"}

    def choice(tool_choice):
        return MessagesInput(messages=[{"role": "user", "content": "x"}], tool_choice=tool_choice).chat_tool_choice()

    assert choice({"type": "auto"}) == ("auto", None)
    assert choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert choice({"type": "none"}) == ("none", None)
    assert choice({"type": "tool", "name": "get_time"}) == (
        {"type": "function", "function": {"name": "get_time"}},
        None,
    )
    with pytest.raises(InvalidRequestError):
        choice({"type": "sometimes"})
    with pytest.raises(InvalidRequestError, match="client tools only"):
        MessagesInput(
            messages=[{"role": "user", "content": "x"}], tools=[{"type": "bash_20250124", "name": "bash"}]
        ).chat_tools()


def test_stop_reasons():
    assert stop_reason_of("stop", None, False) == ("end_turn", None)
    assert stop_reason_of("stop", 2, False) == ("end_turn", None)  # the EOS token id
    assert stop_reason_of("stop", "###", False) == ("stop_sequence", "###")
    assert stop_reason_of("length", None, False) == ("max_tokens", None)
    assert stop_reason_of("tool_calls", None, True) == ("tool_use", None)


def blocks_without_ids(blocks: list[dict]) -> list[dict]:
    return [{key: value for key, value in block.items() if key != "id"} for block in blocks]


def streamed_blocks(events: list[dict]) -> list[dict]:
    """The content blocks a client assembles from the events (as the anthropic client does)."""
    blocks: list[dict] = []
    partial_json: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial_json[event["index"]] = partial_json.get(event["index"], "") + delta["partial_json"]
        elif event["type"] == "content_block_stop" and event["index"] in partial_json:
            blocks[event["index"]]["input"] = json.loads(partial_json[event["index"]])
    return blocks


@pytest.mark.anyio
@pytest.mark.parametrize("reply", [CALLS_REPLY, THINKING_REPLY, "Plain text."], ids=["calls", "think", "text"])
async def test_any_split_of_the_output_gives_the_whole_outputs_blocks(chat_handler, reply):  # noqa: F811
    chat_request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        request_id="r",
        tools=[{"type": "function", "function": {"name": name}} for name, _ in (WEATHER, TIME)],
        tool_choice="auto",
    )
    run, outputs = await chat_handler.start(chat_request, None)
    await outputs.aclose()
    state = ChoiceState()
    state.add(CompletionOutput(0, reply, [0], None, None, "stop", None))
    expected = blocks_without_ids(content_blocks(run.choice(0, state).message))
    for pieces in [list(reply)] + [random_splits(reply, seed) for seed in range(20)]:
        run, outputs = await chat_handler.start(chat_request, None)
        await outputs.aclose()
        writer, states, cached, events = MessagesEventWriter(), {}, {"tokens": 0}, []
        for index, piece in enumerate(pieces):
            finish = "stop" if index == len(pieces) - 1 else None
            for delta in run.deltas(output_of(piece, finish), states, cached):
                events += writer.add(delta.delta)
        events += writer.close_current()
        assert blocks_without_ids(streamed_blocks(sse_blocks("".join(events)))) == expected, pieces


@pytest.mark.anyio
async def test_whole_and_streamed_messages_agree_in_anthropic_shapes(make_app, tokenizer):
    engine, app = app_with(make_app, tokenizer, THINKING_REPLY)
    body = {
        "model": "smollm2",
        "max_tokens": 200,
        "tools": TOOLS,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    async with client_for(app) as http_client:
        whole = (await http_client.post("/v1/messages", json=body)).json()
        assert whole["type"] == "message" and whole["role"] == "assistant" and whole["id"].startswith("msg_")
        assert [block["type"] for block in whole["content"]] == ["thinking", "tool_use"]
        assert whole["content"][1]["input"] == WEATHER[1] and whole["content"][1]["id"].startswith("toolu_")
        assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
        assert whole["usage"]["input_tokens"] == len(engine.requests[0].prompt_token_ids)
        prompt = tokenizer.decode(engine.requests[0].prompt_token_ids)
        assert "Be brief." in prompt and '"get_weather"' in prompt

        counted = (
            await http_client.post(
                "/v1/messages/count_tokens", json={key: value for key, value in body.items() if key != "max_tokens"}
            )
        ).json()
        assert counted == {"input_tokens": whole["usage"]["input_tokens"]}

        events = sse_blocks((await http_client.post("/v1/messages", json={**body, "stream": True})).text)
    types = [event["type"] for event in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["output_tokens"] == 0
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": whole["usage"]["output_tokens"]}
    assert blocks_without_ids(streamed_blocks(events)) == blocks_without_ids(whole["content"])


@pytest.mark.anyio
async def test_stop_sequences_and_max_tokens(make_app, tokenizer):
    _, app = app_with(make_app, tokenizer, " Paris is the capital of France.")
    async with client_for(app) as http_client:
        ask = {"max_tokens": 50, "messages": [{"role": "user", "content": "Capital?"}]}
        stopped = (await http_client.post("/v1/messages", json={**ask, "stop_sequences": ["capital"]})).json()
        assert stopped["content"] == [{"type": "text", "text": " Paris is the "}]
        assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "capital")
        cut = (await http_client.post("/v1/messages", json={**ask, "max_tokens": 2})).json()
        assert cut["stop_reason"] == "max_tokens" and cut["usage"]["output_tokens"] == 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "max_tokens: Field required"),
        ({"max_tokens": 10, "messages": []}, 400, "messages"),
        ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}, 400, "lower max_tokens"),
        ({"max_tokens": 10, "model": "claude-x", "messages": [{"role": "user", "content": "hi"}]}, 404, "claude-x"),
        (
            {"max_tokens": 10, "stop_sequences": "x", "messages": [{"role": "user", "content": "hi"}]},
            400,
            "stop_sequences",
        ),
    ],
)
async def test_errors_are_anthropic_shaped(client, body, status, words):
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert words in payload["error"]["message"], payload


@pytest.mark.anyio
async def test_bad_json_is_an_anthropic_400(client):
    response = await client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.anyio
async def test_x_api_key_is_accepted_and_a_missing_key_is_an_anthropic_401(make_app):
    app = make_app(api_key="sekret")
    ask = {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with client_for(app) as http_client:
        assert (await http_client.post("/v1/messages", json=ask, headers={"x-api-key": "sekret"})).status_code == 200
        assert (
            await http_client.post("/v1/messages", json=ask, headers={"Authorization": "Bearer sekret"})
        ).status_code == 200
        refused = await http_client.post("/v1/messages", json=ask, headers={"x-api-key": "wrong"})
        assert refused.status_code == 401
        assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "authentication_error"
        # the OpenAI routes take x-api-key too, and keep their own error shape
        assert (await http_client.get("/v1/models", headers={"x-api-key": "sekret"})).status_code == 200
        assert (await http_client.get("/v1/models")).json()["error"]["type"] == "AuthenticationError"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "tool_choice, reply",
    [
        ({"type": "tool", "name": "get_weather"}, json.dumps(WEATHER[1])),
        ({"type": "any"}, json.dumps([{"name": WEATHER[0], "parameters": WEATHER[1]}])),
    ],
    ids=["tool", "any"],
)
async def test_forced_tool_choice_gives_tool_use_whole_and_streamed(make_app, tokenizer, tool_choice, reply):
    engine, app = app_with(make_app, tokenizer, reply)
    body = {
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
    }
    async with client_for(app) as http_client:
        whole = (await http_client.post("/v1/messages", json=body)).json()
        events = sse_blocks((await http_client.post("/v1/messages", json={**body, "stream": True})).text)
    assert [(block["type"], block["name"], block["input"]) for block in whole["content"]] == [("tool_use", *WEATHER)]
    assert whole["stop_reason"] == "tool_use" and events[-2]["delta"]["stop_reason"] == "tool_use"
    assert blocks_without_ids(streamed_blocks(events)) == blocks_without_ids(whole["content"])
    assert engine.requests[0].params.structured_outputs is not None


@pytest.mark.anyio
async def test_the_openapi_document_describes_both_apis(client):
    paths = (await client.get("/openapi.json")).json()["paths"]
    body = paths["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"max_tokens", "messages", "system", "tools"} <= set(body["properties"])
    assert "requestBody" in paths["/v1/messages/count_tokens"]["post"]
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"} <= set(paths)
