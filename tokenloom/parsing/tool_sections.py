"""What tool parsers are built from (tokenloom's own and plugins', through
``tokenloom.plugin_api``): :class:`SectionToolParser` finds call sections in
the output (a start marker anywhere, or a bare ``{``/``[`` opening the output), asks the
format's :meth:`~SectionToolParser.parse_section` to turn each into calls, and streams with
the very code that parses whole outputs, so any split into deltas gives the same result.

A call is sent once its section is complete and valid: a section that turns out malformed
(bad JSON, never closed) must come back as plain content, and a sent delta cannot be taken
back. Content is sent as soon as it cannot be the start of a marker.

Content is kept as the model wrote it, as vLLM keeps it: the text before the first call is
returned verbatim, whitespace included (``"Let me check.\n<tool_call>..."`` gives the
content ``"Let me check.\n"``); an output with no call is all content, unchanged. After a
call, whitespace between it and the end of the output or another call is dropped (vLLM
drops all text after a call; tokenloom keeps text that is more than whitespace).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloom.core.parsers import (
    DeltaMessage,
    ExtractedToolCalls,
    ParserTokenizer,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    find_first_marker,
    keep_special_tokens,
    partial_marker_length,
)

if TYPE_CHECKING:
    from tokenloom.core.parsers import ParserRequest, RequestT

# the formats' modules import these from here too
__all__ = [
    "NEED_MORE",
    "ParsedCall",
    "arguments_json",
    "Section",
    "SectionToolParser",
    "call_from_object",
    "calls_from_array",
    "find_first_marker",
    "json_array_section",
    "json_object_section",
    "json_value_end",
    "keep_special_tokens",
    "load_json",
    "partial_marker_length",
    "skip_whitespace",
]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Section:
    """A complete, valid call section: its calls and how many characters it spans."""

    calls: list[ParsedCall]
    length: int


class _NeedMore:
    def __repr__(self) -> str:
        return "NEED_MORE"


# parse_section's answer when the section may still become valid with more text
NEED_MORE = _NeedMore()

# what parse_section returns: a complete, valid section; None (malformed: the text is content); NEED_MORE
SectionResult = Section | None | _NeedMore


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


# a JSON string, a lone quote (a string not closed yet), or a bracket
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|"|[{}\[\]]', re.DOTALL)


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array opening at ``text[start]``, found by
    matching brackets outside strings; None when it is not closed yet. Validity is left to
    :func:`load_json`. (A streaming parser asks again at every delta: the scan runs in the
    regex engine.)"""
    depth = 0
    for match in _JSON_TOKENS.finditer(text, start):
        token = match.group()
        if token[0] == '"':
            if len(token) == 1:
                return None
            continue
        depth += 1 if token in "{[" else -1
        if depth == 0:
            return match.end()
    return None


_INVALID = object()


def load_json(text: str) -> Any:
    """The JSON value of ``text``, or ``_INVALID``."""
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


