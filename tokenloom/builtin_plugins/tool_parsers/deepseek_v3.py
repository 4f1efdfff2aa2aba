"""``deepseek_v3``: DeepSeek-V3 (and R1) tool calls, a block of calls, each naming its type and
function and carrying its arguments as a fenced JSON code block, possibly after some text::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The block's end marker may be missing when the output ends right after the last call.
"""

from __future__ import annotations

import json
import re

from tokenloom.plugin_api import NEED_MORE, ParsedCall, Section, SectionToolParser, load_json

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(
    r"\s*<｜tool▁call▁begin｜>(?P<type>[^<\n]*)<｜tool▁sep｜>(?P<name>[^\n<]+)\n"
    r"```(?:json)?\s*\n(?P<arguments>.*?)\n?```\s*<｜tool▁call▁end｜>",
    re.DOTALL,
)


def parse_calls(block: str) -> list[ParsedCall] | None:
    """The calls that make up ``block`` entirely (whitespace between them), or None."""
    calls, position = [], 0
    while block[position:].strip():
        match = _CALL.match(block, position)
        if match is None or match.group("type").strip() != "function":
            return None
        arguments = load_json(match.group("arguments"))
        if not isinstance(arguments, dict) or not match.group("name").strip():
            return None
        calls.append(ParsedCall(match.group("name").strip(), json.dumps(arguments, ensure_ascii=False)))
        position = match.end()
    return calls or None


class DeepSeekV3ToolParser(SectionToolParser):
    start_markers = (CALLS_BEGIN,)

    def parse_section(self, text: str, final: bool):
        end = text.find(CALLS_END)
        if end < 0:
            if not final:
                return NEED_MORE
            calls = parse_calls(text)  # the output ended after the last call
            return Section(calls, len(text)) if calls else None
        calls = parse_calls(text[:end])
        return Section(calls, end + len(CALLS_END)) if calls else None
