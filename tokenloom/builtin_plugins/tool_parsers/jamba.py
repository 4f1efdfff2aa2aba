"""``jamba``: AI21 Jamba 1.5 tool calls, one JSON array of calls between ``<tool_calls>`` and
``</tool_calls>``, possibly after some text::

    <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>
"""

from __future__ import annotations

from tokenloom.plugin_api import (
    NEED_MORE,
    Section,
    SectionToolParser,
    calls_from_array,
    load_json,
)

OPEN_TAG = "<tool_calls>"
CLOSE_TAG = "</tool_calls>"


class JambaToolParser(SectionToolParser):
    start_markers = (OPEN_TAG,)

    def parse_section(self, text: str, final: bool):
        end = text.find(CLOSE_TAG)
        if end < 0:
            return NEED_MORE
        calls = calls_from_array(load_json(text[:end]), self.argument_keys)
        return Section(calls, end + len(CLOSE_TAG)) if calls else None
