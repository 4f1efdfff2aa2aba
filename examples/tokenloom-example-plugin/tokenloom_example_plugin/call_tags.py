"""``example_call_tags``: tool calls written as ``<call>{"name": ..., "arguments": {...}}</call>``
anywhere in the output; the text around them is the message content.

A call whose body is not a JSON object with a string ``name`` (and, if present, an object
``arguments``, or JSON text of one) is not a tool call: it stays in the content, tags
included, as does a ``<call>`` that is never closed. The text before the first call is kept as
written; whitespace between a call and the end of the output or the next call is dropped.

Built on :class:`~tokenloom.plugin_api.SectionToolParser`, the base of tokenloom's own
parsers: it finds the start tag, holds back text that may begin one, streams with the code
that parses whole outputs (so any split into deltas gives the same result), and asks
:meth:`CallTagToolParser.parse_section` only what this format's section looks like.
"""

from __future__ import annotations

import uuid

from tokenloom.plugin_api import NEED_MORE, Section, SectionToolParser, json_object_section

OPEN_TAG = "<call>"
CLOSE_TAG = "</call>"


class CallTagToolParser(SectionToolParser):
    """One instance per request (the server makes it); the streaming state lives on it."""

    start_markers = (OPEN_TAG,)
    argument_keys = ("arguments",)

    def parse_section(self, text: str, final: bool):
        """``text`` follows an open tag: one call object, then the close tag."""
        section = json_object_section(text, 0, self.argument_keys)
        if not isinstance(section, Section):
            return section  # None (malformed) or NEED_MORE
        rest = text[section.length :].lstrip()
        end = section.length + (len(text) - section.length - len(rest))
        if rest.startswith(CLOSE_TAG):
            return Section(section.calls, end + len(CLOSE_TAG))
        if CLOSE_TAG.startswith(rest) and not final:
            return NEED_MORE  # the close tag is still arriving
        return None

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"
