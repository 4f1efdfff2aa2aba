"""An example ``--tool-parser-plugin`` file: a parser for Llama 3.1's custom-tool format,
where each call is written as ``<function=NAME>{...arguments...}</function>``::

    tokenloom serve MODEL --tool-parser-plugin examples/my_tool_parser.py \
        --enable-auto-tool-choice --tool-call-parser llama3_function_tags

The file imports only from ``tokenloom.plugin_api``; the decorator registers the class
under its name when tokenloom loads the file (importing it registers nothing). Text around
the calls is the message content; a tag whose body is not a JSON object, or that is never
closed, stays in the content as written.

:class:`~tokenloom.plugin_api.SectionToolParser` (the base of tokenloom's own parsers) does
the streaming: it finds ``<function=``, holds back text that may begin it, and gives any
split into deltas the same result as the whole output. The format only says what follows
the marker, in :meth:`FunctionTagToolParser.parse_section`.
"""

from __future__ import annotations

import re

from tokenloom.plugin_api import (
    NEED_MORE,
    ParsedCall,
    Section,
    SectionToolParser,
    arguments_json,
    json_value_end,
    register_tool_parser,
)

CLOSE_TAG = "</function>"
_NAME = re.compile(r"([A-Za-z0-9_.\-]+)>")


@register_tool_parser("llama3_function_tags")
class FunctionTagToolParser(SectionToolParser):
    """One instance per request: the streaming state lives on it."""

    start_markers = ("<function=",)

    def parse_section(self, text: str, final: bool):
        """``NAME>{...}</function>`` at the start of ``text`` (what follows ``<function=``)."""
        name = _NAME.match(text)
        if name is None:
            # a name still arriving, or not a call
            return NEED_MORE if not final and re.fullmatch(r"[A-Za-z0-9_.\-]*", text) else None
        body = text[name.end() :]
        start = len(text) - len(body.lstrip())  # whitespace may precede the arguments
        if start == len(text):
            return None if final else NEED_MORE
        if text[start] != "{":
            return None
        end = json_value_end(text, start)
        if end is None:
            return None if final else NEED_MORE
        arguments = arguments_json(text[start:end])
        if arguments is None:
            return None
        if text.startswith(CLOSE_TAG, end):
            return Section([ParsedCall(name.group(1), arguments)], end + len(CLOSE_TAG))
        return NEED_MORE if not final and CLOSE_TAG.startswith(text[end:]) else None
