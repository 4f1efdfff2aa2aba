"""``glm45``: GLM-4.5 / GLM-4.6 (Zhipu's ``Glm4MoeForCausalLM``), a ``<think>...</think>``
block opening the output, then the answer; an output that does not open with ``<think>``
(thinking switched off with ``chat_template_kwargs: {"enable_thinking": false}``, whose
template writes the empty block in the prompt) is all content::

    <think>Two plus two is four.</think>
    The answer is 4.
"""

from __future__ import annotations

from tokenloom.plugin_api import MarkedReasoningParser


class Glm45ReasoningParser(MarkedReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)
