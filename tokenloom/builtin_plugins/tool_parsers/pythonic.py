"""``pythonic``: tool calls written as a Python list of function calls with keyword
arguments (Llama 3.2 / 3.3 / 4, ToolACE), opening the output, or wrapped in Llama 4's
``<|python_start|>`` ... ``<|python_end|>``::

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

Argument values must be Python literals (strings, numbers, booleans, None, lists, dicts);
they are sent as JSON.
"""

from __future__ import annotations

import ast
import json

from tokenloom.plugin_api import (
    NEED_MORE,
    ParsedCall,
    Section,
    SectionToolParser,
    skip_whitespace,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


def python_list_end(text: str, start: int) -> int | None:
    """End (exclusive) of the Python list opening at ``text[start]``, matching brackets
    outside string literals (single, double and triple quoted); None when not closed yet."""
    depth, position = 0, start
    while position < len(text):
        char = text[position]
        if char in "'\"":
            quote = text[position : position + 3] if text.startswith(char * 3, position) else char
            position += len(quote)
            while position < len(text) and not text.startswith(quote, position):
                position += 2 if text[position] == "\\" else 1
            if position >= len(text):
                return None
            position += len(quote)
            continue
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return None


def dotted_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = dotted_name(node.value)
        return f"{owner}.{node.attr}" if owner else None
    return None


def parse_call_list(source: str) -> list[ParsedCall] | None:
    """The calls of ``[f(a=1), g()]``, or None if it is anything else."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for element in tree.body.elts:
        name = dotted_name(element.func) if isinstance(element, ast.Call) else None
        if name is None or element.args or any(keyword.arg is None for keyword in element.keywords):
            return None  # positional or **unpacked arguments have no JSON names
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in element.keywords}
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None  # not a literal, or a literal JSON cannot hold (a set, bytes)
    return calls


class PythonicToolParser(SectionToolParser):
    start_markers = (PYTHON_START,)
    bare_start = "["

    def parse_section(self, text: str, final: bool):
        position = skip_whitespace(text, 0)
        if position == len(text):
            return NEED_MORE
        if text[position] != "[":
            return None
        end = python_list_end(text, position)
        if end is None:
            return NEED_MORE
        calls = parse_call_list(text[position:end])
        if calls is None:
            return None
        after = skip_whitespace(text, end)
        rest = text[after : after + len(PYTHON_END)]
        if rest == PYTHON_END:
            return Section(calls, after + len(PYTHON_END))
        if PYTHON_END.startswith(rest) and not final:
            return NEED_MORE
        return Section(calls, end)
