"""The agent loop of issue 16 against the real ``tokenloom serve smollm2 --enable-auto-tool-choice
--tool-call-parser hermes`` with the official ``openai`` client: the first turn returns a tool call
(a named ``tool_choice``, so it is deterministic), the second turn sends the history back (the
assistant turn with ``content: null`` and its ``tool_calls``, then the ``tool`` result) and gets an
answer; streamed and not, with ``tools`` repeated and without; with the model's own template and
with each tool template in ``examples/`` as ``--chat-template``. Also, on the real server: request
templates need ``--trust-request-chat-template``, and ``/health`` answers while a hostile template
is being refused."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import REPO_ROOT, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
EXAMPLES = Path(REPO_ROOT) / "examples"
# the model's own template (and request templates trusted), then each shipped tool template
TEMPLATES = [None, "tool_chat_template_hermes.jinja", "tool_chat_template_llama3_json.jinja"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = {"role": "user", "content": "What is the weather like in Paris today?"}
TOOL_RESULT = json.dumps({"city": "Paris", "temperature_celsius": 21, "sky": "sunny"})


@pytest.fixture(scope="module", params=TEMPLATES, ids=["model-template", "hermes", "llama3_json"])
def server(request, tmp_path_factory):
    args = [MODEL, "--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if request.param is None:
        args.append("--trust-request-chat-template")
    else:
        args += ["--chat-template", str(EXAMPLES / request.param)]
    running = start_server(args, str(tmp_path_factory.mktemp("serve") / "serve.log"))
    running.template = request.param
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def first_turn(client, stream: bool):
    """The assistant message of the first turn, as the client would send it back."""
    kwargs = dict(
        model=MODEL,
        messages=[QUESTION],
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=32,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.content is None and len(message.tool_calls) == 1
        return message  # the client's own object, serialised back by the client (content null and all)
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(
                delta_call.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = delta_call.id or call["id"]
            if delta_call.function is not None:
                call["function"]["name"] += delta_call.function.name or ""
                call["function"]["arguments"] += delta_call.function.arguments or ""
    assert len(calls) == 1
    return {"role": "assistant", "content": None, "tool_calls": list(calls.values())}


def call_of(message) -> dict:
    call = message["tool_calls"][0] if isinstance(message, dict) else message.tool_calls[0].model_dump()
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)  # the named tool's schema held
    return call


# both turns streamed or both not: four requests pairs per server keep the module's runtime modest
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("repeat_tools", [True, False], ids=["tools-repeated", "no-tools"])
def test_the_second_turn_of_a_tool_conversation_gets_an_answer(server, client, stream, repeat_tools):
    assistant = first_turn(client, stream)
    call = call_of(assistant)
    history = [QUESTION, assistant, {"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT}]
    # tools repeated, the model may call again (tool_choice auto); "none" asks for the answer in words
    extra = {"tools": [WEATHER_TOOL], "tool_choice": "none"} if repeat_tools else {}
    kwargs = dict(model=MODEL, messages=history, temperature=0, max_tokens=8, **extra)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        answer = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        finish_reason = next(
            chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason
        )
        assert not any(chunk.choices[0].delta.tool_calls for chunk in chunks if chunk.choices)
        prompt_tokens = chunks[-1].usage.prompt_tokens
    else:
        reply = client.chat.completions.create(**kwargs)
        answer, finish_reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert not reply.choices[0].message.tool_calls
        prompt_tokens = reply.usage.prompt_tokens
    assert answer.strip() and finish_reason in ("stop", "length")

    # the whole history reached the prompt: the tool result always, the call where the template writes calls
    serialised = [
        QUESTION,
        assistant if isinstance(assistant, dict) else assistant.model_dump(exclude_none=True),
        history[2],
    ]
    tools = {"tools": extra["tools"]} if extra else {}
    tokenized = httpx.post(
        server.base_url + "/tokenize", json={"model": MODEL, "messages": serialised, **tools}, timeout=60
    ).json()
    assert tokenized["count"] == prompt_tokens
    prompt = httpx.post(
        server.base_url + "/detokenize", json={"model": MODEL, "tokens": tokenized["tokens"]}, timeout=60
    ).json()["prompt"]
    assert TOOL_RESULT in prompt
    if server.template is not None:
        assert "get_weather" in prompt and call["function"]["name"] in prompt


def test_a_request_template_needs_the_trust_flag(server, client):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    if server.template is None:  # started with --trust-request-chat-template
        reply = client.chat.completions.create(
            model=MODEL, messages=[QUESTION], max_tokens=2, extra_body={"chat_template": template}
        )
        assert reply.usage.prompt_tokens > 0
        return
    with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template"):
        client.chat.completions.create(
            model=MODEL, messages=[QUESTION], max_tokens=2, extra_body={"chat_template": template}
        )


def test_health_answers_while_a_hostile_template_is_refused(server, client):
    if server.template is not None:
        pytest.skip("request templates are refused outright on this server (see the trust test)")
    hostile = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    outcome: dict = {}

    def send():
        try:
            client.chat.completions.create(
                model=MODEL, messages=[QUESTION], max_tokens=2, extra_body={"chat_template": hostile}
            )
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    sender = threading.Thread(target=send)
    started = time.monotonic()
    sender.start()
    time.sleep(1.0)
    health_times = []
    while sender.is_alive() and time.monotonic() - started < 8:
        probe = time.monotonic()
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        health_times.append(time.monotonic() - probe)
        time.sleep(0.5)
    sender.join(timeout=60)
    assert health_times and max(health_times) < 1.0, health_times  # answered while the template spun
    error = outcome["error"]
    assert error.status_code == 400 and "longer than" in str(error)
    # and the server still serves chats
    assert client.chat.completions.create(model=MODEL, messages=[QUESTION], max_tokens=2).choices
