"""Tool calls on the chat wire: call ids, tool_choice "required"'s JSON schema and the parse of
its output, a tool parser's delta in the API's shape, and two deltas merged into one.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tokenloom.api.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from tokenloom.core import parsers
from tokenloom.errors import InvalidRequestError


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def required_tool_calls_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool | None = None) -> dict[str, Any]:
    """tool_choice "required": a JSON array of ``{"name", "parameters"}`` calls, at least one, each
    valid for one of the tools; the tools' ``$defs`` move to the top, where their refs point."""
    definitions: dict[str, Any] = {}
    calls = []
    for tool in tools:
        function = tool.get("function") or {}
        parameters = dict(function.get("parameters") or {"type": "object"})
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise InvalidRequestError(f"two tools define $defs/{name} differently; rename one", param="tools")
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [function.get("name")]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def parse_required_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a tool_choice "required" output; none when it is not a whole array (cut
    short by max_tokens or a stop string)."""
    try:
        calls = json.loads(text)
        return [
            ToolCall(
                id=new_tool_call_id(),
                function=FunctionCall(name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False)),
            )
            for call in calls
        ]
    except (ValueError, TypeError, KeyError):
        return []


def wire_delta(piece: parsers.DeltaMessage | None) -> DeltaMessage | None:
    """A parser's DeltaMessage as the API's; None when it carries nothing."""
    if piece is None:
        return None
    tool_calls = []
    for call in piece.tool_calls:
        function = None
        if call.name is not None or call.arguments is not None:
            function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
        call_id = call.id or (new_tool_call_id() if call.name is not None else None)
        tool_calls.append(
            DeltaToolCall(index=call.index, id=call_id, type="function" if call_id else None, function=function)
        )
    if piece.content is None and piece.reasoning_content is None and not tool_calls:
        return None
    return DeltaMessage(content=piece.content, reasoning_content=piece.reasoning_content, tool_calls=tool_calls or None)


def merge_deltas(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    if first is None or second is None:
        return first or second

    def join(a: str | None, b: str | None) -> str | None:
        return None if a is None and b is None else (a or "") + (b or "")

    tool_calls = (first.tool_calls or []) + (second.tool_calls or [])
    return DeltaMessage(
        content=join(first.content, second.content),
        reasoning_content=join(first.reasoning_content, second.reasoning_content),
        tool_calls=tool_calls or None,
    )
