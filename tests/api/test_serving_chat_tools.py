"""Tool calling and reasoning in /v1/chat/completions with the built-in parsers, against the
fake engine: tool_choice auto / none, parallel_tool_calls, tools and tool history in the
chat template, finish_reason "tool_calls", reasoning + tool calls in one response, and
chat_template_kwargs reaching the template. Streamed and whole responses must agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.api.conftest import client_for, sse_events
from tests.api.fake_engine import FakeEngine
from tests.builtin_plugins.tool_parsers.formats import TIME, WEATHER, hermes
from tokenloom.plugins.manager import load_plugins

pytestmark = pytest.mark.anyio

HERMES_TEMPLATE = str(Path(__file__).resolve().parents[2] / "examples" / "tool_chat_template_hermes.jinja")
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} of a place",
            "parameters": {"type": "object", "properties": {key: {"type": "string"} for key in arguments}},
        },
    }
    for name, arguments in (WEATHER, TIME)
]
CALLS_REPLY = "Let me check.\n" + hermes([WEATHER, TIME])
THOUGHT = "The user wants the weather: call the tool."
# markers right against the text: the Responses and Messages shape tests use it too
THINKING_REPLY = f"<think>{THOUGHT}</think>" + hermes([WEATHER])
# as Qwen3 writes it: vLLM keeps the newlines, so the reasoning is "\n...\n" and the content
# before the call (hermes: model_output[:index of <tool_call>]) is "\n\n"
QWEN3_THINKING_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n" + hermes([WEATHER])


def app_with(make_app, tokenizer, reply: str, **config):
    engine = FakeEngine(tokenizer, replies=(reply,))
    config.setdefault("tool_call_parser", "hermes")
    config.setdefault("enable_auto_tool_choice", True)
    config.setdefault("chat_template", HERMES_TEMPLATE)
    return engine, make_app(engine=engine, plugins=load_plugins(), **config)


def streamed_message(events: list[dict]) -> dict:
    """The message a client assembles from the chunks (as the openai client does)."""
    message = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                entry = message["tool_calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                if call.get("id"):
                    assert entry["id"] is None and call["type"] == "function" and call["function"].get("name")
                    entry["id"] = call["id"]
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
    return message


def calls_of(tool_calls) -> list:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in tool_calls]


async def test_auto_tool_choice_returns_calls_streamed_and_whole(make_app, tokenizer):
    engine, app = app_with(make_app, tokenizer, CALLS_REPLY)
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 200}
    async with client_for(app) as http_client:
        whole = (await http_client.post("/v1/chat/completions", json=body)).json()
        [choice] = whole["choices"]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me check.\n"  # as vLLM: the text before the call, verbatim
        assert calls_of(choice["message"]["tool_calls"]) == [WEATHER, TIME]
        assert all(
            call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
            for call in choice["message"]["tool_calls"]
        )
        # the tools reached the template, and the parser kept special tokens in the output
        prompt = tokenizer.decode(engine.requests[0].prompt_token_ids)
        assert "<tools>" in prompt and '"name": "get_weather"' in prompt
        assert engine.requests[0].params.skip_special_tokens is False

        events = sse_events((await http_client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        message = streamed_message(events)
        assert message["content"] == "Let me check.\n"
        assert [(call["name"], json.loads(call["arguments"])) for _, call in sorted(message["tool_calls"].items())] == [
            WEATHER,
            TIME,
        ]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_tool_choice_none_leaves_the_output_as_text(make_app, tokenizer):
    _, app = app_with(make_app, tokenizer, CALLS_REPLY)
    async with client_for(app) as http_client:
        response = await http_client.post(
            "/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 200}
        )
        [choice] = response.json()["choices"]
        assert choice["message"]["content"] == CALLS_REPLY and choice["message"]["tool_calls"] == []
        assert choice["finish_reason"] == "stop"


async def test_parallel_tool_calls_false_keeps_the_first_call(make_app, tokenizer):
    _, app = app_with(make_app, tokenizer, CALLS_REPLY)
    body = {"messages": USER, "tools": TOOLS, "parallel_tool_calls": False, "max_tokens": 200}
    async with client_for(app) as http_client:
        whole = (await http_client.post("/v1/chat/completions", json=body)).json()
        assert calls_of(whole["choices"][0]["message"]["tool_calls"]) == [WEATHER]
        events = sse_events((await http_client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        assert list(streamed_message(events)["tool_calls"]) == [0]


async def test_tool_history_is_accepted_and_rendered(make_app, tokenizer):
    engine, app = app_with(make_app, tokenizer, "It is 22 degrees in Paris.")
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(WEATHER[1])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "22 degrees, sunny"},
    ]
    async with client_for(app) as http_client:
        response = await http_client.post(
            "/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 50}
        )
        assert response.status_code == 200, response.text
        [choice] = response.json()["choices"]
        assert choice["message"]["content"] == "It is 22 degrees in Paris." and choice["finish_reason"] == "stop"
        prompt = tokenizer.decode(engine.requests[0].prompt_token_ids)
        assert (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
            in prompt
        )
        assert "<tool_response>\n22 degrees, sunny\n</tool_response>" in prompt


@pytest.mark.parametrize(
    "reply,reasoning,content",
    [(THINKING_REPLY, THOUGHT, None), (QWEN3_THINKING_REPLY, f"\n{THOUGHT}\n", "\n\n")],
    ids=["tight", "qwen3_newlines"],
)
async def test_reasoning_and_tool_calls_in_one_response(make_app, tokenizer, reply, reasoning, content):
    _, app = app_with(make_app, tokenizer, reply, reasoning_parser="qwen3")
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 200}
    async with client_for(app) as http_client:
        whole = (await http_client.post("/v1/chat/completions", json=body)).json()
        [choice] = whole["choices"]
        assert choice["message"]["reasoning_content"] == reasoning
        assert choice["message"]["content"] == content
        assert calls_of(choice["message"]["tool_calls"]) == [WEATHER]
        assert choice["finish_reason"] == "tool_calls"
        events = sse_events((await http_client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        message = streamed_message(events)
        assert message["reasoning_content"] == reasoning
        assert message["content"] == (content or "") and [call["name"] for call in message["tool_calls"].values()] == [
            "get_weather"
        ]


async def test_reasoning_held_back_at_the_end_is_flushed(make_app, tokenizer):
    # the output ends inside something that could have become "</think>"
    _, app = app_with(make_app, tokenizer, "<think>Still thinking </th", reasoning_parser="qwen3")
    async with client_for(app) as http_client:
        body = {"messages": USER, "max_tokens": 50}
        whole = (await http_client.post("/v1/chat/completions", json=body)).json()
        assert whole["choices"][0]["message"]["reasoning_content"] == "Still thinking </th"
        events = sse_events((await http_client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        assert streamed_message(events)["reasoning_content"] == "Still thinking </th"


async def test_chat_template_kwargs_reach_the_template(make_app, tokenizer):
    engine, app = app_with(make_app, tokenizer, "Hello.", reasoning_parser="qwen3")
    async with client_for(app) as http_client:
        await http_client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5})
        await http_client.post(
            "/v1/chat/completions",
            json={"messages": USER, "max_tokens": 5, "chat_template_kwargs": {"enable_thinking": False}},
        )
    thinking, not_thinking = (tokenizer.decode(request.prompt_token_ids) for request in engine.requests)
    assert thinking.endswith("<|im_start|>assistant\n")
    assert not_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def test_a_malformed_mistral_call_comes_back_without_its_marker(make_app, tokenizer):
    # vLLM answers with the tool parser's content even when no call was made: for mistral, the
    # output without [TOOL_CALLS], trimmed
    reply = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]'
    _, app = app_with(make_app, tokenizer, reply, tool_call_parser="mistral")
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 200}
    async with client_for(app) as http_client:
        whole = (await http_client.post("/v1/chat/completions", json=body)).json()
        [choice] = whole["choices"]
        expected = '[{"name": "get_weather", "arguments": {"city": "Paris"}]'
        assert choice["message"]["content"] == expected and choice["message"]["tool_calls"] == []
        assert choice["finish_reason"] == "stop"
        events = sse_events((await http_client.post("/v1/chat/completions", json={**body, "stream": True})).text)
        assert streamed_message(events)["content"] == expected
