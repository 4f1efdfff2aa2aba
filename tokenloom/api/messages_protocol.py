"""Pydantic models of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``), the translation of its system prompt, content blocks, tools,
tool choice and thinking into a chat request, and of a chat result back into content blocks,
stop reasons and Anthropic's error shape."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field

from tokenloom.api.protocol import (
    ChatMessage,
    RequestModel,
    ResponseFormat,
    ResponseModel,
    flat_tool_as_chat_tool,
)
from tokenloom.errors import InvalidRequestError

# Anthropic's error "type" for each HTTP status it uses
ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPE_BY_STATUS.get(status, "api_error"), "message": message}}


class MessagesInput(RequestModel):
    """What both POST /v1/messages and /v1/messages/count_tokens read."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The system prompt and messages as chat messages: ``tool_result`` blocks become tool
        messages (before the user's text, as Anthropic puts them first), ``tool_use`` blocks the
        assistant's tool_calls; thinking blocks are left out, as chat templates drop them."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _blocks_text(self.system, "system")
            messages.append({"role": "system", "content": system})
        for index, message in enumerate(self.messages):
            where = f"messages[{index}]"
            role = message.get("role")
            if role not in ("user", "assistant"):
                raise InvalidRequestError(
                    f"{where}.role must be 'user' or 'assistant', got {role!r} (the system "
                    "prompt goes in the top-level system field)",
                    param=f"{where}.role",
                )
            content = message.get("content", "")
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
                continue
            if not isinstance(content, list):
                raise InvalidRequestError(
                    f"{where}.content must be a string or a list of content blocks", param=f"{where}.content"
                )
            text_parts: list[str] = []
            # the content as chat parts, kept only when an image block makes it more than text
            chat_parts: list[dict[str, Any]] = []
            tool_calls: list[dict[str, Any]] = []
            for block_index, block in enumerate(content):
                block_where = f"{where}.content[{block_index}]"
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text":
                    text_parts.append(str(block.get("text", "")))
                    chat_parts.append({"type": "text", "text": text_parts[-1]})
                elif kind == "image" and role == "user":
                    chat_parts.append({"type": "image_url", "image_url": {"url": _image_url(block, block_where)}})
                elif kind == "tool_result" and role == "user":
                    if not block.get("tool_use_id"):
                        raise InvalidRequestError(
                            f"{block_where} (a tool_result) needs tool_use_id", param=f"{block_where}.tool_use_id"
                        )
                    result = block.get("content", "")
                    text = result if isinstance(result, str) else _blocks_text(result, f"{block_where}.content")
                    messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
                elif kind == "tool_use" and role == "assistant":
                    if not block.get("id") or not block.get("name"):
                        raise InvalidRequestError(f"{block_where} (a tool_use) needs id and name", param=block_where)
                    tool_calls.append(
                        {
                            "id": block["id"],
                            "type": "function",
                            "function": {
                                "name": block["name"],
                                "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False),
                            },
                        }
                    )
                elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                    continue
                else:
                    raise InvalidRequestError(
                        f"{block_where} is a {kind!r} block; this server takes text, image (user), "
                        "tool_use (assistant), tool_result (user) and thinking blocks",
                        param=f"{block_where}.type",
                    )
            if any(part["type"] == "image_url" for part in chat_parts):
                messages.append({"role": role, "content": chat_parts})
            elif text_parts or tool_calls:
                chat_message: dict[str, Any] = {"role": role, "content": "".join(text_parts) if text_parts else None}
                if tool_calls:
                    chat_message["tool_calls"] = tool_calls
                messages.append(chat_message)
        return messages

    def chat_tools(self) -> list[dict[str, Any]] | None:
        tools = []
        for index, tool in enumerate(self.tools or []):
            if tool.get("type") not in (None, "custom"):
                raise InvalidRequestError(
                    f"tools[{index}] has type {tool.get('type')!r}; this server runs client "
                    "tools only (name, description, input_schema)",
                    param=f"tools[{index}].type",
                )
            tools.append(flat_tool_as_chat_tool(tool, index, "input_schema"))
        return tools or None

    def chat_tool_choice(self) -> tuple[str | dict[str, Any] | None, bool | None]:
        """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
        choice = self.tool_choice
        if choice is None:
            return None, None
        kind = choice.get("type")
        parallel = False if choice.get("disable_parallel_tool_use") else None
        if kind == "auto":
            return "auto", parallel
        if kind == "any":
            return "required", parallel
        if kind == "none":
            return "none", None
        if kind == "tool":
            if not choice.get("name"):
                raise InvalidRequestError('tool_choice of type "tool" needs a name', param="tool_choice.name")
            return {"type": "function", "function": {"name": choice["name"]}}, parallel
        raise InvalidRequestError(
            f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}", param="tool_choice.type"
        )

    def template_kwargs(self) -> dict[str, Any] | None:
        """``thinking`` as the chat template's switch (templates that think read ``enable_thinking``);
        what the model then reasons comes back through the reasoning parser as thinking blocks."""
        if self.thinking is None:
            return None
        kind = self.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise InvalidRequestError(
                f"thinking.type must be 'enabled', 'adaptive' or 'disabled', got {kind!r}", param="thinking.type"
            )
        return {"enable_thinking": kind != "disabled"}


def _blocks_text(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for index, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidRequestError(
                f"{where}[{index}] is a {kind!r} block; only text blocks are taken here", param=f"{where}[{index}]"
            )
        texts.append(str(block.get("text", "")))
    return "".join(texts)


class MessagesRequest(MessagesInput):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    """``{"format": {"type": "json_schema", "schema": {...}}, "effort": ...}``: structured output."""
    # vLLM-style extras the chat path has
    seed: int | None = None
    priority: int = 0

    def response_format(self) -> ResponseFormat | None:
        """``output_config.format`` as chat's ``response_format`` (structured outputs)."""
        output_format = (self.output_config or {}).get("format")
        if not output_format:
            return None
        if output_format.get("type") != "json_schema" or not isinstance(output_format.get("schema"), dict):
            raise InvalidRequestError(
                'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config.format"
            )
        return ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": output_format["schema"]})

    def template_kwargs(self) -> dict[str, Any] | None:
        kwargs = super().template_kwargs() or {}
        effort = (self.output_config or {}).get("effort")
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        return kwargs or None


class CountTokensRequest(MessagesInput):
    """POST /v1/messages/count_tokens."""


class MessagesUsage(ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(default_factory=list)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


def stop_reason_of(finish_reason: str | None, engine_stop_reason: Any, called_tools: bool) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for how the chat output ended."""
    if called_tools or finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop_reason, str):
        return "stop_sequence", engine_stop_reason
    return "end_turn", None


def tool_use_input(arguments: str) -> dict[str, Any] | None:
    """A call's JSON arguments as tool_use ``input``; None when they are not a JSON object."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(message: ChatMessage) -> list[dict[str, Any]]:
    """A whole chat message as content blocks: thinking, text, then tool_use blocks."""
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        arguments = tool_use_input(call.function.arguments)
        if arguments is None:  # cut short: show what came rather than invent an input
            blocks.append({"type": "text", "text": call.function.arguments})
            continue
        blocks.append({"type": "tool_use", "id": new_tool_use_id(), "name": call.function.name, "input": arguments})
    return blocks


def sse(event_type: str, data: dict[str, Any]) -> str:
    """One Anthropic server-sent event: the type on the ``event:`` line and in the data."""
    return f"event: {event_type}\ndata: {json.dumps({'type': event_type, **data}, ensure_ascii=False)}\n\n"


def _image_url(block: dict[str, Any], where: str) -> str:
    """An Anthropic ``image`` block's image as the URL a chat ``image_url`` part carries: base64
    data as a ``data:`` URL, a ``url`` source as itself."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise InvalidRequestError(
        f'{where}: an image block needs "source": {{"type": "base64", "media_type": ..., "data": ...}} '
        'or {"type": "url", "url": ...}',
        param=f"{where}.source",
    )
