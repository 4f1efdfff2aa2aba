"""Every built-in tool parser (and the example ``--tool-parser-plugin`` file's) on its model
family's real output format: exact non-streaming results, and — for every way of splitting
the output into streamed deltas — the same content and calls from the streaming parser,
sent in OpenAI's delta shape. Parsers are looked up by name, as the server does."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.builtin_plugins.tool_parsers.formats import CASES, EXAMPLE_PARSER, FORMATS, Case
from tokenloom.builtin_plugins.tool_parsers import TOOL_PARSERS
from tokenloom.plugins.manager import load_plugins

EXAMPLE_FILE = Path(__file__).resolve().parents[3] / "examples" / "my_tool_parser.py"


@functools.cache
def parser_classes() -> dict[str, type]:
    registry = load_plugins(files=[str(EXAMPLE_FILE)]).registry("tool_parser")
    return {name: registry.get(name) for name in FORMATS}


def parser_for(name: str):
    return parser_classes()[name](None)


def calls_of(tool_calls) -> list:
    return [(call.name, json.loads(call.arguments)) for call in tool_calls]


def streamed(parser, pieces: list[str]) -> tuple[str | None, list, list]:
    """(content, calls, deltas) from feeding ``pieces`` one by one, then finish()."""
    messages = [parser.extract_delta(piece, None) for piece in pieces] + [parser.finish(None)]
    content = "".join(message.content or "" for message in messages if message is not None)
    deltas = [delta for message in messages if message is not None for delta in message.tool_calls]
    calls: dict[int, list] = {}
    for delta in deltas:
        entry = calls.setdefault(delta.index, [delta.name, ""])
        entry[1] += delta.arguments or ""
    ordered = [(name, json.loads(arguments)) for _, (name, arguments) in sorted(calls.items())]
    return content or None, ordered, deltas


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    bounds = [0, *points, len(text)]
    return [text[start:end] for start, end in zip(bounds, bounds[1:])]


def test_every_format_has_cases():
    assert set(FORMATS) == {*TOOL_PARSERS, EXAMPLE_PARSER}
    for name in FORMATS:
        kinds = {case.name for case in CASES if case.parser == name}
        assert {"single", "parallel", "text_before", "unicode_nested", "plain_text"} <= kinds
        assert any(
            case.content is not None and not case.calls and case.name != "plain_text"
            for case in CASES
            if case.parser == name
        ), f"{name} has no malformed case"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_extract_is_exact(case: Case):
    result = parser_for(case.parser).extract(case.output, None)
    assert result.content == case.content
    assert calls_of(result.tool_calls) == list(case.calls)
    assert result.tools_called == bool(case.calls)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_streaming_character_by_character_and_whole(case: Case):
    expected = parser_for(case.parser).extract(case.output, None)
    for pieces in (list(case.output), [case.output]):
        content, calls, deltas = streamed(parser_for(case.parser), pieces)
        assert (content, calls) == (expected.content, calls_of(expected.tool_calls))
        # OpenAI's shape: calls numbered from 0 in order, each opening with its name
        assert [delta.index for delta in deltas if delta.name] == list(range(len(expected.tool_calls)))
        assert all(delta.name and delta.arguments is not None for delta in deltas)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=100_000), max_size=40))
def test_any_split_streams_the_non_streaming_result(case: Case, cuts: list[int]):
    expected = parser_for(case.parser).extract(case.output, None)
    content, calls, _ = streamed(parser_for(case.parser), split_at(case.output, cuts))
    assert content == expected.content
    assert calls == calls_of(expected.tool_calls)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_builtin_adjust_request_keeps_special_tokens_verbatim(name):
    from tokenloom.api.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    adjusted = parser_for(name).adjust_request(request)
    assert adjusted.skip_special_tokens is False and adjusted.spaces_between_special_tokens is False
    assert request.skip_special_tokens is True  # the original is left alone
