"""Helpers for end-to-end tests with the scripted model (tests/plugins/scripted_model): a
real ``tokenloom serve`` of a model directory whose answers are scripted per scenario, and
a client call that returns what an OpenAI client sees, streamed or not."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import openai

from tests.e2e.conftest import RunningServer, free_port, launch_serve, start_server, wait_ready
from tests.plugins.scripted_model.model_dir import marker, write_model_dir

MODEL = "scripted"


def scripted_model_dir(directory: str, tokenizer, scenarios: dict[str, str]) -> str:
    """The model directory, after checking each scripted text survives the tokenizer round
    trip (so a test failure is never the script's)."""
    write_model_dir(directory, tokenizer, scenarios)
    for name, text in scenarios.items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text, f"scenario {name!r} does not survive tokenization"
    return directory


def serve_args(model_dir: str, *flags: str) -> list[str]:
    return [
        model_dir,
        "--served-model-name",
        MODEL,
        "--plugin",
        "tests.plugins.scripted_model",
        "--max-model-len",
        "2048",
        *flags,
    ]


def start_scripted_server(model_dir: str, log_path: str, *flags: str) -> RunningServer:
    return start_server(serve_args(model_dir, *flags), log_path)


class Launch:
    """A scripted server started without waiting for it: a module with one server per
    parameter starts the next one while the tests of the current one run."""

    def __init__(self, model_dir: str, log_path: str, *flags: str):
        port = free_port()
        process = launch_serve([*serve_args(model_dir, *flags), "--host", "127.0.0.1", "--port", str(port)], log_path)
        self.server = RunningServer(process, f"http://127.0.0.1:{port}", log_path)

    def wait_ready(self, timeout: float = 240.0) -> RunningServer:
        return wait_ready(self.server, timeout)


@dataclass
class Reply:
    """An assistant reply as the client assembled it."""

    content: str | None
    reasoning_content: str | None
    calls: list[tuple[str, dict]]
    call_ids: list[str]
    finish_reason: str
    prompt_tokens: int | None = None
    chunks: list = field(default_factory=list)


def ask(client: openai.OpenAI, scenario: str, *, stream: bool, text: str = "please", messages=None, **kwargs) -> Reply:
    messages = messages or [{"role": "user", "content": f"{marker(scenario)} {text}"}]
    if not stream:
        response = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
        choice = response.choices[0]
        message = choice.message
        calls = message.tool_calls or []
        return Reply(
            message.content,
            getattr(message, "reasoning_content", None),
            [(call.function.name, json.loads(call.function.arguments)) for call in calls],
            [call.id for call in calls],
            choice.finish_reason,
            response.usage.prompt_tokens,
        )
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kwargs))
    content, reasoning, calls = "", "", {}
    finish_reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    # OpenAI's shape: a call's first delta carries its id, type and name
                    assert call.id and call.type == "function" and call.function.name, call
                    calls[call.index] = [call.id, call.function.name, ""]
                else:
                    assert not call.id and not (call.function and call.function.name), call
                calls[call.index][2] += (call.function.arguments or "") if call.function else ""
            finish_reason = choice.finish_reason or finish_reason
    assert sorted(calls) == list(range(len(calls)))
    ordered = [calls[index] for index in sorted(calls)]
    return Reply(
        content or None,
        reasoning or None,
        [(name, json.loads(arguments)) for _, name, arguments in ordered],
        [call_id for call_id, _, _ in ordered],
        finish_reason,
        None,
        chunks,
    )