def arguments_json(text: str) -> str | None:
    """``text`` as compact JSON text when it is a JSON object (a call's arguments), else None."""
    value = load_json(text)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def call_from_object(value: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """``{"name": ..., "arguments": {...}}`` (or another argument key) as a call; None
    unless the name is a non-empty string and the arguments an object (or JSON text of one)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments: Any = {}
    for key in argument_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):
        arguments = load_json(arguments)  # some models write the arguments as a JSON string
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(name.strip(), json.dumps(arguments, ensure_ascii=False))


def calls_from_array(
    value: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> list[ParsedCall] | None:
    """A non-empty JSON array of call objects as calls; None if any element is not a call."""
    if not isinstance(value, list) or not value:
        return None
    calls = [call_from_object(item, argument_keys) for item in value]
    parsed = [call for call in calls if call is not None]
    return parsed if len(parsed) == len(calls) else None


def json_array_section(
    text: str, start: int, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> SectionResult:
    """The section made of the JSON array of calls at ``text[start:]`` (whitespace allowed
    before it): a :class:`Section`, None (malformed) or NEED_MORE."""
    position = skip_whitespace(text, start)
    if position == len(text):
        return NEED_MORE
    if text[position] != "[":
        return None
    end = json_value_end(text, position)
    if end is None:
        return NEED_MORE
    calls = calls_from_array(load_json(text[position:end]), argument_keys)
    return Section(calls, end) if calls else None


def json_object_section(
    text: str, start: int, argument_keys: tuple[str, ...] = ("arguments", "parameters")
) -> SectionResult:
    """The section made of one JSON call object at ``text[start:]`` (whitespace allowed before it)."""
    position = skip_whitespace(text, start)
    if position == len(text):
        return NEED_MORE
    if text[position] != "{":
        return None
    end = json_value_end(text, position)
    if end is None:
        return NEED_MORE
    call = call_from_object(load_json(text[position:end]), argument_keys)
    return Section([call], end) if call else None


class _ContentJoiner:
    """Joins the content pieces around calls. Content before the first call passes
    verbatim. After a call, whitespace is held until it is known to separate content from
    content (kept) or to border a call or the end of the output (dropped)."""

    def __init__(self) -> None:
        self.held_whitespace = ""
        self.seen_content = False
        self.any_call = False
        self.call_since_content = False
        # a malformed section's marker was dropped: trailing whitespace goes too (as vLLM strips it)
        self.strip_end = False

    def add_content(self, text: str) -> str:
        if not self.any_call:
            self.seen_content = self.seen_content or bool(text.strip())
            return text
        combined = self.held_whitespace + text
        core = combined.strip()
        if not core:
            self.held_whitespace = combined
            return ""
        leading = combined[: len(combined) - len(combined.lstrip())]
        trailing = combined[len(combined.rstrip()) :]
        if self.call_since_content and not self.seen_content:
            leading = ""  # calls opened the output
        self.held_whitespace = trailing
        self.seen_content = True
        self.call_since_content = False
        return leading + core

    def add_call(self) -> None:
        if not self.seen_content:
            self.held_whitespace = ""
        self.any_call = True
        self.call_since_content = True

    def drop_marker(self) -> None:
        """A malformed section's marker, left out of the content like a call."""
        self.add_call()
        self.strip_end = True

    def finish(self) -> str:
        held, self.held_whitespace = self.held_whitespace, ""
        return "" if self.call_since_content or self.strip_end else held


class _DroppedMarker:
    def __repr__(self) -> str:
        return "DROPPED_MARKER"


# a piece of _Scan._step: a malformed section's marker that the format leaves out of the content
_DROPPED_MARKER = _DroppedMarker()


class _Scan:
    """One parse of one output, fed piece by piece: the state a streaming parser keeps."""

    def __init__(self, parser: SectionToolParser):
        self.parser = parser
        self.buffer = ""
        self.start_checked = parser.bare_start is None
        self.joiner = _ContentJoiner()
        self.num_calls = 0
        # buffer length when an unfinished section last stopped the scan, or None
        self.section_waiting_at: int | None = None

    def feed(self, text: str, final: bool) -> tuple[str, list[tuple[int, ParsedCall]]]:
        """What ``text`` completes: (content, [(index, call)])."""
        self.buffer += text
        content: list[str] = []
        calls: list[tuple[int, ParsedCall]] = []
        waiting_at = self.section_waiting_at
        if (
            not final
            and waiting_at is not None
            and not any(char in self.parser.section_closers for char in self.buffer[max(waiting_at - 1, 0) :])
        ):
            # an unfinished section can only be decided once a closing character arrives:
            # skip re-reading it (deciding later is always safe, deciding wrong never is)
            return "", calls
        self.section_waiting_at = None
        while self.buffer:
            step = self._step(final)
            if step is None:
                break
            pieces, consumed = step
            self.buffer = self.buffer[consumed:]
            for piece in pieces:
                if isinstance(piece, ParsedCall):
                    self.joiner.add_call()
                    calls.append((self.num_calls, piece))
                    self.num_calls += 1
                elif piece is _DROPPED_MARKER:
                    self.joiner.drop_marker()
                else:
                    content.append(self.joiner.add_content(piece))
        if final:
            content.append(self.joiner.finish())
        return "".join(content), calls

    def _step(self, final: bool) -> tuple[list[str | ParsedCall | _DroppedMarker], int] | None:
        """The pieces at the start of the buffer and how many characters they span, or None
        when nothing can be decided before more text arrives."""
        parser, buffer = self.parser, self.buffer
        if not self.start_checked:
            body = buffer.lstrip()
            if not body and not final:
                return None
            self.start_checked = True
            if parser.bare_start is not None and body.startswith(parser.bare_start):
                section = parser.parse_section(body, final)
                if section is NEED_MORE and not final:
                    self.start_checked = False
                    self.section_waiting_at = len(buffer)
                    return None
                if isinstance(section, Section):
                    # whitespace before a call that opens the output is no content
                    leading = len(buffer) - len(body)
                    return list(section.calls), leading + section.length
        index, marker = find_first_marker(buffer, parser.start_markers)
        if marker is None:
            keep = 0 if final else partial_marker_length(buffer, parser.start_markers)
            return ([buffer[: len(buffer) - keep]], len(buffer) - keep) if keep < len(buffer) else None
        if index > 0:
            return [buffer[:index]], index
        section = parser.parse_section(buffer[len(marker) :], final)
        if section is NEED_MORE and not final:
            self.section_waiting_at = len(buffer)
            return None
        if isinstance(section, Section):
            return list(section.calls), len(marker) + section.length
        # not a call: the marker is plain text (or dropped, for a format that drops it), and
        # scanning goes on after it
        return [marker if parser.malformed_marker_kept else _DROPPED_MARKER], len(marker)


class SectionToolParser(ToolParser):
    """A tool parser for one output format. Subclasses set :attr:`start_markers` (and
    :attr:`bare_start`) and implement :meth:`parse_section`; one instance per request."""

    # text that opens a call section anywhere in the output
    start_markers: tuple[str, ...] = ()
    # text that opens a call section only at the very start of the output (after
    # whitespace); unlike a marker, it is part of the section parse_section reads
    bare_start: str | None = None
    # JSON keys a format may use for the arguments object
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    # the characters a section's text can end with (closing brackets, the ">" of an end
    # marker): an unfinished section is read again only once one of them has arrived
    section_closers: str = "}])>"
    # False: the marker of a malformed section is left out of the content, with the whitespace
    # after it and at the end of the output (vLLM's mistral parser does so); True: kept as text
    malformed_marker_kept: bool = True

    def __init__(self, tokenizer: ParserTokenizer | None = None) -> None:
        super().__init__(tokenizer)
        self._stream = _Scan(self)

    def parse_section(self, text: str, final: bool) -> SectionResult:
        """Read the section at the start of ``text`` (the text after a start marker, or from
        :attr:`bare_start` on). Return a :class:`Section` (its calls and the characters of
        ``text`` it spans), None when it is malformed, or NEED_MORE when more text could
        still complete it (``final`` is True when no more text will come)."""
        raise NotImplementedError

    def new_call_id(self) -> str | None:
        """The id of a new call; None lets the server assign its usual ``chatcmpl-tool-...``."""
        return None

    def adjust_request(self, request: RequestT) -> RequestT:
        # markers such as <tool_call> or [TOOL_CALLS] are special tokens in their models
        return keep_special_tokens(request)

    def extract(self, model_output: str, request: ParserRequest | None = None) -> ExtractedToolCalls:
        content, calls = _Scan(self).feed(model_output, final=True)
        tool_calls = [
            ToolCall(name=call.name, arguments=call.arguments, id=self.new_call_id() or "") for _, call in calls
        ]
        return ExtractedToolCalls(tools_called=bool(tool_calls), tool_calls=tool_calls, content=content or None)

    def extract_delta(self, delta_text: str, request: ParserRequest | None = None) -> DeltaMessage | None:
        return self._message(*self._stream.feed(delta_text, final=False))

    def finish(self, request: ParserRequest | None = None) -> DeltaMessage | None:
        return self._message(*self._stream.feed("", final=True))

    def _message(self, content: str, calls: list[tuple[int, ParsedCall]]) -> DeltaMessage | None:
        if not content and not calls:
            return None
        deltas = [
            ToolCallDelta(index=index, id=self.new_call_id(), name=call.name, arguments=call.arguments)
            for index, call in calls
        ]
        return DeltaMessage(content=content or None, tool_calls=deltas)
