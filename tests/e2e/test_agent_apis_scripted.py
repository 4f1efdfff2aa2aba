"""/v1/responses and /v1/messages through the real ``tokenloom serve`` with the scripted model,
the hermes tool parser, the qwen3 reasoning parser and the example hermes chat template,
spoken to by the official ``openai`` and ``anthropic`` clients: function calls and reasoning
in each API's shape (whole and streamed), tool-result round trips (``previous_response_id``;
tool_use / tool_result blocks), stored responses seen only with the key that made them,
background responses, count_tokens, and errors in each API's shape."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anthropic
import openai
import pytest

from tests.builtin_plugins.tool_parsers.formats import TIME, TRANSLATE, WEATHER, hermes
from tests.e2e.conftest import REPO_ROOT, stop_server
from tests.e2e.scripted import MODEL, scripted_model_dir, start_scripted_server
from tests.plugins.scripted_model.model_dir import marker

pytestmark = pytest.mark.slow

HERMES_TEMPLATE = str(Path(REPO_ROOT) / "examples" / "tool_chat_template_hermes.jinja")
THOUGHT = "The user wants the weather in Paris and the time there: two calls."
SCENARIOS = {
    "calls": "Let me look both up.\n" + hermes([WEATHER, TIME]),
    # markers right against the text: the parsers keep whitespace around them as the model wrote
    # it (as vLLM does), which the chat tests check; these check the agent APIs' shapes
    "think_then_call": f"<think>{THOUGHT}</think>" + hermes([WEATHER, TIME]),
    "think_then_answer": f"<think>{THOUGHT}</think>It is sunny in Paris, 22 °C.",
    "unicode_call": hermes([TRANSLATE]),
    "answer": "It is sunny in Paris, 22 °C. Grüße!",
}
KEY, OTHER_KEY = "agent-key-one", "agent-key-two"


def schema_of(arguments: dict) -> dict:
    return {"type": "object", "properties": {key: {"type": "string"} for key in arguments}}


RESPONSES_TOOLS = [
    {"type": "function", "name": name, "description": f"{name} of a place", "parameters": schema_of(arguments)}
    for name, arguments in (WEATHER, TIME, TRANSLATE)
]
MESSAGES_TOOLS = [
    {"name": name, "description": f"{name} of a place", "input_schema": schema_of(arguments)}
    for name, arguments in (WEATHER, TIME, TRANSLATE)
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, scripted_tokenizer):
    directory = tmp_path_factory.mktemp("scripted-agent-apis")
    model_dir = scripted_model_dir(str(directory / "model"), scripted_tokenizer, SCENARIOS)
    running = start_scripted_server(
        model_dir,
        str(directory / "serve.log"),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--chat-template",
        HERMES_TEMPLATE,
        "--api-key",
        KEY,
        "--api-key",
        OTHER_KEY,
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def calls_in(response) -> list[tuple[str, dict]]:
    return [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]


# -- Responses -----------------------------------------------------------------------------


def test_responses_function_calls_whole_and_streamed(oai):
    ask = {"model": MODEL, "input": f"{marker('calls')} weather and time in Paris?", "tools": RESPONSES_TOOLS}
    whole = oai.responses.create(**ask)
    assert whole.status == "completed" and whole.object == "response"
    assert [item.type for item in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output_text == "Let me look both up.\n"
    assert calls_in(whole) == [WEATHER, TIME]
    assert all(item.call_id.startswith("call_") and item.id.startswith("fc_") for item in whole.output[1:])
    assert (
        whole.usage.output_tokens > 0
        and whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    )

    with oai.responses.stream(**ask) as stream:
        event_types = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert calls_in(streamed) == [WEATHER, TIME] and streamed.output_text == "Let me look both up.\n"
    assert event_types[:2] == ["response.created", "response.in_progress"] and event_types[-1] == "response.completed"
    # each item: added, its parts and deltas, done; the message's text part opens and closes inside it
    assert event_types[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert event_types.count("response.output_item.added") == event_types.count("response.output_item.done") == 3
    assert event_types.count("response.function_call_arguments.done") == 2
    assert "response.function_call_arguments.delta" in event_types
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_responses_unicode_arguments_survive(oai):
    response = oai.responses.create(model=MODEL, input=f"{marker('unicode_call')} translate", tools=RESPONSES_TOOLS)
    assert calls_in(response) == [TRANSLATE] and response.output_text == ""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_reasoning_items(oai, stream):
    ask = {"model": MODEL, "input": f"{marker('think_then_answer')} weather?"}
    if stream:
        with oai.responses.stream(**ask) as events:
            kinds = [event.type for event in events]
            response = events.get_final_response()
        assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    else:
        response = oai.responses.create(**ask)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert message.type == "message" and response.output_text == "It is sunny in Paris, 22 °C."
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens


def test_responses_function_round_trip_through_previous_response_id(oai):
    first = oai.responses.create(
        model=MODEL, input=f"{marker('calls')} weather and time in Paris?", tools=RESPONSES_TOOLS
    )
    results = [
        {
            "type": "function_call_output",
            "call_id": item.call_id,
            "output": f"{marker('answer')} " + ("22 °C, sunny" if item.name == "get_weather" else "14:05"),
        }
        for item in first.output
        if item.type == "function_call"
    ]
    assert len(results) == 2
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, input=results, tools=RESPONSES_TOOLS)
    assert second.output_text == SCENARIOS["answer"] and calls_in(second) == []
    assert second.previous_response_id == first.id
    # the whole first turn (question, calls, results) was in the second prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_stored_responses_are_seen_only_with_the_key_that_made_them(oai, server):
    made = oai.responses.create(model=MODEL, input=f"{marker('answer')} hi", metadata={"case": "visibility"})
    assert oai.responses.retrieve(made.id).output_text == SCENARIOS["answer"]
    assert oai.responses.retrieve(made.id).metadata == {"case": "visibility"}
    other = openai.OpenAI(base_url=server.base_url + "/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="go on", previous_response_id=made.id)
    oai.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(made.id)
    unstored = oai.responses.create(model=MODEL, input=f"{marker('answer')} hi", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_background_response_is_polled_to_completion(oai):
    started = oai.responses.create(model=MODEL, input=f"{marker('answer')} hi", background=True)
    assert started.status in ("queued", "in_progress", "completed") and started.background
    deadline = time.monotonic() + 60
    polled = oai.responses.retrieve(started.id)
    while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        polled = oai.responses.retrieve(started.id)
    assert polled.status == "completed" and polled.output_text == SCENARIOS["answer"]
    # cancelling a finished background response leaves it as it is
    assert oai.responses.cancel(started.id).status == "completed"


def test_responses_errors_are_openai_shaped(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert "function tools only" in caught.value.message and caught.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")


# -- Messages ------------------------------------------------------------------------------


def test_messages_tool_use_whole_and_streamed(claude):
    ask = {
        "model": MODEL,
        "max_tokens": 300,
        "tools": MESSAGES_TOOLS,
        "messages": [{"role": "user", "content": f"{marker('calls')} weather and time in Paris?"}],
    }
    message = claude.messages.create(**ask)
    assert message.stop_reason == "tool_use" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "Let me look both up.\n"
    assert [(block.name, block.input) for block in message.content[1:]] == [WEATHER, TIME]
    assert all(block.id.startswith("toolu_") for block in message.content[1:])

    with claude.messages.stream(**ask) as stream:
        event_types = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert [(block.name, block.input) for block in streamed.content if block.type == "tool_use"] == [WEATHER, TIME]
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == message.usage.output_tokens
    assert event_types[0] == "message_start" and event_types[-1] == "message_stop"
    assert event_types.count("content_block_start") == event_types.count("content_block_stop") == 3


def test_messages_tool_result_round_trip(claude):
    question = {"role": "user", "content": f"{marker('calls')} weather and time in Paris?"}
    first = claude.messages.create(model=MODEL, max_tokens=300, tools=MESSAGES_TOOLS, messages=[question])
    results = [
        {
            "type": "tool_result",
            "tool_use_id": block.id,
            "content": f"{marker('answer')} " + ("22 °C, sunny" if block.name == "get_weather" else "14:05"),
        }
        for block in first.content
        if block.type == "tool_use"
    ]
    second = claude.messages.create(
        model=MODEL,
        max_tokens=300,
        tools=MESSAGES_TOOLS,
        messages=[
            question,
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {"role": "user", "content": results},
        ],
    )
    assert [block.type for block in second.content] == ["text"]
    assert second.content[0].text == SCENARIOS["answer"] and second.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_thinking_blocks(claude, stream):
    ask = {
        "model": MODEL,
        "max_tokens": 300,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": f"{marker('think_then_call')} weather and time?"}],
        "tools": MESSAGES_TOOLS,
    }
    if stream:
        with claude.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**ask)
    assert [block.type for block in message.content] == ["thinking", "tool_use", "tool_use"]
    assert message.content[0].thinking == THOUGHT and message.stop_reason == "tool_use"


def test_messages_text_stream_and_count_tokens(claude):
    messages = [{"role": "user", "content": f"{marker('answer')} hi"}]
    with claude.messages.stream(model=MODEL, max_tokens=100, messages=messages, system="Be brief.") as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == SCENARIOS["answer"] and final.stop_reason == "end_turn"
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    assert counted.input_tokens == final.usage.input_tokens


def test_messages_errors_are_anthropic_shaped(claude, server):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "system", "content": "hi"}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "top-level system field" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    stranger = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        stranger.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
