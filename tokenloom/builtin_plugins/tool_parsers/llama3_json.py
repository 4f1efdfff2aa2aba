"""``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON tool calls, a call object with ``name`` and
``parameters`` opening the output (or after ``<|python_tag|>``); several calls are
separated by ``;``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
"""

from __future__ import annotations

from tokenloom.plugin_api import (
    NEED_MORE,
    Section,
    SectionToolParser,
    call_from_object,
    json_value_end,
    load_json,
    skip_whitespace,
)

SEPARATOR = ";"


class Llama3JsonToolParser(SectionToolParser):
    start_markers = ("<|python_tag|>",)
    bare_start = "{"
    argument_keys = ("parameters", "arguments")
    # a marker that may close the section (consumed with it when present)
    section_end_marker: str | None = None

    def parse_section(self, text: str, final: bool):
        calls, position = [], skip_whitespace(text, 0)
        while True:
            if position == len(text):
                if calls and final:
                    return Section(calls, position)  # a trailing ";"
                return NEED_MORE
            if text[position] != "{":
                return None
            end = json_value_end(text, position)
            if end is None:
                return NEED_MORE
            call = call_from_object(load_json(text[position:end]), self.argument_keys)
            if call is None:
                return None
            calls.append(call)
            after = skip_whitespace(text, end)
            if after == len(text) and not final:
                return NEED_MORE  # a ";" and another call may follow
            if text.startswith(SEPARATOR, after):
                position = skip_whitespace(text, after + len(SEPARATOR))
                continue
            marker = self.section_end_marker
            if marker:
                rest = text[after : after + len(marker)]
                if rest == marker:
                    return Section(calls, after + len(marker))
                if marker.startswith(rest) and not final:
                    return NEED_MORE
            return Section(calls, end)
