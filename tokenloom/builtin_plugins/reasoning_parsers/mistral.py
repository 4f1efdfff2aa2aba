"""``mistral``: Magistral (Mistral's reasoning models), a ``[THINK]...[/THINK]`` block opening
the output, then the answer; ``[THINK]`` and ``[/THINK]`` are special tokens, kept in the
decoded text for this parser. An output that does not open with ``[THINK]`` is all content::

    [THINK]Two plus two is four.[/THINK]The answer is 4.
"""

from __future__ import annotations

from tokenloom.plugin_api import MarkedReasoningParser


class MistralReasoningParser(MarkedReasoningParser):
    start_markers = ("[THINK]",)
    end_markers = ("[/THINK]",)
    markers_are_special_tokens = True
