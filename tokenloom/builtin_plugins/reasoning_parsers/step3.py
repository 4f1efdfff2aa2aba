"""``step3``: StepFun Step-3, whose output is reasoning from its first character up to
``</think>`` (there is no start marker to look for: a ``<think>`` in the text is reasoning
like the rest), then the answer; an output that never writes ``</think>`` is all reasoning::

    Two plus two is four.</think>The answer is 4.
"""

from __future__ import annotations

from tokenloom.plugin_api import MarkedReasoningParser


class Step3ReasoningParser(MarkedReasoningParser):
    end_markers = ("</think>",)
    starts_in_reasoning = True
