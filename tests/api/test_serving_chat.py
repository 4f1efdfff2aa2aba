"""POST /v1/chat/completions against the fake engine: shapes, streaming deltas, logprobs,
echo, templates, tool choice, and the tool/reasoning parsers looked up in the registries."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import client_for, sse_events
from tests.api.fake_engine import FakeEngine
from tokenloom.core.parsers import (
    DeltaMessage,
    ExtractedToolCalls,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from tokenloom.errors import UnknownNameError
from tokenloom.plugins.manager import PluginSet, new_registries

pytestmark = pytest.mark.anyio

USER_HI = [{"role": "user", "content": "Hi"}]


async def test_chat_response_shape(client, engine, tokenizer):
    response = await client.post(
        "/v1/chat/completions", json={"model": "smollm2", "messages": USER_HI, "max_tokens": 3}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == " The quick brown"
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    expected_prompt = tokenizer.apply_chat_template(USER_HI, tokenize=False, add_generation_prompt=True)
    expected_ids = tokenizer(expected_prompt, add_special_tokens=False)["input_ids"]
    assert engine.requests[0].prompt == expected_ids
    assert body["usage"] == {
        "prompt_tokens": len(expected_ids),
        "completion_tokens": 3,
        "total_tokens": len(expected_ids) + 3,
    }


async def test_max_completion_tokens_wins_over_max_tokens(client, engine):
    await client.post("/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 9, "max_completion_tokens": 2})
    assert engine.requests[0].params.max_tokens == 2


async def test_streaming_starts_with_a_role_delta(client):
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": USER_HI, "max_tokens": 3, "stream": True, "n": 2, "stream_options": {"include_usage": True}},
    )
    assert response.text.startswith("data: {")
    events = sse_events(response.text)
    assert all(event["object"] == "chat.completion.chunk" for event in events)
    roles = [event for event in events if event["choices"] and "role" in event["choices"][0]["delta"]]
    assert [(event["choices"][0]["index"], event["choices"][0]["delta"]) for event in roles] == [
        (0, {"role": "assistant"}),
        (1, {"role": "assistant"}),
    ]
    assert events.index(roles[-1]) == 1  # before any content
    for index, reply in ((0, " The quick brown"), (1, " Once upon a")):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert "".join(choice["delta"].get("content", "") for choice in mine) == reply
        assert mine[-1]["finish_reason"] == "length"
        assert all(choice["finish_reason"] is None for choice in mine[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


async def test_chat_logprobs_format(client):
    response = await client.post(
        "/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    )
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [" The", " quick"]
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["bytes"] == list(b" The")
    assert first["logprob"] == pytest.approx(-0.6)
    assert len(first["top_logprobs"]) == 2 and first["top_logprobs"][0]["token"] == " The"
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    # step 1 puts the chosen token at rank 2: the top list is ranked, the chosen one second
    assert [entry["token"] for entry in content[1]["top_logprobs"]][1] == " quick"


async def test_streaming_chat_logprobs(client):
    response = await client.post(
        "/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 2, "stream": True, "logprobs": True}
    )
    events = sse_events(response.text)
    with_logprobs = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [lp["content"][0]["token"] for lp in with_logprobs] == [" The", " quick"]
    assert all(lp["content"][0]["top_logprobs"] == [] for lp in with_logprobs)


async def test_top_logprobs_needs_logprobs(client):
    response = await client.post("/v1/chat/completions", json={"messages": USER_HI, "top_logprobs": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


async def test_echo_prepends_the_last_assistant_message(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    body = {
        "messages": messages,
        "max_tokens": 2,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.json()["choices"][0]["message"]["content"] == "Well, The quick"
    stream = await client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(stream.text)]
    assert deltas[0] == {"role": "assistant"} and deltas[1] == {"content": "Well,"}


async def test_continue_final_message_leaves_the_message_open(client, engine, tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here"}]
    response = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert response.status_code == 200, response.text
    prompt = tokenizer.decode(engine.requests[0].prompt)
    assert prompt.endswith("<|im_start|>assistant\nSure, here")


async def test_chat_template_override_changes_the_prompt(make_app, engine, tokenizer, tmp_path):
    template_file = tmp_path / "custom.jinja"
    template_file.write_text(
        "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<<{{ 'bot' }}>>{% endif %}"
    )
    async with client_for(make_app(chat_template=str(template_file), trust_request_chat_template=True)) as http_client:
        response = await http_client.post("/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 1})
        assert response.status_code == 200
        assert tokenizer.decode(engine.requests[0].prompt) == "<<user>>Hi<<bot>>"
        await http_client.post(
            "/v1/chat/completions",
            json={"messages": USER_HI, "max_tokens": 1, "chat_template": "[{{ messages[0]['content'] }}]"},
        )
        assert tokenizer.decode(engine.requests[1].prompt) == "[Hi]"


async def test_chat_template_kwargs_reach_the_template(make_app, engine, tokenizer):
    async with client_for(make_app(trust_request_chat_template=True)) as client:
        await client.post(
            "/v1/chat/completions",
            json={
                "messages": USER_HI,
                "max_tokens": 1,
                "chat_template": "{{ greeting }} {{ messages[0].content }}",
                "chat_template_kwargs": {"greeting": "Bonjour"},
            },
        )
    assert tokenizer.decode(engine.requests[0].prompt) == "Bonjour Hi"


async def test_model_without_template_is_a_400_saying_how(make_app, tokenizer):
    class NoTemplateTokenizer:
        def __init__(self, inner):
            self._inner = inner
            self.chat_template = None

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def __call__(self, *args, **kwargs):
            return self._inner(*args, **kwargs)

        def __len__(self):
            return len(self._inner)

    engine = FakeEngine(NoTemplateTokenizer(tokenizer))
    async with client_for(make_app(engine=engine)) as http_client:
        response = await http_client.post("/v1/chat/completions", json={"messages": USER_HI})
        assert response.status_code == 400
        assert "--chat-template" in response.json()["error"]["message"]
        completion = await http_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert completion.status_code == 200


async def test_non_text_content_part_is_a_400_naming_the_type(client):
    messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "..."}}]}]
    response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400
    assert "input_audio" in response.json()["error"]["message"]


async def test_response_role_option(make_app):
    async with client_for(make_app(response_role="bot")) as http_client:
        response = await http_client.post("/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 1})
    assert response.json()["choices"][0]["message"]["role"] == "bot"


@pytest.mark.parametrize("messages", [[], [{"content": "no role"}], [{"role": "user", "content": 5}]])
async def test_bad_messages_are_400(client, messages):
    response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400
    assert "messages" in response.json()["error"]["message"]


async def test_named_tool_choice_uses_the_schema_and_returns_a_tool_call(make_app, tokenizer):
    engine = FakeEngine(tokenizer, replies=('{"city": "Paris"}',))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    body = {
        "messages": USER_HI,
        "tools": tools,
        "max_tokens": 20,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    async with client_for(make_app(engine=engine)) as http_client:
        response = await http_client.post("/v1/chat/completions", json=body)
        message = response.json()["choices"][0]["message"]
        assert message["content"] is None
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        # compact: no whitespace for a small model to spend max_tokens on
        assert engine.requests[0].params.structured_outputs == {
            "json": tools[0]["function"]["parameters"],
            "disable_any_whitespace": True,
        }
        stream = await http_client.post("/v1/chat/completions", json={**body, "stream": True})
        calls = [c for e in sse_events(stream.text) for c in e["choices"][0]["delta"].get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
        assert "id" not in calls[1]
        assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
        missing = await http_client.post(
            "/v1/chat/completions", json={**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
        )
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "tool_choice"


async def test_auto_tool_choice_without_a_parser_is_a_400(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    response = await client.post(
        "/v1/chat/completions", json={"messages": USER_HI, "tools": tools, "tool_choice": "auto"}
    )
    assert response.status_code == 400
    assert "--enable-auto-tool-choice" in response.json()["error"]["message"]


# -- parsers from the registries -----------------------------------------------------------


class TagToolParser(ToolParser):
    """Test parser: ``<call>{"name": ..., "arguments": {...}}</call>`` is a tool call."""

    def adjust_request(self, request):
        return request.model_copy(update={"skip_special_tokens": False})

    def extract(self, model_output, request):
        start, end = model_output.find("<call>"), model_output.find("</call>")
        if start < 0 or end < 0:
            return ExtractedToolCalls(False, content=model_output)
        call = json.loads(model_output[start + len("<call>") : end])
        return ExtractedToolCalls(
            True, [ToolCall(call["name"], json.dumps(call["arguments"]))], content=model_output[:start] or None
        )

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.buffer = ""

    def extract_delta(self, delta_text, request):
        self.buffer += delta_text
        if "<call>" not in self.buffer:
            content, self.buffer = split_off_tag_prefix(self.buffer, "<call>")
            return DeltaMessage(content=content) if content else None
        if "</call>" not in self.buffer:
            return None
        extracted = self.extract(self.buffer, request)
        self.buffer = ""
        call = extracted.tool_calls[0]
        return DeltaMessage(
            content=extracted.content, tool_calls=[ToolCallDelta(0, name=call.name, arguments=call.arguments)]
        )


def split_off_tag_prefix(text: str, tag: str) -> tuple[str, str]:
    """(what can be sent, what may be the start of ``tag`` and must wait)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[:-size], text[-size:]
    return text, ""


