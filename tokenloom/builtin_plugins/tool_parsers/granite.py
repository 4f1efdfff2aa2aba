"""``granite``: IBM Granite 3.0 / 3.1 instruct models, one JSON array of calls after
``<|tool_call|>`` (3.0, a special token) or ``<tool_call>`` (3.1), or opening the output::

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

from tokenloom.plugin_api import SectionToolParser, json_array_section


class GraniteToolParser(SectionToolParser):
    start_markers = ("<|tool_call|>", "<tool_call>")
    bare_start = "["

    def parse_section(self, text: str, final: bool):
        return json_array_section(text, 0, self.argument_keys)
