"""``example_call_tags``: tool calls written as ``<call>{"name": ..., "arguments": {...}}</call>``
anywhere in the output; the text around them is the message content.

A call whose body is not a JSON object with a string ``name`` (and, if present, an object
``arguments``) is not a tool call: it stays in the content, tags included, as does a
``<call>`` that is never closed.
"""

from __future__ import annotations

import json
import re
import uuid

from tokenloom.plugin_api import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta, ToolParser

OPEN_TAG = "<call>"
CLOSE_TAG = "</call>"
_CALL = re.compile(re.escape(OPEN_TAG) + "(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


def parse_call_body(body: str) -> tuple[str, str] | None:
    """``(name, arguments as JSON text)`` of a call body, or None when it is malformed."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_back(text: str) -> int:
    """How many trailing characters of ``text`` could be the start of the open tag."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


class CallTagToolParser(ToolParser):
    """One instance per request (the server makes it); the streaming state lives on it."""

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._buffer = ""  # text not yet emitted: a possible tag start, or an open call's body
        self._in_call = False
        self._num_calls = 0

    def extract(self, model_output, request=None):
        tool_calls: list[ToolCall] = []
        content_parts: list[str] = []
        position = 0
        for match in _CALL.finditer(model_output):
            parsed = parse_call_body(match.group(1))
            if parsed is None:
                continue  # malformed: left in the content with its tags
            content_parts.append(model_output[position:match.start()])
            position = match.end()
            tool_calls.append(ToolCall(name=parsed[0], arguments=parsed[1], id=new_call_id()))
        content_parts.append(model_output[position:])
        content = "".join(content_parts)
        return ExtractedToolCalls(tools_called=bool(tool_calls), tool_calls=tool_calls, content=content or None)

    def extract_delta(self, delta_text, request=None):
        self._buffer += delta_text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    break  # the call is not complete yet: hold it
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG):]
                self._in_call = False
                parsed = parse_call_body(body)
                if parsed is None:
                    content.append(OPEN_TAG + body + CLOSE_TAG)
                else:
                    # a call is sent whole, in one delta: its arguments are short JSON
                    calls.append(ToolCallDelta(index=self._num_calls, id=new_call_id(), name=parsed[0],
                                               arguments=parsed[1]))
                    self._num_calls += 1
                continue
            start = self._buffer.find(OPEN_TAG)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN_TAG):]
                self._in_call = True
                continue
            keep = _held_back(self._buffer)
            content.append(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return self._message("".join(content), calls)

    def finish(self, request=None):
        leftover = (OPEN_TAG if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return self._message(leftover, [])

    @staticmethod
    def _message(content: str, calls: list[ToolCallDelta]) -> DeltaMessage | None:
        if not content and not calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=calls)
