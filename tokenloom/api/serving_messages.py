"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) as a layer over
the chat path: the system prompt and content blocks become chat messages, the chat path
renders, runs and parses them (same tool and reasoning parsers), and its message or streamed
deltas come back as content blocks and Anthropic's SSE events. Every error leaves in
Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from tokenloom.api.engine_runs import IndexedOutputs, respond
from tokenloom.api.http_errors import (
    INTERNAL_ERROR_MESSAGE,
    describe_validation_errors,
    request_id_of,
)
from tokenloom.api.messages_protocol import (
    CountTokensRequest,
    MessageObject,
    MessagesInput,
    MessagesRequest,
    MessagesUsage,
    content_blocks,
    error_body,
    new_message_id,
    new_tool_use_id,
    sse,
    stop_reason_of,
)
from tokenloom.api.prompt_inputs import tokenize_off_loop_if_large
from tokenloom.api.protocol import ChatCompletionRequest, DeltaMessage
from tokenloom.api.serving_base import ChoiceState
from tokenloom.api.serving_chat import ChatHandler
from tokenloom.api.serving_responses import renamed_error
from tokenloom.core.outputs import RequestOutput
from tokenloom.errors import InvalidRequestError, TokenloomError

if TYPE_CHECKING:
    from tokenloom.api.serving_chat import _ChatRun

ModelT = TypeVar("ModelT", bound=BaseModel)

logger = logging.getLogger("tokenloom.api")

_MESSAGES_NAMES = (
    ("max_completion_tokens", "max_tokens"),
    ("stop", "stop_sequences"),
    ("response_format", "output_config.format"),
)


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


async def parse_body(raw_request: Request, model_class: type[ModelT]) -> ModelT:
    """The request body as ``model_class``; bad JSON or fields are an InvalidRequestError
    (the app's validation handler would answer in OpenAI's shape)."""
    try:
        data = json.loads(await raw_request.body() or b"null")
    except ValueError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        return model_class.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_errors(list(exc.errors()))
        raise InvalidRequestError(message, param=param) from None


