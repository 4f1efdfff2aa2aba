"""``hermes``: Hermes 2 Pro / Hermes 3 and Qwen2.5-style tool calls, each a JSON object in
its own ``<tool_call>...</tool_call>`` block, anywhere in the output::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from tokenloom.plugin_api import (
    NEED_MORE,
    Section,
    SectionToolParser,
    call_from_object,
    load_json,
)

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesToolParser(SectionToolParser):
    start_markers = (OPEN_TAG,)

    def parse_section(self, text: str, final: bool):
        end = text.find(CLOSE_TAG)
        if end < 0:
            return NEED_MORE
        call = call_from_object(load_json(text[:end]), self.argument_keys)
        return Section([call], end + len(CLOSE_TAG)) if call else None
