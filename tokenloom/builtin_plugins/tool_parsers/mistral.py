"""``mistral``: Mistral tool calls after the ``[TOOL_CALLS]`` token, in either of the two
formats Mistral's tokenizers use, possibly after some text:

- v3 (Mistral-7B-Instruct-v0.3, Nemo): a JSON array of calls,
  ``[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]``;
- v11 and later (Mistral Small 3.2, Magistral, Devstral): the name, ``[ARGS]``, then the
  arguments object, repeated per call:
  ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}``.

Call ids are 9 random letters and digits: Mistral's chat templates reject any other shape.
A malformed call comes back as content without its ``[TOOL_CALLS]`` marker and with the
whitespace around it trimmed, as vLLM returns it (``[TOOL_CALLS][{"name": ...]`` gives
``[{"name": ...]``).
"""

from __future__ import annotations

import json
import re
import secrets
import string

from tokenloom.plugin_api import (
    NEED_MORE,
    ParsedCall,
    Section,
    SectionToolParser,
    json_array_section,
    json_value_end,
    load_json,
    skip_whitespace,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID_ALPHABET = string.ascii_letters + string.digits
CALL_ID_LENGTH = 9
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def new_mistral_call_id() -> str:
    return "".join(secrets.choice(CALL_ID_ALPHABET) for _ in range(CALL_ID_LENGTH))


class MistralToolParser(SectionToolParser):
    start_markers = (TOOL_CALLS,)
    malformed_marker_kept = False

    def new_call_id(self) -> str:
        return new_mistral_call_id()

    def parse_section(self, text: str, final: bool):
        position = skip_whitespace(text, 0)
        if position == len(text):
            return NEED_MORE
        if text[position] == "[":
            return json_array_section(text, position, self.argument_keys)
        return self._name_args_call(text, position)

    def _name_args_call(self, text: str, position: int):
        name_match = _NAME.match(text, position)
        if name_match is None:
            return None
        rest = text[name_match.end() : name_match.end() + len(ARGS)]
        if rest != ARGS:
            # the name may go on, or [ARGS] may be arriving
            return NEED_MORE if ARGS.startswith(rest) else None
        start = skip_whitespace(text, name_match.end() + len(ARGS))
        if start == len(text):
            return NEED_MORE
        if text[start] != "{":
            return None
        end = json_value_end(text, start)
        if end is None:
            return NEED_MORE
        arguments = load_json(text[start:end])
        if not isinstance(arguments, dict):
            return None
        return Section([ParsedCall(name_match.group(), json.dumps(arguments, ensure_ascii=False))], end)
