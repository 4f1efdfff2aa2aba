"""``qwen3``: Qwen3 (and QwQ-style) thinking, a ``<think>...</think>`` block opening the
output, then the answer. An output that does not open with ``<think>`` (thinking switched
off with ``chat_template_kwargs: {"enable_thinking": false}``) is all content::

    <think>
    Two plus two is four.
    </think>

    The answer is 4.

gives the reasoning ``"\nTwo plus two is four.\n"`` and the content ``"\n\nThe answer is 4."``,
whitespace kept as vLLM keeps it.

For Qwen3 "Thinking-2507" models, whose template opens ``<think>`` in the prompt, use
``deepseek_r1``.
"""

from __future__ import annotations

from tokenloom.plugin_api import MarkedReasoningParser


class Qwen3ReasoningParser(MarkedReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)
