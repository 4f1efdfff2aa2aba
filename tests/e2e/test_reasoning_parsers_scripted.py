"""Each reasoning parser added for vLLM's newer model families end to end: a real
``tokenloom serve`` of the scripted model answering in the family's real output format,
through the chat template, tokenizer, engine, detokenizer and parser, checked with the
official openai client, streamed and not. The expected splits are vLLM's, byte for byte
(the whitespace the model wrote stays where it was)."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import stop_server
from tests.e2e.scripted import Launch, ask, scripted_model_dir

pytestmark = pytest.mark.slow

THOUGHT = "Two plus two is four; 2² = 4."
ANSWER = "The answer is 4. 答案是四。"

# parser -> scenario -> (model output, reasoning_content, content)
SCENARIOS = {
    "glm45": {
        "think": (f"<think>{THOUGHT}</think>\n{ANSWER}", THOUGHT, f"\n{ANSWER}"),
        "no_think": (f"\n{ANSWER}", None, f"\n{ANSWER}"),
    },
    "hunyuan_a13b": {
        "think": (f"<think>\n{THOUGHT}\n</think>\n<answer>\n{ANSWER}\n</answer>", THOUGHT, ANSWER),
        "no_think": (f"<think>\n\n</think>\n<answer>\n{ANSWER}\n</answer>", None, ANSWER),
    },
    "seed_oss": {
        "think": (f"<seed:think>\n{THOUGHT}\n</seed:think>\n{ANSWER}", f"\n{THOUGHT}\n", f"\n{ANSWER}"),
        "no_think": (f"{THOUGHT}</seed:think>{ANSWER}", THOUGHT, ANSWER),
    },
    "step3": {
        "think": (f"{THOUGHT}\n</think>\n\n{ANSWER}", f"{THOUGHT}\n", f"\n\n{ANSWER}"),
        "no_think": (f"{THOUGHT} still thinking", f"{THOUGHT} still thinking", None),
    },
    "openai_gptoss": {
        "think": (
            f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
            THOUGHT,
            ANSWER,
        ),
        "no_think": (ANSWER, None, ANSWER),
    },
}
PARSERS = list(SCENARIOS)


@pytest.fixture(scope="module")
def launches(tmp_path_factory, scripted_tokenizer):
    """``launch(parser)``: its server, started once (not waited for)."""
    started: dict[str, Launch] = {}

    def launch(name: str) -> Launch:
        if name not in started:
            directory = tmp_path_factory.mktemp(f"scripted-{name}")
            scenarios = {scenario: output for scenario, (output, _, _) in SCENARIOS[name].items()}
            model_dir = scripted_model_dir(str(directory / "model"), scripted_tokenizer, scenarios)
            started[name] = Launch(model_dir, str(directory / "serve.log"), "--reasoning-parser", name)
        return started[name]

    yield launch
    for launched in started.values():
        if launched.server.process.poll() is None:
            stop_server(launched.server)


@pytest.fixture(scope="module")
def parser(request, launches):
    """A server whose reasoning parser is ``request.param``; the next parser's starts meanwhile."""
    name = request.param
    launched = launches(name)
    following = PARSERS.index(name) + 1
    if following < len(PARSERS):
        launches(PARSERS[following])
    server = launched.wait_ready()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield name, client
    stop_server(server)


@pytest.mark.parametrize("parser", PARSERS, indirect=True)
@pytest.mark.parametrize("scenario", ["think", "no_think"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_parser_end_to_end(parser, scenario: str, stream: bool):
    name, client = parser
    _, reasoning, content = SCENARIOS[name][scenario]
    reply = ask(client, scenario, stream=stream, max_tokens=400)
    assert (reply.reasoning_content, reply.content) == (reasoning, content)
    assert reply.calls == [] and reply.finish_reason == "stop"
