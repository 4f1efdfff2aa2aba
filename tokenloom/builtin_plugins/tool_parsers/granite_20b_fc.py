"""``granite-20b-fc``: IBM Granite-20B-FunctionCalling, each call a JSON object after its own
``<function_call>`` tag (no closing tag), possibly after some text::

    <function_call> {"name": "get_weather", "arguments": {"city": "Paris"}}
    <function_call> {"name": "get_time", "arguments": {"zone": "CET"}}
"""

from __future__ import annotations

from tokenloom.plugin_api import SectionToolParser, json_object_section

CALL_TAG = "<function_call>"


class Granite20bFCToolParser(SectionToolParser):
    start_markers = (CALL_TAG,)

    def parse_section(self, text: str, final: bool):
        return json_object_section(text, 0, self.argument_keys)
