"""``phi4_mini_json``: Microsoft Phi-4-mini-instruct, a JSON array of calls right after the
word ``functools``::

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

from tokenloom.plugin_api import NEED_MORE, SectionToolParser, json_array_section

MARKER = "functools"


class Phi4MiniJsonToolParser(SectionToolParser):
    start_markers = (MARKER,)

    def parse_section(self, text: str, final: bool):
        # the array follows the word directly: "functools are..." is prose
        if not text:
            return NEED_MORE
        return json_array_section(text, 0, self.argument_keys) if text[0] == "[" else None
