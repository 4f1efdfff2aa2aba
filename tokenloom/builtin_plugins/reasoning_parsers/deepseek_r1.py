"""``deepseek_r1``: DeepSeek-R1 and its distills. The chat template opens ``<think>`` in the
prompt, so the output is reasoning from its start (an echoed ``<think>`` is dropped) up to
``</think>``; the answer follows, both kept as written (whitespace included, as vLLM keeps
them). An output that never closes its reasoning is all reasoning::

    Two plus two is four.</think>The answer is 4.
"""

from __future__ import annotations

from tokenloom.plugin_api import MarkedReasoningParser


class DeepSeekR1ReasoningParser(MarkedReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)
    starts_in_reasoning = True
