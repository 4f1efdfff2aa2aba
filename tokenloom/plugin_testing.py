"""Checks a plugin's own tests can call: the conformance properties tokenloom's built-in
parsers are held to, and the registration check ``tokenloom plugins`` makes, as plain
functions that raise ``AssertionError`` with a message saying what differed. No pytest
needed; nothing here runs at import.

::

    from tokenloom.plugin_testing import assert_registers, assert_tool_parser_streams_like_extract

    def test_registration():
        assert_registers("my_package.hooks", {"tool_parser": ["my_format"]})

    def test_any_split():
        assert_tool_parser_streams_like_extract(MyToolParser, 'Hi <call>{"name": "f", "arguments": {}}</call>')
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenloom.core.parsers import DeltaMessage, ReasoningParser, ToolParser
    from tokenloom.plugins.manager import PluginInfo, PluginSet

__all__ = [
    "assert_reasoning_parser_streams_like_extract",
    "assert_registers",
    "assert_tool_parser_streams_like_extract",
    "load_plugin",
    "splits",
]


def splits(text: str, *, max_three_way: int = 300, seed: int = 0) -> Iterator[list[str]]:
    """Ways to cut ``text`` into streamed deltas: whole, one character at a time, every cut
    into two, and (a seeded sample of at most ``max_three_way``) cuts into three."""
    yield [text]
    yield list(text)
    cuts = range(1, len(text))
    for cut in cuts:
        yield [text[:cut], text[cut:]]
    pairs = list(itertools.combinations(cuts, 2))
    if len(pairs) > max_three_way:
        pairs = random.Random(seed).sample(pairs, max_three_way)
    for first, second in pairs:
        yield [text[:first], text[first:second], text[second:]]


def _messages(
    feed: Callable[[str], DeltaMessage | None], finish: Callable[[], DeltaMessage | None], pieces: Iterable[str]
) -> list[DeltaMessage]:
    messages = [feed(piece) for piece in pieces] + [finish()]
    return [message for message in messages if message is not None]


def assert_tool_parser_streams_like_extract(
    parser_factory: Callable[[], ToolParser], output: str, request: Any = None, *, max_three_way: int = 300
) -> None:
    """Streaming ``output`` through a fresh parser from ``parser_factory()`` (a parser class
    works: it is called with no arguments) gives, for every split into deltas, the content and
    calls that :meth:`~tokenloom.plugin_api.ToolParser.extract` gives on the whole text, in
    OpenAI's delta shape (calls indexed from 0 in order, each opening with its name, argument
    pieces adding up to the same JSON)."""
    expected = parser_factory().extract(output, request)
    expected_calls = [(call.name, json.loads(call.arguments)) for call in expected.tool_calls]
    for pieces in splits(output, max_three_way=max_three_way):
        parser = parser_factory()
        messages = _messages(
            functools.partial(parser.extract_delta, request=request), functools.partial(parser.finish, request), pieces
        )
        content = "".join(message.content or "" for message in messages) or None
        calls: dict[int, list[str]] = {}
        opened: list[int] = []
        for delta in (delta for message in messages for delta in message.tool_calls):
            if delta.index not in calls:
                assert delta.name, f"split {pieces!r}: call {delta.index} did not open with its name"
                opened.append(delta.index)
                calls[delta.index] = [delta.name, ""]
            calls[delta.index][1] += delta.arguments or ""
        assert opened == list(range(len(opened))), f"split {pieces!r}: calls indexed {opened}, not 0, 1, ..."
        streamed_calls = [(name, _json_object(arguments, pieces)) for name, arguments in calls.values()]
        assert content == expected.content, (
            f"split {pieces!r}: streamed content {content!r} but extract() gives {expected.content!r}"
        )
        assert streamed_calls == expected_calls, (
            f"split {pieces!r}: streamed calls {streamed_calls!r} but extract() gives {expected_calls!r}"
        )


def _json_object(arguments: str, pieces: list[str]) -> Any:
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        raise AssertionError(f"split {pieces!r}: a call's streamed arguments are not JSON: {arguments!r}") from None


def assert_reasoning_parser_streams_like_extract(
    parser_factory: Callable[[], ReasoningParser], output: str, request: Any = None, *, max_three_way: int = 300
) -> None:
    """Streaming ``output`` through a fresh parser gives, for every split into deltas, the
    ``(reasoning_content, content)`` that
    :meth:`~tokenloom.plugin_api.ReasoningParser.extract_reasoning` gives on the whole text
    (an empty string there, e.g. an empty reasoning section, streams as nothing: it counts as None)."""
    reasoning, content = parser_factory().extract_reasoning(output, request)
    expected = (reasoning or None, content or None)
    for pieces in splits(output, max_three_way=max_three_way):
        reasoning_parser = parser_factory()
        messages = _messages(
            functools.partial(reasoning_parser.extract_reasoning_delta, request=request),
            functools.partial(reasoning_parser.finish, request),
            pieces,
        )
        streamed = (
            "".join(message.reasoning_content or "" for message in messages) or None,
            "".join(message.content or "" for message in messages) or None,
        )
        assert streamed == expected, (
            f"split {pieces!r}: streamed (reasoning, content) {streamed!r} but extract_reasoning() gives {expected!r}"
        )


def _load_alone(module: str | None, file: str | None) -> tuple[PluginSet, PluginInfo]:
    from tokenloom.plugins.manager import load_plugins

    if (module is None) == (file is None):
        raise TypeError("give a module name or file=PATH, one of the two")
    plugin_set = load_plugins(modules=[module] if module else [], files=[file] if file else [], entry_points=False)
    [info] = plugin_set.plugins
    assert info.registered, f"plugin {info.name!r} registered nothing: {info.nothing_registered_reason()}"
    return plugin_set, info


def load_plugin(module: str | None = None, *, file: str | None = None) -> PluginInfo:
    """Load one plugin the way ``--plugin MODULE`` (or ``--tool-parser-plugin FILE``) does,
    without the installed entry points, and return what it registered. Raises
    :class:`~tokenloom.plugin_api.PluginError` with the cause (and the file and line) if it
    fails to load, or ``AssertionError`` saying why if it registered nothing."""
    return _load_alone(module, file)[1]


def assert_registers(
    module: str | None = None,
    expected: Mapping[str, Sequence[str]] | None = None,
    *,
    file: str | None = None,
    resolve: bool = True,
) -> None:
    """The plugin loads, registers exactly ``expected`` (``{kind: [names]}``, kinds as
    ``tokenloom plugins`` lists them: ``tool_parser``, ``api_route``, ...), and every target
    it registered imports (``resolve=False`` skips that)."""
    plugin_set, info = _load_alone(module, file)
    registered = {kind: sorted(names) for kind, names in info.registered.items()}
    if expected is not None:
        wanted = {kind: sorted(names) for kind, names in expected.items()}
        assert registered == wanted, f"plugin {info.name!r} registered {registered}, expected {wanted}"
    if resolve:
        for kind, names in info.registered.items():
            for name in names:
                plugin_set.registry(kind).entry(name).resolve()  # a PluginError names what failed