class ThinkParser(ReasoningParser):
    """Test parser: text before ``</think>`` is reasoning."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.done = False
        self.buffer = ""

    def extract_reasoning(self, model_output, request):
        reasoning, sep, content = model_output.partition("</think>")
        return (reasoning, content) if sep else (None, model_output)

    def extract_reasoning_delta(self, delta_text, request):
        if self.done:
            return DeltaMessage(content=delta_text)
        self.buffer += delta_text
        if "</think>" in self.buffer:
            self.done = True
            reasoning, _, content = self.buffer.partition("</think>")
            return DeltaMessage(reasoning_content=reasoning or None, content=content or None)
        reasoning, self.buffer = split_off_tag_prefix(self.buffer, "</think>")
        return DeltaMessage(reasoning_content=reasoning) if reasoning else None


def plugin_set() -> PluginSet:
    registries = new_registries()
    registries["tool_parser"].register("tags", TagToolParser, plugin_name="tests")
    registries["reasoning_parser"].register("think", ThinkParser, plugin_name="tests")
    return PluginSet(registries, [], [])


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


async def test_tool_call_parser_from_the_registry(make_app, tokenizer):
    engine = FakeEngine(
        tokenizer, replies=('Let me check.<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>',)
    )
    app = make_app(engine=engine, plugins=plugin_set(), tool_call_parser="tags", enable_auto_tool_choice=True)
    async with client_for(app) as http_client:
        body = {"messages": USER_HI, "tools": TOOLS, "max_tokens": 60}
        response = await http_client.post("/v1/chat/completions", json=body)
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me check."
        [call] = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and call["id"]
        assert engine.requests[0].params.skip_special_tokens is False  # adjust_request applied

        stream = await http_client.post("/v1/chat/completions", json={**body, "stream": True})
        events = sse_events(stream.text)
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("content", "") for d in deltas) == "Let me check."
        [streamed_call] = [c for d in deltas for c in d.get("tool_calls", [])]
        assert streamed_call["function"]["name"] == "get_weather" and streamed_call["id"]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

        no_tools = await http_client.post("/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 60})
        assert no_tools.json()["choices"][0]["message"]["tool_calls"] == []


async def test_reasoning_parser_from_the_registry(make_app, tokenizer):
    engine = FakeEngine(tokenizer, replies=("Hmm, two plus two.</think>It is four.",))
    app = make_app(engine=engine, plugins=plugin_set(), reasoning_parser="think")
    async with client_for(app) as http_client:
        response = await http_client.post("/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 60})
        message = response.json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Hmm, two plus two.", "It is four.")
        stream = await http_client.post(
            "/v1/chat/completions", json={"messages": USER_HI, "max_tokens": 60, "stream": True}
        )
        deltas = [e["choices"][0]["delta"] for e in sse_events(stream.text)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm, two plus two."
        assert "".join(d.get("content", "") for d in deltas) == "It is four."


def test_unknown_parser_name_fails_at_start_up_listing_the_known_ones(make_app):
    with pytest.raises(UnknownNameError, match="tags"):
        make_app(plugins=plugin_set(), tool_call_parser="tagz")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
@pytest.mark.parametrize("tools", [None, []], ids=["absent", "empty"])
async def test_a_forced_tool_choice_without_tools_is_a_400(client, engine, tool_choice, tools):
    body = {"messages": USER_HI, "tool_choice": tool_choice}
    if tools is not None:
        body["tools"] = tools
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice"
    assert "tools" in response.json()["error"]["message"]
    assert not engine.requests


async def test_chat_beam_search_cannot_stream(client, engine):
    body = {"messages": USER_HI, "use_beam_search": True, "stream": True, "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
