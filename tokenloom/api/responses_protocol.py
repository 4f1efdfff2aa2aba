"""Pydantic models of OpenAI's Responses API (``POST /v1/responses``): the request, the output
items and the response, and the translation of a request's input items, tools, tool choice and
text format into the chat request that the chat path renders and runs."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from tokenloom.api.protocol import (
    ChatMessage,
    RequestModel,
    ResponseFormat,
    ResponseModel,
    flat_tool_as_chat_tool,
)
from tokenloom.errors import InvalidRequestError

# what OpenAI's input items may say for the model's own turn and the system's
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# OpenAI's limits on a response's metadata
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# an output item's status
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(RequestModel):
    """POST /v1/responses: OpenAI's fields, plus vLLM's sampling extras where the chat path has them."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extras, passed to the chat path as they are
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    priority: int = 0
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if self.background and not self.store:
            raise InvalidRequestError("background responses must be stored: drop store: false", param="store")
        if self.background and self.stream:
            raise InvalidRequestError(
                "this server does not stream background responses: send stream or background, "
                "and poll GET /v1/responses/{id} for a background one",
                param="background",
            )
        self.check_metadata()
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise InvalidRequestError("input is empty: send a string or at least one item", param="input")

    def check_metadata(self) -> None:
        """OpenAI's limits: 16 keys of at most 64 characters, values of at most 512 (it is
        stored with the response, so unbounded values would let a client fill the store)."""
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS:
            raise InvalidRequestError(
                f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed", param="metadata"
            )
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise InvalidRequestError(
                    f"metadata has a key of {len(key)} characters; keys may have at most {MAX_METADATA_KEY_CHARS}",
                    param="metadata",
                )
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise InvalidRequestError(
                    f"metadata[{key!r}] has {len(value)} characters; values may have at most "
                    f"{MAX_METADATA_VALUE_CHARS}",
                    param=f"metadata.{key}",
                )

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in chat's shape; any other tool type is a 400."""
        tools = []
        for index, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise InvalidRequestError(
                    f"tools[{index}] has type {tool.get('type')!r}; this server runs function "
                    "tools only (the client executes them)",
                    param=f"tools[{index}].type",
                )
            tools.append(flat_tool_as_chat_tool(tool, index, "parameters"))
        return tools or None

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not choice.get("name"):
                raise InvalidRequestError(
                    'a tool_choice object must be {"type": "function", "name": ...}', param="tool_choice"
                )
            return {"type": "function", "function": {"name": choice["name"]}}
        if choice not in ("auto", "none", "required"):
            raise InvalidRequestError(
                f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}", param="tool_choice"
            )
        # unset "auto" stays the chat default, which does not need --enable-auto-tool-choice
        return None if choice == "auto" and "tool_choice" not in self.model_fields_set else choice

    def response_format(self) -> ResponseFormat | None:
        """``text.format`` as chat's ``response_format`` (structured outputs)."""
        text_format = (self.text or {}).get("format")
        if not text_format:
            return None
        kind = text_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return ResponseFormat(type="json_object")
        if kind == "json_schema":
            if not isinstance(text_format.get("schema"), dict):
                raise InvalidRequestError(
                    'text.format json_schema needs "schema": {...} (and a "name")', param="text.format.schema"
                )
            return ResponseFormat(
                type="json_schema",
                json_schema={"name": text_format.get("name", "output"), "schema": text_format["schema"]},
            )
        raise InvalidRequestError(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="text.format.type"
        )

    def template_kwargs(self) -> dict[str, Any] | None:
        kwargs = dict(self.chat_template_kwargs or {})
        effort = (self.reasoning or {}).get("effort")
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        return kwargs or None


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
        return str(part.get("text", ""))
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequestError(
        f"{where} is a {kind!r} part; this server takes text parts (input_text) and input_image", param=where
    )


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: its text, or with an ``input_image`` part, chat
    parts (text parts and ``image_url`` parts)."""
    if not isinstance(content, list) or not any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    ):
        return _content_text(content, where)
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequestError(
                    f"{where}[{index}]: an input_image part needs image_url (a data: or http(s) URL); file_id is "
                    "not supported",
                    param=f"{where}[{index}]",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _part_text(part, f"{where}[{index}]")})
    return parts


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(part, f"{where}[{index}]") for index, part in enumerate(content))
    raise InvalidRequestError(f"{where} must be a string or a list of text parts", param=where)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Responses ``input`` as chat messages: message items by role (developer is system),
    function calls as the assistant's tool_calls (consecutive ones in one message), their
    outputs as tool messages; reasoning items are left out, as chat templates drop them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object (an input item)", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            given_role = item.get("role")
            role = _ROLES.get(given_role) if isinstance(given_role, str) else None
            if role is None:
                raise InvalidRequestError(
                    f"{where}.role must be user, assistant, system or developer, got {item.get('role')!r}",
                    param=f"{where}.role",
                )
            messages.append({"role": role, "content": _message_content(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            for field in ("call_id", "name"):
                if not item.get(field):
                    raise InvalidRequestError(f"{where} (a function_call) needs {field}", param=f"{where}.{field}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not isinstance(last.get("content"), list):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise InvalidRequestError(f"{where} (a function_call_output) needs call_id", param=f"{where}.call_id")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(
                f"{where} has type {kind!r}; this server takes message, function_call, "
                "function_call_output and reasoning items",
                param=f"{where}.type",
            )
    return messages


# -- output ------------------------------------------------------------------------------


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus = "completed"


class ReasoningItem(ResponseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(ResponseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"] = "in_progress"
    background: bool = False
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    @model_serializer(mode="wrap")
    def _output_text(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # the SDKs' ``response.output_text`` is a client-side property; send it for raw HTTP users too
        data: dict[str, Any] = handler(self)
        data["output_text"] = "".join(
            part["text"] for item in data["output"] if item["type"] == "message" for part in item["content"]
        )
        return data


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output items as chat messages, for the next turn's history."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if isinstance(item, MessageItem):
            messages.append({"role": "assistant", "content": "".join(part.text for part in item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


def message_items(message: ChatMessage, status: ItemStatus = "completed") -> list[OutputItem]:
    """A whole chat message as output items: its reasoning, its text, then its calls."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(
            ReasoningItem(id=new_item_id("rs"), content=[ReasoningText(text=message.reasoning_content)], status=status)
        )
    if message.content:
        items.append(MessageItem(id=new_item_id("msg"), status=status, content=[OutputText(text=message.content)]))
    for call in message.tool_calls:
        items.append(
            FunctionCallItem(
                id=new_item_id("fc"),
                call_id=new_item_id("call"),
                name=call.function.name,
                arguments=call.function.arguments,
                status=status,
            )
        )
    return items


def event_json(event: dict[str, Any]) -> str:
    """One Responses server-sent event: the type on the ``event:`` line and in the data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
