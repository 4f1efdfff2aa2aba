"""``llama4_pythonic``: Llama 4 (Scout, Maverick) pythonic tool calls: a Python list of
function calls with keyword arguments, opening the output, usually wrapped in Llama 4's
``<|python_start|>`` ... ``<|python_end|>`` (special tokens, kept in the decoded text)::

    <|python_start|>[get_weather(city="Paris"), get_time(zone="CET")]<|python_end|>

The format is ``pythonic``'s with Llama 4's wrapper, which ``pythonic`` reads too; this name
is the one Llama 4's docs and vLLM give it (use it with Llama 4's own chat template).
"""

from __future__ import annotations

from tokenloom.builtin_plugins.tool_parsers.pythonic import PythonicToolParser


class Llama4PythonicToolParser(PythonicToolParser):
    pass
