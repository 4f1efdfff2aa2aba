"""``seed_oss``: ByteDance Seed-OSS, reasoning in ``<seed:think>...</seed:think>`` opening the
output, then the answer. As with ``deepseek_r1``, the output is reasoning from its start
even when the model leaves out ``<seed:think>``, up to ``</seed:think>``; an output that
never closes its reasoning is all reasoning::

    <seed:think>Two plus two is four.</seed:think>The answer is 4.
"""

from __future__ import annotations

from tokenloom.plugin_api import MarkedReasoningParser


class SeedOssReasoningParser(MarkedReasoningParser):
    start_markers = ("<seed:think>",)
    end_markers = ("</seed:think>",)
    starts_in_reasoning = True
