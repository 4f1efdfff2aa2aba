"""POST /v1/responses against the fake engine: input items to chat messages, tools, tool choice
and text.format to the chat request, output items whole and streamed (any split of the model's
text gives the same items as the whole text, through the same registered parsers as chat),
OpenAI's event order, the LRU store with per-key visibility, previous_response_id, background
responses and their cancellation, and 4xx errors that name the Responses parameter."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from tests.api.conftest import client_for
from tests.api.fake_engine import FakeEngine
from tests.api.test_serving_chat_tools import (
    CALLS_REPLY,
    HERMES_TEMPLATE,
    THINKING_REPLY,
)
from tests.builtin_plugins.tool_parsers.formats import TIME, WEATHER
from tokenloom.api.protocol import ChatCompletionRequest
from tokenloom.api.response_store import ResponseStore, StoredResponse
from tokenloom.api.responses_protocol import (
    MessageItem,
    ResponseObject,
    ResponsesRequest,
    input_messages,
    message_items,
)
from tokenloom.api.server_config import ServerConfig
from tokenloom.api.serving_base import ServingContext
from tokenloom.api.serving_chat import ChatHandler
from tokenloom.api.serving_responses import ResponsesEventWriter
from tokenloom.chat_template import ChatRenderer, load_chat_template
from tokenloom.core.outputs import CompletionOutput, RequestOutput
from tokenloom.errors import InvalidRequestError, NotFoundError
from tokenloom.plugins.manager import load_plugins

TOOLS = [
    {
        "type": "function",
        "name": name,
        "description": f"{name} of a place",
        "parameters": {"type": "object", "properties": {key: {"type": "string"} for key in arguments}},
    }
    for name, arguments in (WEATHER, TIME)
]


def sse_blocks(body: str) -> list[dict]:
    """Each event's data, after checking its ``event:`` line names the data's type."""
    events = []
    for block in filter(None, body.split("\n\n")):
        event_line, data_line = block.split("\n")
        event = json.loads(data_line[len("data: ") :])
        assert event_line == f"event: {event['type']}"
        events.append(event)
    return events


def app_with(make_app, tokenizer, reply: str, **config):
    engine = FakeEngine(tokenizer, replies=(reply,))
    config.setdefault("tool_call_parser", "hermes")
    config.setdefault("enable_auto_tool_choice", True)
    config.setdefault("chat_template", HERMES_TEMPLATE)
    return engine, make_app(engine=engine, plugins=load_plugins(), reasoning_parser="qwen3", **config)


def items_without_ids(output: list[dict]) -> list[dict]:
    return [{key: value for key, value in item.items() if key not in ("id", "call_id")} for item in output]


# -- input translation ---------------------------------------------------------------------------


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "14:05"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "items, param",
    [
        ([{"role": "robot", "content": "x"}], "input[0].role"),
        ([{"role": ["user"], "content": "x"}], "input[0].role"),  # not a string: once a TypeError (a 500)
        ([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}], "input[0].content[0]"),
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        (["just a string"], "input[0]"),
    ],
)
def test_bad_input_items_name_the_item(items, param):
    with pytest.raises(InvalidRequestError) as caught:
        input_messages(items)
    assert caught.value.param == param


def test_tools_tool_choice_and_text_format_map_to_chat():
    request = ResponsesRequest(
        input="x",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}},
        reasoning={"effort": "low"},
    )
    assert request.chat_tools()[0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "get_weather of a place",
            "parameters": TOOLS[0]["parameters"],
        },
    }
    assert request.chat_tool_choice() == {"type": "function", "function": {"name": "get_time"}}
    assert request.response_format().json_schema == {"name": "p", "schema": {"type": "object"}}
    assert request.template_kwargs() == {"reasoning_effort": "low"}
    # an unset tool_choice is chat's default (no --enable-auto-tool-choice needed); an explicit one is passed on
    assert ResponsesRequest(input="x").chat_tool_choice() is None
    assert ResponsesRequest(input="x", tool_choice="auto").chat_tool_choice() == "auto"
    assert ResponsesRequest(input="x", text={"format": {"type": "json_object"}}).response_format().type == "json_object"
    with pytest.raises(InvalidRequestError, match="function tools only"):
        ResponsesRequest(input="x", tools=[{"type": "web_search"}]).chat_tools()
    with pytest.raises(InvalidRequestError) as caught:
        ResponsesRequest(input="x", text={"format": {"type": "json_schema"}}).response_format()
    assert caught.value.param == "text.format.schema"


# -- the store -----------------------------------------------------------------------------------


def stored(response_id: str, owner: str | None = None) -> StoredResponse:
    return StoredResponse(ResponseObject(id=response_id, model="m"), [], owner)


def test_store_drops_the_least_recently_used_and_hides_other_owners():
    store = ResponseStore(max_entries=2)
    store.put(stored("a", "alice"))
    store.put(stored("b", "alice"))
    store.get("a", "alice")  # "b" is now the least recently used
    store.put(stored("c", "alice"))
    assert len(store) == 2 and store.get("a", "alice") and store.get("c", "alice")
    with pytest.raises(NotFoundError):
        store.get("b", "alice")
    with pytest.raises(NotFoundError):
        store.get("a", "bob")
    store.delete("a", "alice")
    with pytest.raises(NotFoundError):
        store.get("a", "alice")
    nothing_kept = ResponseStore(max_entries=0)
    nothing_kept.put(stored("d"))
    assert len(nothing_kept) == 0


def test_store_is_bounded_in_bytes_dropping_the_least_recently_used():
    # issue 37: 1,000 entries of unbounded size (metadata, tools, text.format, a long chain of
    # turns) let a client grow the server by gigabytes
    def sized(response_id: str, num_chars: int) -> StoredResponse:
        return StoredResponse(
            ResponseObject(id=response_id, model="m"), [{"role": "user", "content": "x" * num_chars}], None
        )

    entry_bytes = sized("a", 1000).num_bytes()
    assert 1000 < entry_bytes < 2000  # the response's JSON and the conversation's
    store = ResponseStore(max_entries=100, max_bytes=3 * entry_bytes)
    for response_id in "abc":
        assert store.put(sized(response_id, 1000))
    store.get("a", None)  # "b" is now the least recently used
    assert store.put(sized("d", 1000))
    assert store.num_bytes == 3 * entry_bytes and len(store) == 3
    with pytest.raises(NotFoundError):
        store.get("b", None)
    assert store.put(sized("e", 1900))  # about two entries' worth: the two least recently used go
    assert list(store._entries) == ["d", "e"] and store.num_bytes <= store.max_bytes
    # an entry larger than the whole store is not kept, nor is an earlier version of it
    assert not store.put(sized("d", 4 * entry_bytes))
    assert list(store._entries) == ["e"]
    store.delete("e", None)
    assert store.num_bytes == 0 and len(store) == 0


@pytest.mark.anyio
async def test_responses_store_max_bytes_bounds_what_the_server_keeps(make_app, tokenizer):
    app = make_app(engine=FakeEngine(tokenizer, max_model_len=32768), responses_store_max_bytes=20_000)
    async with client_for(app) as http_client:
        made = []
        for index in range(12):
            body = {"input": f"question {index} " + "y" * 2000, "max_output_tokens": 4}
            response = (await http_client.post("/v1/responses", json=body)).json()
            assert response["store"] is True, response
            made.append(response["id"])
        kept = [
            response_id
            for response_id in made
            if (await http_client.get(f"/v1/responses/{response_id}")).status_code == 200
        ]
        assert 0 < len(kept) < len(made) and kept == made[-len(kept) :]  # the newest are kept
        # one response larger than the whole store is answered, and says it was not stored
        big = await http_client.post("/v1/responses", json={"input": "z" * 30_000, "max_output_tokens": 4})
        assert big.status_code == 200 and big.json()["store"] is False
        assert (await http_client.get(f"/v1/responses/{big.json()['id']}")).status_code == 404
        background = await http_client.post(
            "/v1/responses", json={"input": "z" * 30_000, "max_output_tokens": 4, "background": True}
        )
        assert background.status_code == 400 and background.json()["error"]["param"] == "background"
        assert "--responses-store-max-bytes" in background.json()["error"]["message"]


# -- output: any split of the text gives the whole text's items ----------------------------------


def random_splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[start:end] for start, end in zip([0] + cuts, cuts + [len(text)])]


@pytest.fixture
def chat_handler(tokenizer):
    plugins = load_plugins()
    engine = FakeEngine(tokenizer)
    ctx = ServingContext(engine, ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes"), None)
    renderer = ChatRenderer(tokenizer, load_chat_template(HERMES_TEMPLATE), "auto")
    return ChatHandler(
        ctx,
        renderer,
        "assistant",
        plugins.registry("tool_parser").get("hermes"),
        plugins.registry("reasoning_parser").get("qwen3"),
    )


def output_of(text: str, finish_reason: str | None) -> RequestOutput:
    return RequestOutput(
        "r",
        None,
        [1],
        None,
        [CompletionOutput(0, text, [0], None, None, finish_reason, None)],
        finish_reason is not None,
    )


@pytest.mark.anyio
@pytest.mark.parametrize("reply", [CALLS_REPLY, THINKING_REPLY, "Just text, no calls."], ids=["calls", "think", "text"])
async def test_any_split_of_the_output_gives_the_whole_outputs_items(chat_handler, reply):
    chat_request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        request_id="r",
        tools=[{"type": "function", "function": {"name": name}} for name, _ in (WEATHER, TIME)],
        tool_choice="auto",
    )
    run, outputs = await chat_handler.start(chat_request, None)
    await outputs.aclose()
    state_message = run.choice(0, _state(reply)).message
    expected = [item.model_dump(exclude={"id", "call_id"}) for item in message_items(state_message)]
    splits = [list(reply)] + [random_splits(reply, seed) for seed in range(20)]
    for pieces in splits:
        run, outputs = await chat_handler.start(chat_request, None)
        await outputs.aclose()
        writer = ResponsesEventWriter(ResponseObject(id="resp_x", model="m"))
        states, cached = {}, {"tokens": 0}
        for index, piece in enumerate(pieces):
            finish = "stop" if index == len(pieces) - 1 else None
            for delta in run.deltas(output_of(piece, finish), states, cached):
                writer.add(delta.delta)
        writer.close_current()
        assert [item.model_dump(exclude={"id", "call_id"}) for item in writer.items] == expected, pieces


def _state(text: str):
    from tokenloom.api.serving_base import ChoiceState

    state = ChoiceState()
    state.add(CompletionOutput(0, text, [0], None, None, "stop", None))
    return state


# -- over HTTP -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_whole_and_streamed_responses_agree_in_openai_shapes(make_app, tokenizer):
    engine, app = app_with(make_app, tokenizer, THINKING_REPLY)
    body = {"input": "Weather in Paris?", "tools": TOOLS, "max_output_tokens": 200, "metadata": {"k": "v"}}
    async with client_for(app) as http_client:
        whole = (await http_client.post("/v1/responses", json=body)).json()
        assert whole["object"] == "response" and whole["status"] == "completed" and whole["metadata"] == {"k": "v"}
        assert [item["type"] for item in whole["output"]] == ["reasoning", "function_call"]
        reasoning, call = whole["output"]
        thought = "The user wants the weather: call the tool."
        assert reasoning["content"] == [{"type": "reasoning_text", "text": thought}]
        assert (call["name"], json.loads(call["arguments"])) == WEATHER and call["status"] == "completed"
        assert whole["usage"]["output_tokens"] == len(tokenizer(THINKING_REPLY, add_special_tokens=False)["input_ids"])
        assert whole["usage"]["input_tokens"] == len(engine.requests[0].prompt_token_ids)

        response = await http_client.post("/v1/responses", json={**body, "stream": True})
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_blocks(response.text)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    types = [event["type"] for event in events]
    reasoning_deltas = types.count("response.reasoning_text.delta")
    argument_deltas = types.count("response.function_call_arguments.delta")
    assert types == (
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
        + ["response.reasoning_text.delta"] * reasoning_deltas
        + [
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
        ]
        + ["response.function_call_arguments.delta"] * argument_deltas
        + ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    )
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert items_without_ids(final["output"]) == items_without_ids(whole["output"])
    assert final["usage"] == whole["usage"]
    # the item ids in the events are the final response's
    assert events[2]["item"]["id"] == final["output"][0]["id"]


@pytest.mark.anyio
async def test_previous_response_id_continues_the_conversation(make_app, tokenizer):
    engine, app = app_with(make_app, tokenizer, CALLS_REPLY)
    async with client_for(app) as http_client:
        first = (
            await http_client.post(
                "/v1/responses", json={"input": "Weather?", "tools": TOOLS, "instructions": "Be brief."}
            )
        ).json()
        call_ids = [item["call_id"] for item in first["output"] if item["type"] == "function_call"]
        assert len(call_ids) == 2
        outputs = [{"type": "function_call_output", "call_id": call_id, "output": "fine"} for call_id in call_ids]
        second = await http_client.post(
            "/v1/responses", json={"input": outputs, "tools": TOOLS, "previous_response_id": first["id"]}
        )
        assert second.status_code == 200, second.text
    prompt = tokenizer.decode(engine.requests[1].prompt_token_ids)
    # the first turn's question, text and calls came back; its instructions did not (OpenAI's rule)
    assert "Weather?" in prompt and "Let me check." in prompt and '"get_time"' in prompt
    assert "Be brief." not in prompt and prompt.count("<tool_response>") == 2


@pytest.mark.anyio
async def test_stored_responses_are_per_api_key(make_app, tokenizer):
    _, app = app_with(make_app, tokenizer, "Hello there.", api_key=["key-a", "key-b"])
    async with client_for(app) as http_client:
        made = (
            await http_client.post("/v1/responses", json={"input": "hi"}, headers={"Authorization": "Bearer key-a"})
        ).json()
        mine = await http_client.get(f"/v1/responses/{made['id']}", headers={"Authorization": "Bearer key-a"})
        assert mine.status_code == 200 and mine.json()["output_text"] == "Hello there."
        # x-api-key is the same key
        assert (await http_client.get(f"/v1/responses/{made['id']}", headers={"x-api-key": "key-a"})).status_code == 200
        theirs = await http_client.get(f"/v1/responses/{made['id']}", headers={"Authorization": "Bearer key-b"})
        assert theirs.status_code == 404 and theirs.json()["error"]["type"] == "NotFoundError"
        assert (
            await http_client.delete(f"/v1/responses/{made['id']}", headers={"Authorization": "Bearer key-b"})
        ).status_code == 404
        deleted = await http_client.delete(f"/v1/responses/{made['id']}", headers={"Authorization": "Bearer key-a"})
        assert deleted.json() == {"id": made["id"], "object": "response.deleted", "deleted": True}


@pytest.mark.anyio
async def test_a_background_response_can_be_cancelled(make_app, tokenizer):
    engine = FakeEngine(tokenizer, step_delay=0.05)
    app = make_app(engine=engine)
    async with client_for(app) as http_client:
        started = (await http_client.post("/v1/responses", json={"input": "hi", "background": True})).json()
        assert started["status"] == "queued" and started["background"] is True
        await asyncio.wait_for(engine.first_step_event.wait(), 10)
        polled = (await http_client.get(f"/v1/responses/{started['id']}")).json()
        assert polled["status"] == "in_progress"
        cancelled = (await http_client.post(f"/v1/responses/{started['id']}/cancel")).json()
        assert cancelled["status"] == "cancelled"
        assert engine.aborted == [engine.requests[0].request_id]
        # a cancelled response cannot be continued, and a foreground one cannot be cancelled
        done = (await http_client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3})).json()
        refused = await http_client.post(f"/v1/responses/{done['id']}/cancel")
        assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]


@pytest.mark.anyio
async def test_a_finished_background_response_is_stored(make_app, tokenizer):
    engine = FakeEngine(tokenizer)
    app = make_app(engine=engine)
    async with client_for(app) as http_client:
        started = (
            await http_client.post("/v1/responses", json={"input": "hi", "background": True, "max_output_tokens": 4})
        ).json()
        for _ in range(200):
            polled = (await http_client.get(f"/v1/responses/{started['id']}")).json()
            if polled["status"] not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.01)
    assert polled["status"] == "incomplete" and polled["incomplete_details"] == {"reason": "max_output_tokens"}
    assert polled["usage"]["output_tokens"] == 4 and polled["output"][0]["status"] == "incomplete"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"input": "hi", "background": True, "store": False}, "store", "stored"),
        ({"input": "hi", "background": True, "stream": True}, "background", "poll"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id", "no stored response"),
        ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice", "'auto'"),
        ({"input": [], "model": "smollm2"}, "input", "empty"),
        ({"input": "hi", "model": "gpt-9"}, "model", "does not exist"),
        ({}, "input", "Field required"),
        ({"input": "hi", "metadata": {f"k{index}": "v" for index in range(17)}}, "metadata", "at most 16"),
        ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata", "at most 64"),
        ({"input": "hi", "metadata": {"note": "v" * 513}}, "metadata.note", "at most 512"),
        ({"input": [{"role": {"name": "user"}, "content": "hi"}]}, "input[0].role", "must be user"),
    ],
)
async def test_bad_requests_are_4xx_naming_the_responses_parameter(client, body, param, words):
    response = await client.post("/v1/responses", json=body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.anyio
async def test_retrieving_an_unknown_response_is_a_404(client):
    response = await client.get("/v1/responses/resp_unknown")
    assert response.status_code == 404 and "resp_unknown" in response.json()["error"]["message"]


def test_message_items_put_reasoning_first_and_calls_last():
    from tokenloom.api.protocol import ChatMessage, FunctionCall, ToolCall

    message = ChatMessage(
        role="assistant",
        content="Text.",
        reasoning_content="Thought.",
        tool_calls=[ToolCall(id="x", function=FunctionCall(name="f", arguments="{}"))],
    )
    items = message_items(message, "incomplete")
    assert [item.type for item in items] == ["reasoning", "message", "function_call"]
    assert all(item.status == "incomplete" for item in items) and isinstance(items[1], MessageItem)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "tool_choice, reply",
    [
        ({"type": "function", "name": "get_weather"}, json.dumps(WEATHER[1])),
        ("required", json.dumps([{"name": WEATHER[0], "parameters": WEATHER[1]}])),
    ],
    ids=["named", "required"],
)
async def test_forced_tool_choice_gives_function_calls_whole_and_streamed(make_app, tokenizer, tool_choice, reply):
    engine, app = app_with(make_app, tokenizer, reply)
    body = {"input": "Weather?", "tools": TOOLS, "tool_choice": tool_choice}
    async with client_for(app) as http_client:
        whole = (await http_client.post("/v1/responses", json=body)).json()
        events = sse_blocks((await http_client.post("/v1/responses", json={**body, "stream": True})).text)
    assert [(item["type"], item["name"], json.loads(item["arguments"])) for item in whole["output"]] == [
        ("function_call", *WEATHER)
    ]
    assert items_without_ids(events[-1]["response"]["output"]) == items_without_ids(whole["output"])
    # the arguments were generated under the tool's schema, as in chat
    assert engine.requests[0].params.structured_outputs is not None
