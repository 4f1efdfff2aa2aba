"""``internlm``: InternLM2 / InternLM2.5 chat models, a JSON object with ``name`` and
``parameters`` in a plugin action, possibly after some text::

    <|action_start|><|plugin|>
    {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

An action of another kind (``<|interpreter|>``, code to run) is not a tool call.
"""

from __future__ import annotations

from tokenloom.plugin_api import (
    NEED_MORE,
    Section,
    SectionToolParser,
    call_from_object,
    load_json,
    skip_whitespace,
)

ACTION_START = "<|action_start|>"
PLUGIN = "<|plugin|>"
ACTION_END = "<|action_end|>"


class InternLMToolParser(SectionToolParser):
    start_markers = (ACTION_START,)
    argument_keys = ("parameters", "arguments")

    def parse_section(self, text: str, final: bool):
        position = skip_whitespace(text, 0)
        head = text[position : position + len(PLUGIN)]
        if head != PLUGIN:
            return NEED_MORE if PLUGIN.startswith(head) else None
        end = text.find(ACTION_END, position)
        if end < 0:
            return NEED_MORE
        call = call_from_object(load_json(text[position + len(PLUGIN) : end]), self.argument_keys)
        return Section([call], end + len(ACTION_END)) if call else None
