"""An example ``--tool-parser-plugin`` file: a parser for Llama 3.1's custom-tool format,
where each call is written as ``<function=NAME>{...arguments...}</function>``::

    tokenloom serve MODEL --tool-parser-plugin examples/my_tool_parser.py \
        --enable-auto-tool-choice --tool-call-parser llama3_function_tags

The file imports only from ``tokenloom.plugin_api``; the decorator registers the class
under its name when tokenloom loads the file (importing it registers nothing). Text around
the calls is the message content; a tag whose body is not a JSON object, or that is never
closed, stays in the content as written.
"""

from __future__ import annotations

import json
import re

from tokenloom.plugin_api import DeltaMessage, ExtractedToolCalls, ToolCall, ToolCallDelta, ToolParser, register_tool_parser

OPEN_PREFIX = "<function="
CLOSE_TAG = "</function>"
_CALL = re.compile(r"<function=([A-Za-z0-9_.\-]+)>(.*?)</function>", re.DOTALL)


def parse_arguments(body: str) -> str | None:
    """The arguments as JSON text, or None when ``body`` is not a JSON object."""
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else None


@register_tool_parser("llama3_function_tags")
class FunctionTagToolParser(ToolParser):
    """One instance per request: the streaming state lives on it."""

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._buffer = ""  # text not sent yet: a possible tag start, or an unfinished call
        self._num_calls = 0

    def extract(self, model_output, request=None):
        content, calls = self._scan(model_output, final=True)[:2]
        tool_calls = [ToolCall(name=name, arguments=arguments) for name, arguments in calls]
        return ExtractedToolCalls(tools_called=bool(tool_calls), tool_calls=tool_calls, content=content or None)

    def extract_delta(self, delta_text, request=None):
        content, calls, self._buffer = self._scan(self._buffer + delta_text, final=False)
        return self._message(content, calls)

    def finish(self, request=None):
        content, calls, self._buffer = self._scan(self._buffer, final=True)
        return self._message(content, calls)

    def _scan(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]], str]:
        """(content, calls, rest to keep) of ``text``."""
        content, calls = [], []
        while text:
            start = text.find(OPEN_PREFIX)
            if start < 0:
                keep = 0 if final else _possible_tag_start(text)
                content.append(text[:len(text) - keep])
                return "".join(content), calls, text[len(text) - keep:]
            content.append(text[:start])
            text = text[start:]
            match = _CALL.match(text)
            if match is None:
                if not final and CLOSE_TAG not in text:
                    return "".join(content), calls, text  # the call may still complete
                content.append(OPEN_PREFIX)  # not a call: plain text
                text = text[len(OPEN_PREFIX):]
                continue
            arguments = parse_arguments(match.group(2))
            if arguments is None:
                content.append(OPEN_PREFIX)
                text = text[len(OPEN_PREFIX):]
                continue
            calls.append((match.group(1), arguments))
            text = text[match.end():]
        return "".join(content), calls, ""

    def _message(self, content: str, calls: list[tuple[str, str]]):
        deltas = []
        for name, arguments in calls:
            deltas.append(ToolCallDelta(index=self._num_calls, name=name, arguments=arguments))
            self._num_calls += 1
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas)


def _possible_tag_start(text: str) -> int:
    """How many trailing characters of ``text`` could begin ``<function=``."""
    for length in range(min(len(text), len(OPEN_PREFIX) - 1), 0, -1):
        if OPEN_PREFIX.startswith(text[-length:]):
            return length
    return 0
