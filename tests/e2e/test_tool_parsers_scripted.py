"""Each tool parser end to end: a real ``tokenloom serve`` of the scripted model that answers
in the parser's real output format, through the chat template, tokenizer, engine,
detokenizer and parser, checked with the official openai client, streamed and not. Three
servers also run their family's reasoning parser, so reasoning and calls arrive together;
the example ``--tool-parser-plugin`` file gets a server of its own."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from tests.builtin_plugins.tool_parsers.formats import EXAMPLE_PARSER, MALFORMED, TOOLS_FOR_CASES, Case, standard_cases
from tests.e2e.conftest import stop_server
from tests.e2e.scripted import Launch, ask, scripted_model_dir
from tokenloom.builtin_plugins.tool_parsers import TOOL_PARSERS

pytestmark = pytest.mark.slow

EXAMPLE_FILE = str(Path(__file__).resolve().parents[2] / "examples" / "my_tool_parser.py")
REASONING = "The user asked about the weather in Paris, so I call the tool."
# the reasoning parser each family's server runs, how that family writes its reasoning, and
# what the parsers make of it, byte for byte as vLLM: the reasoning with the whitespace inside
# its markers, and the whitespace after the end marker, which opens the content
REASONING_PARSERS = {
    "mistral": ("mistral", lambda text: f"[THINK]{text}[/THINK]", REASONING, ""),
    "granite": (
        "granite",
        lambda text: f"Here is my thought process:\n{text}\nHere is my response:\n",
        f"\n{REASONING}\n",
        "\n",
    ),
    "deepseek_v3": ("deepseek_r1", lambda text: f"{text}\n</think>\n\n", f"{REASONING}\n", "\n\n"),
}
PARSERS = [*TOOL_PARSERS, EXAMPLE_PARSER]


def half_of(parser: str) -> str:
    """Under `make test` the module is two work units (tests/helpers/xdist_scheduling.py), every
    other parser's server in each, so both workers share its dozen server starts."""
    return f"tool-parsers-scripted-{PARSERS.index(parser) % 2}"


PARSER_PARAMS = [pytest.param(name, marks=pytest.mark.xdist_group(half_of(name))) for name in PARSERS]


def cases_for(parser: str) -> list[Case]:
    malformed = next(case for case in MALFORMED if case.parser == parser)
    return standard_cases(parser) + [malformed]


def scripted_output(case: Case) -> str:
    if case.parser not in REASONING_PARSERS:
        return case.output
    _, write_reasoning, _, _ = REASONING_PARSERS[case.parser]
    return write_reasoning(REASONING) + case.output


@pytest.fixture(scope="module")
def launches(tmp_path_factory, scripted_tokenizer):
    """``launch(parser)``: its server, started once (not waited for), scripted with its cases."""
    started: dict[str, Launch] = {}

    def launch(name: str) -> Launch:
        if name not in started:
            directory = tmp_path_factory.mktemp(f"scripted-{name}")
            scenarios = {case.name: scripted_output(case) for case in cases_for(name)}
            model_dir = scripted_model_dir(str(directory / "model"), scripted_tokenizer, scenarios)
            flags = ["--enable-auto-tool-choice", "--tool-call-parser", name]
            if name in REASONING_PARSERS:
                flags += ["--reasoning-parser", REASONING_PARSERS[name][0]]
            if name == EXAMPLE_PARSER:
                flags += ["--tool-parser-plugin", EXAMPLE_FILE]
            started[name] = Launch(model_dir, str(directory / "serve.log"), *flags)
        return started[name]

    yield launch
    for launched in started.values():
        if launched.server.process.poll() is None:
            stop_server(launched.server)


def parsers_to_test(session) -> list[str]:
    """The parsers of the collected tests of this module, in the order they run."""
    names = []
    for item in session.items:
        name = getattr(item, "callspec", None) and item.callspec.params.get("parser")
        if item.module.__name__ == __name__ and name and name not in names:
            names.append(name)
    return names


@pytest.fixture(scope="module")
def parser(request, launches):
    """A server whose tool parser is ``request.param``; the next parser's starts meanwhile."""
    name = request.param
    launched = launches(name)
    upcoming = parsers_to_test(request.session)
    if hasattr(request.config, "workerinput"):  # an xdist worker runs only its half's servers
        upcoming = [other for other in upcoming if half_of(other) == half_of(name)]
    if name in upcoming and upcoming.index(name) + 1 < len(upcoming):
        launches(upcoming[upcoming.index(name) + 1])
    server = launched.wait_ready()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield name, client
    stop_server(server)


CASE_NAMES = [case.name for case in standard_cases("hermes")] + ["malformed"]
STREAM_MODES = [False, True]


@pytest.fixture(scope="module")
def replies(parser):
    """Every case's reply from the parser's server, whole and streamed, asked all at once (the
    engine batches them: one at a time, each paid its own decode steps); a request that failed
    holds its exception, raised by the test of that case."""
    name, client = parser

    def reply_to(case: Case, stream: bool):
        try:
            return ask(client, case.name, stream=stream, tools=TOOLS_FOR_CASES, max_tokens=400)
        except Exception as error:  # noqa: BLE001 -- the test of this case raises it
            return error

    requests = [(case, stream) for case in cases_for(name) for stream in STREAM_MODES]
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda request: reply_to(*request), requests))
    return {(case.name, stream): answer for (case, stream), answer in zip(requests, answers)}


@pytest.mark.parametrize("parser", PARSER_PARAMS, indirect=True)
@pytest.mark.parametrize("case_name", CASE_NAMES)
@pytest.mark.parametrize("stream", STREAM_MODES, ids=["whole", "streamed"])
def test_parser_end_to_end(parser, replies, case_name: str, stream: bool):
    name, _ = parser
    case = cases_for(name)[CASE_NAMES.index(case_name)]
    reply = replies[(case.name, stream)]
    if isinstance(reply, Exception):
        raise reply
    _, _, expected_reasoning, content_before = REASONING_PARSERS.get(case.parser, (None, None, None, ""))
    # the whitespace after the reasoning comes before everything the tool parser returns as content
    expected_content = (content_before + (case.content or "")) or None
    assert reply.content == expected_content
    assert reply.calls == list(case.calls)
    assert reply.finish_reason == ("tool_calls" if case.calls else "stop")
    assert reply.reasoning_content == expected_reasoning
    if case.parser == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call_id) for call_id in reply.call_ids)
    else:
        assert all(call_id.startswith("chatcmpl-tool-") for call_id in reply.call_ids)
