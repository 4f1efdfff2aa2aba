"""Tool calling and reasoning through the real ``tokenloom serve`` with the scripted model,
the hermes parser, the qwen3 reasoning parser and the example hermes chat template: calls
and reasoning in OpenAI's shape (openai client, streamed and not), tool_choice none,
parallel_tool_calls, a tool-result round trip, chat_template_kwargs, and a broken
--tool-parser-plugin file reported with its path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.builtin_plugins.tool_parsers.formats import SEARCH, TIME, TOOLS_FOR_CASES, TRANSLATE, WEATHER, hermes
from tests.e2e.conftest import REPO_ROOT, stop_server
from tests.e2e.scripted import ask, scripted_model_dir, start_scripted_server
from tests.plugins.scripted_model.model_dir import marker

pytestmark = pytest.mark.slow

HERMES_TEMPLATE = str(Path(REPO_ROOT) / "examples" / "tool_chat_template_hermes.jinja")
THOUGHT = "The user wants the weather in Paris and the time there: two calls."
SCENARIOS = {
    "calls": "Let me look both up.\n" + hermes([WEATHER, TIME]),
    "think_then_call": f"<think>\n{THOUGHT}\n</think>\n\n" + hermes([WEATHER, TIME]),
    "think_then_answer": f"<think>\n{THOUGHT}\n</think>\n\nIt is sunny in Paris, 22 °C.",
    "unicode_call": hermes([TRANSLATE, SEARCH]),
    "answer": "It is sunny in Paris, 22 °C. Grüße!",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, scripted_tokenizer):
    directory = tmp_path_factory.mktemp("scripted-hermes")
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
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calls_arrive_in_openai_shape(client, stream):
    reply = ask(client, "calls", stream=stream, tools=TOOLS_FOR_CASES)
    assert reply.content == "Let me look both up.\n"  # the text before the call, verbatim (as vLLM)
    assert reply.calls == [WEATHER, TIME]
    assert reply.finish_reason == "tool_calls" and reply.reasoning_content is None
    assert len(set(reply.call_ids)) == 2 and all(call_id.startswith("chatcmpl-tool-") for call_id in reply.call_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_unicode_and_nested_arguments_survive_the_whole_path(client, stream):
    reply = ask(client, "unicode_call", stream=stream, tools=TOOLS_FOR_CASES)
    assert reply.calls == [TRANSLATE, SEARCH] and reply.content is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_and_tool_calls_in_one_response(client, stream):
    reply = ask(client, "think_then_call", stream=stream, tools=TOOLS_FOR_CASES)
    # byte for byte as vLLM: qwen3 keeps the newlines inside <think>, and hermes returns the
    # "\n\n" between </think> and <tool_call> as the content before the call
    assert reply.reasoning_content == f"\n{THOUGHT}\n"
    assert reply.content == "\n\n" and reply.calls == [WEATHER, TIME] and reply.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_without_tools(client, stream):
    reply = ask(client, "think_then_answer", stream=stream)
    assert (reply.reasoning_content, reply.content) == (f"\n{THOUGHT}\n", "\n\nIt is sunny in Paris, 22 °C.")
    assert reply.calls == [] and reply.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_tool_calls_false_keeps_the_first(client, stream):
    reply = ask(client, "calls", stream=stream, tools=TOOLS_FOR_CASES, parallel_tool_calls=False)
    assert reply.calls == [WEATHER]


def test_tool_choice_none_answers_in_text(client):
    reply = ask(client, "calls", stream=False, tools=TOOLS_FOR_CASES, tool_choice="none")
    assert reply.content == SCENARIOS["calls"] and reply.calls == [] and reply.finish_reason == "stop"


def test_tool_results_round_trip(client):
    question = [{"role": "user", "content": f"{marker('calls')} weather and time in Paris?"}]
    first = client.chat.completions.create(model="scripted", messages=question, tools=TOOLS_FOR_CASES)
    assistant = first.choices[0].message.model_dump(exclude_none=True, exclude={"reasoning_content"})
    results = [
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": f"{marker('answer')} " + ("22 °C, sunny" if call.function.name == "get_weather" else "14:05"),
        }
        for call in first.choices[0].message.tool_calls
    ]
    second = ask(client, "answer", stream=False, messages=question + [assistant] + results, tools=TOOLS_FOR_CASES)
    assert second.content == SCENARIOS["answer"] and second.calls == [] and second.finish_reason == "stop"


def test_chat_template_kwargs_reach_the_template(client):
    thinking = ask(client, "answer", stream=False)
    not_thinking = ask(client, "answer", stream=False, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the template opened the answer with an empty <think></think> block
    assert not_thinking.prompt_tokens > thinking.prompt_tokens
    assert not_thinking.content == thinking.content == SCENARIOS["answer"]


def test_a_broken_tool_parser_plugin_file_is_reported_with_its_path(tmp_path):
    broken = tmp_path / "broken_parser.py"
    broken.write_text("from tokenloom.plugin_api import ToolParser\n\nclass Oops(ToolParser)\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenloom",
            "serve",
            str(tmp_path),
            "--tool-parser-plugin",
            str(broken),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "oops",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert str(broken) in result.stderr and "SyntaxError" in result.stderr
