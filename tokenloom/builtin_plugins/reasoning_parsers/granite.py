"""``granite``: IBM Granite 3.2+ with ``chat_template_kwargs: {"thinking": true}``, which
writes its reasoning after "Here is my thought process:" and its answer after "Here is my
response:" (either phrase may start "Here's"); an output opening otherwise is all content::

    Here is my thought process:
    Two plus two is four.
    Here is my response:
    The answer is 4.
"""

from __future__ import annotations

from tokenloom.plugin_api import MarkedReasoningParser


class GraniteReasoningParser(MarkedReasoningParser):
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