class MessagesHandler:
    def __init__(self, chat: ChatHandler):
        self.chat = chat
        self.ctx = chat.ctx

    def chat_fields(self, request: MessagesInput) -> dict[str, Any]:
        tool_choice, parallel_tool_calls = request.chat_tool_choice()
        fields = {
            "model": request.model,
            "messages": request.chat_messages(),
            "tools": request.chat_tools(),
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            "chat_template_kwargs": request.template_kwargs(),
        }
        return {name: value for name, value in fields.items() if value is not None}

    async def create(self, request: MessagesRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_ready()
        ctx.warn_unknown_fields(request, "/v1/messages")
        fields = self.chat_fields(request)
        sampling = {
            "max_completion_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_k": request.top_k,
            "top_p": request.top_p,
            "seed": request.seed,
            "priority": request.priority,
            "stream": request.stream,
            "response_format": request.response_format(),
        }
        fields.update({name: value for name, value in sampling.items() if value is not None})
        try:
            chat_run, outputs = await self.chat.start(ChatCompletionRequest(**fields), raw_request, id_prefix="msg")
        except TokenloomError as exc:
            raise renamed_error(exc, _MESSAGES_NAMES) from None
        run = _MessagesRun(chat_run)
        return await respond(raw_request, run, outputs, chat_run.request_id, request.stream)

    async def count_tokens(self, request: CountTokensRequest) -> JSONResponse:
        """The prompt's token count as POST /v1/messages would render it."""
        self.ctx.check_model(request.model)
        fields = self.chat_fields(request)
        text = await self.chat.renderer.render_async(
            fields["messages"],
            add_generation_prompt=True,
            tools=fields.get("tools"),
            chat_template_kwargs=fields.get("chat_template_kwargs"),
        )
        token_ids = await tokenize_off_loop_if_large(self.ctx.tokenize, text, False)
        return JSONResponse({"input_tokens": len(token_ids)})


class _MessagesRun:
    def __init__(self, chat_run: _ChatRun):
        self.chat_run = chat_run
        self.message_id = new_message_id()

    def usage(self, num_output_tokens: int, num_cached_tokens: int) -> MessagesUsage:
        return MessagesUsage(
            input_tokens=self.chat_run.num_prompt_tokens,
            output_tokens=num_output_tokens,
            cache_read_input_tokens=num_cached_tokens,
        )

    async def collect(self, outputs: IndexedOutputs) -> MessageObject:
        chat_response = await self.chat_run.collect(outputs)
        choice = chat_response.choices[0]
        stop_reason, stop_sequence = stop_reason_of(
            choice.finish_reason, choice.stop_reason, bool(choice.message.tool_calls)
        )
        usage = chat_response.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return MessageObject(
            id=self.message_id,
            model=self.chat_run.model_name,
            content=content_blocks(choice.message),
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=self.usage(usage.completion_tokens, cached),
        )

    async def stream(self, first: tuple[int, RequestOutput], outputs: IndexedOutputs) -> AsyncIterator[str]:
        states: dict[int, ChoiceState] = {}
        cached = {"tokens": first[1].num_cached_tokens}
        writer = MessagesEventWriter()
        ending: dict[str, Any] = {"finish_reason": None, "stop_reason": None}

        def events_of(output: RequestOutput) -> list[str]:
            events = []
            for piece in self.chat_run.deltas(output, states, cached):
                if piece.finish_reason is not None:
                    ending.update(finish_reason=piece.finish_reason, stop_reason=piece.stop_reason)
                events += writer.add(piece.delta)
            return events

        try:
            start = MessageObject(
                id=self.message_id, model=self.chat_run.model_name, usage=self.usage(0, cached["tokens"])
            )
            yield sse("message_start", {"message": start.model_dump(mode="json")})
            for event in events_of(first[1]):
                yield event
            async for _, output in outputs:
                for event in events_of(output):
                    yield event
            for event in writer.close_current():
                yield event
            stop_reason, stop_sequence = stop_reason_of(
                ending["finish_reason"], ending["stop_reason"], writer.called_tools
            )
            num_output_tokens = len(states.get(0, ChoiceState()).token_ids)
            yield sse(
                "message_delta",
                {
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": num_output_tokens},
                },
            )
            yield sse("message_stop", {})
        except Exception as exc:
            if isinstance(exc, TokenloomError):
                body = error_body(exc.status_code, exc.message)
            else:
                logger.exception("message %s failed while streaming", self.message_id)
                body = error_body(500, INTERNAL_ERROR_MESSAGE.format(request_id=self.chat_run.request_id))
            yield sse("error", {"error": body["error"]})
        finally:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()


class MessagesEventWriter:
    """Streamed chat deltas as Anthropic's content-block events: each block started, its deltas,
    then stopped before the next one starts."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.current: str | None = None  # "thinking", "text" or "tool_use"
        self.tool_blocks: dict[int, int] = {}  # the chat call index -> its block index
        self.current_call: int | None = None

    @property
    def called_tools(self) -> bool:
        return bool(self.tool_blocks)

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close_current()
        self.current = kind
        self.num_blocks += 1
        return events + [sse("content_block_start", {"index": self.num_blocks - 1, "content_block": block})]

    def close_current(self) -> list[str]:
        if self.current is None:
            return []
        self.current = None
        self.current_call = None
        return [sse("content_block_stop", {"index": self.num_blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"index": self.num_blocks - 1, "delta": delta})

    def add(self, delta: DeltaMessage | None) -> list[str]:
        if delta is None:
            return []
        events: list[str] = []
        if delta.reasoning_content:
            if self.current != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            if self.current != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            if call.index not in self.tool_blocks:
                name = call.function.name if call.function is not None else None
                events += self._open(
                    "tool_use", {"type": "tool_use", "id": new_tool_use_id(), "name": name or "", "input": {}}
                )
                self.tool_blocks[call.index] = self.num_blocks - 1
                self.current_call = call.index
            elif call.index != self.current_call:
                # a parser that interleaves calls; Anthropic's blocks do not, so this is a bug upstream
                raise TokenloomError(f"tool call {call.index} continued after another call started")
            arguments = call.function.arguments if call.function is not None else None
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events


def messages_routes(handler: MessagesHandler) -> APIRouter:
    """POST /v1/messages and /v1/messages/count_tokens, answering errors in Anthropic's shape."""
    router = APIRouter()

    async def anthropic_guarded(raw_request: Request, work: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await work()
        except TokenloomError as exc:
            return anthropic_error(exc.status_code, exc.message)
        except Exception:
            request_id = request_id_of(raw_request)
            logger.exception("request %s failed", request_id)
            return anthropic_error(500, INTERNAL_ERROR_MESSAGE.format(request_id=request_id))

    def body_schema(model_class: type[BaseModel]) -> dict[str, Any]:
        # the routes read their bodies themselves (for Anthropic-shaped errors): document them here
        return {
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": model_class.model_json_schema()}},
            }
        }

    @router.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
    async def create_message(raw_request: Request) -> Response:
        async def work() -> Response:
            return await handler.create(await parse_body(raw_request, MessagesRequest), raw_request)

        return await anthropic_guarded(raw_request, work)

    @router.post("/v1/messages/count_tokens", openapi_extra=body_schema(CountTokensRequest))
    async def count_message_tokens(raw_request: Request) -> Response:
        async def work() -> Response:
            return await handler.count_tokens(await parse_body(raw_request, CountTokensRequest))

        return await anthropic_guarded(raw_request, work)

    return router
