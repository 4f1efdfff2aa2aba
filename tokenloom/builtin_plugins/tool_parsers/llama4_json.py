"""``llama4_json``: Llama 4 JSON tool calls: the Llama 3 format (call objects with ``name``
and ``parameters``, separated by ``;``), opening the output or wrapped in Llama 4's
``<|python_start|>`` ... ``<|python_end|>``::

    <|python_start|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|python_end|>
"""

from __future__ import annotations

from tokenloom.builtin_plugins.tool_parsers.llama3_json import Llama3JsonToolParser


class Llama4JsonToolParser(Llama3JsonToolParser):
    start_markers = ("<|python_start|>", "<|python_tag|>")
    section_end_marker = "<|python_end|>"
