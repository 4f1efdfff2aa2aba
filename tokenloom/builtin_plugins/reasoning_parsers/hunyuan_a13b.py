"""``hunyuan_a13b``: Tencent Hunyuan-A13B, which writes its reasoning between ``<think>`` and
``</think>`` and its answer between ``<answer>`` and ``</answer>``, each tag on a line of
its own::

    <think>
    Two plus two is four.
    </think>
    <answer>
    The answer is 4.
    </answer>

The newlines that belong to the tags are part of the markers (``"<think>\\n"``,
``"\\n</think>\\n<answer>\\n"``, ``"\\n</answer>"``), so the reasoning above is
``"Two plus two is four."`` and the content ``"The answer is 4."``, as vLLM splits them; an
empty reasoning (fast thinking, ``<think>\\n\\n</think>``) gives None. An answer without a
reasoning section (``The answer is 4.\\n</answer>``) is content, its closing tag dropped.
"""

from __future__ import annotations

from tokenloom.plugin_api import MarkedReasoningParser


class HunyuanA13BReasoningParser(MarkedReasoningParser):
    start_markers = ("<think>\n",)
    end_markers = ("\n</think>\n<answer>\n",)
    answer_end_markers = ("\n</answer>",)
    empty_reasoning_is_none = True
