"""POST /v1/responses (OpenAI's Responses API) as a layer over the chat path: the input items
become chat messages, the chat path renders, runs and parses them (same tool and reasoning
parsers, same structured outputs), and its message or streamed deltas come back as output
items and Responses events. Stored responses (``store``, ``previous_response_id``, GET,
DELETE, cancel of ``background`` ones) are kept by :mod:`~tokenloom.api.response_store`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenloom.api.engine_runs import IndexedOutputs, respond
from tokenloom.api.http_errors import exception_body
from tokenloom.api.protocol import ChatCompletionRequest, DeltaMessage
from tokenloom.api.response_store import ResponseStore, StoredResponse, owner_of
from tokenloom.api.responses_protocol import (
    FunctionCallItem,
    InputTokensDetails,
    ItemStatus,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    event_json,
    input_messages,
    message_items,
    new_item_id,
    output_messages,
)
from tokenloom.api.serving_base import ChoiceState, RouteGuard
from tokenloom.api.serving_chat import ChatHandler
from tokenloom.core.outputs import RequestOutput
from tokenloom.errors import InvalidRequestError, TokenloomError

if TYPE_CHECKING:
    from tokenloom.api.serving_chat import _ChatRun

logger = logging.getLogger("tokenloom.api")

# the chat path's names for what the Responses API calls otherwise, for error messages and params
_RESPONSES_NAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
    ("response_format", "text.format"),
)


def renamed_error(exc: TokenloomError, names: tuple[tuple[str, str], ...]) -> TokenloomError:
    """``exc`` with the chat path's parameter names replaced by the endpoint's own."""
    for chat_name, own_name in names:
        if exc.param == chat_name or (exc.param or "").startswith(chat_name + "."):
            exc.param = own_name + (exc.param or "")[len(chat_name) :]
        if "_" in chat_name:  # plain words ("messages") also occur in prose; only rename identifiers
            exc.message = exc.message.replace(chat_name, own_name)
    exc.args = (exc.message,)
    return exc


class ResponsesHandler:
    def __init__(self, chat: ChatHandler, store: ResponseStore, keys_in_use: bool):
        self.chat = chat
        self.ctx = chat.ctx
        self.store = store
        self.keys_in_use = keys_in_use

    def chat_request(self, request: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + history
        if not messages:
            raise InvalidRequestError("there is nothing to answer: input is empty", param="input")
        fields: dict[str, Any] = {
            "model": request.model,
            "messages": messages,
            "tools": request.chat_tools(),
            "tool_choice": request.chat_tool_choice(),
            "parallel_tool_calls": request.parallel_tool_calls,
            "response_format": request.response_format(),
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "min_p": request.min_p,
            "seed": request.seed,
            "repetition_penalty": request.repetition_penalty,
            "stream": request.stream,
            "priority": request.priority,
            "request_id": request.request_id,
            "user": request.user,
            "chat_template_kwargs": request.template_kwargs(),
        }
        return ChatCompletionRequest(**{name: value for name, value in fields.items() if value is not None})

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_ready()
        ctx.warn_unknown_fields(request, "/v1/responses")
        request.check()
        owner = owner_of(raw_request, self.keys_in_use)
        history: list[dict[str, Any]] = []
        if request.previous_response_id:
            previous = self.store.get(request.previous_response_id, owner, "previous_response_id")
            if previous.response.status in ("queued", "in_progress"):
                raise InvalidRequestError(
                    f"response {request.previous_response_id!r} is still "
                    f"{previous.response.status}; wait for it to finish",
                    param="previous_response_id",
                )
            history = [dict(message) for message in previous.messages]
        history += input_messages(request.input)
        try:
            chat_request = self.chat_request(request, history)
            chat_run, outputs = await self.chat.start(chat_request, raw_request, id_prefix="resp")
        except TokenloomError as exc:
            raise renamed_error(exc, _RESPONSES_NAMES) from None
        response = ResponseObject(
            id=new_item_id("resp"),
            model=chat_run.model_name,
            status="in_progress",
            background=request.background,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            reasoning=request.reasoning,
            store=request.store,
            temperature=request.temperature,
            text={"format": (request.text or {}).get("format") or {"type": "text"}},
            tool_choice=request.tool_choice,
            tools=request.tools,
            top_p=request.top_p,
            user=request.user,
            truncation=request.truncation or "disabled",
        )
        run = _ResponsesRun(self, chat_run, response, history, owner)
        if request.background:
            response.status = "queued"
            entry = StoredResponse(response, history, owner)
            if not self.store.put(entry):
                with anyio.CancelScope(shield=True):
                    await outputs.aclose()
                raise InvalidRequestError(
                    f"this background response is larger than the server's response store "
                    f"({self.store.max_bytes} bytes, --responses-store-max-bytes), so it could never be "
                    "retrieved; shorten the input, tools or metadata, or send it without background",
                    param="background",
                )
            entry.task = asyncio.create_task(run.run_in_background(entry, outputs))
            return JSONResponse(response.model_dump(mode="json"))
        return await respond(raw_request, run, outputs, chat_run.request_id, request.stream)

    def not_stored(self, response: ResponseObject) -> None:
        """``response`` alone is larger than the store: the client learns it from ``store``."""
        logger.warning(
            "response %s was not stored: it is larger than the response store's %d bytes (--responses-store-max-bytes)",
            response.id,
            self.store.max_bytes,
        )
        response.store = False

    def retrieve(self, response_id: str, raw_request: Request) -> JSONResponse:
        entry = self.store.get(response_id, owner_of(raw_request, self.keys_in_use))
        return JSONResponse(entry.response.model_dump(mode="json"))

    def delete(self, response_id: str, raw_request: Request) -> JSONResponse:
        entry = self.store.delete(response_id, owner_of(raw_request, self.keys_in_use))
        return JSONResponse({"id": entry.response.id, "object": "response.deleted", "deleted": True})

    async def cancel(self, response_id: str, raw_request: Request) -> JSONResponse:
        entry = self.store.get(response_id, owner_of(raw_request, self.keys_in_use))
        if not entry.response.background:
            raise InvalidRequestError("only background responses can be cancelled", param="response_id")
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await entry.task
        return JSONResponse(entry.response.model_dump(mode="json"))


class _ResponsesRun:
    """One response while its outputs arrive: the chat run parses them, this turns the result
    into output items (whole, or as events) and stores the response when asked to."""

    def __init__(
        self,
        handler: ResponsesHandler,
        chat_run: _ChatRun,
        response: ResponseObject,
        history: list[dict[str, Any]],
        owner: str | None,
    ):
        self.handler = handler
        self.ctx = handler.ctx
        self.chat_run = chat_run
        self.response = response
        self.history = history
        self.owner = owner

    def usage(self, num_output_tokens: int, num_cached_tokens: int, output: list[OutputItem]) -> ResponseUsage:
        # the reasoning's token count is its text re-tokenized: the parser splits text, not token ids
        reasoning_text = "".join(
            part.text for item in output if isinstance(item, ReasoningItem) for part in item.content
        )
        num_reasoning = len(self.ctx.tokenize(reasoning_text, False)) if reasoning_text else 0
        num_input = self.chat_run.num_prompt_tokens
        return ResponseUsage(
            input_tokens=num_input,
            input_tokens_details=InputTokensDetails(cached_tokens=num_cached_tokens),
            output_tokens=num_output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=min(num_reasoning, num_output_tokens)),
            total_tokens=num_input + num_output_tokens,
        )

    def finish(self, output: list[OutputItem], finish_reason: str | None, usage: ResponseUsage) -> ResponseObject:
        response = self.response
        response.output = output
        response.usage = usage
        response.completed_at = int(time.time())
        if finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = {"reason": "max_output_tokens"}
        else:
            response.status = "completed"
        if response.store and not self.handler.store.put(
            StoredResponse(response, self.history + output_messages(output), self.owner)
        ):
            self.handler.not_stored(response)
        return response

    async def collect(self, outputs: IndexedOutputs) -> ResponseObject:
        chat_response = await self.chat_run.collect(outputs)
        choice = chat_response.choices[0]
        status: ItemStatus = "incomplete" if choice.finish_reason == "length" else "completed"
        output = message_items(choice.message, status)
        usage = chat_response.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return self.finish(output, choice.finish_reason, self.usage(usage.completion_tokens, cached, output))

    async def run_in_background(self, entry: StoredResponse, outputs: IndexedOutputs) -> None:
        entry.response.status = "in_progress"
        try:
            await self.collect(outputs)
        except asyncio.CancelledError:
            entry.response.status = "cancelled"
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
        except Exception as exc:
            if not isinstance(exc, TokenloomError):
                logger.exception("background response %s failed", entry.response.id)
                exc = TokenloomError("internal server error; the server log has the details")
            entry.response.status = "failed"
            entry.response.error = {"code": "server_error", "message": exc.message}
        finally:
            entry.task = None

    async def stream(self, first: tuple[int, RequestOutput], outputs: IndexedOutputs) -> AsyncIterator[str]:
        writer = ResponsesEventWriter(self.response)
        states: dict[int, ChoiceState] = {}
        cached = {"tokens": first[1].num_cached_tokens}
        finish_reason = None
        try:
            for event in writer.start():
                yield event

            def events_of(output: RequestOutput) -> list[str]:
                nonlocal finish_reason
                events = []
                for piece in self.chat_run.deltas(output, states, cached):
                    finish_reason = piece.finish_reason or finish_reason
                    events += writer.add(piece.delta)
                return events

            for event in events_of(first[1]):
                yield event
            async for _, output in outputs:
                for event in events_of(output):
                    yield event
            items_status: ItemStatus = "incomplete" if finish_reason == "length" else "completed"
            for event in writer.close_current(items_status):
                yield event
            state = states.get(0, ChoiceState())
            self.finish(writer.items, finish_reason, self.usage(len(state.token_ids), cached["tokens"], writer.items))
            for event in writer.end():
                yield event
        except Exception as exc:
            if not isinstance(exc, TokenloomError):
                logger.exception("response %s failed while streaming", self.response.id)
            self.response.status = "failed"
            yield writer.error(exc)
        finally:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()


class ResponsesEventWriter:
    """Streamed chat deltas as Responses events in OpenAI's order: created, in_progress, then
    per output item added / its parts and deltas / done, and completed (or incomplete) last."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self.current: OutputItem | None = None
        self.calls_by_index: dict[int, FunctionCallItem] = {}

    def event(self, event_type: str, **fields: Any) -> str:
        event = {"type": event_type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return event_json(event)

    def part_event(self, event_type: str, item: OutputItem, output_index: int, **fields: Any) -> str:
        """An event about the one content part of a message or reasoning item."""
        return self.event(event_type, item_id=item.id, output_index=output_index, content_index=0, **fields)

    def snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> list[str]:
        return [
            self.event("response.created", response=self.snapshot()),
            self.event("response.in_progress", response=self.snapshot()),
        ]

    def _open(self, item: OutputItem) -> list[str]:
        events = self.close_current()
        self.items.append(item)
        self.current = item
        output_index = len(self.items) - 1
        added = item.model_copy(deep=True)
        added.status = "in_progress"
        if isinstance(added, (MessageItem, ReasoningItem)):
            added.content = []
        events.append(
            self.event("response.output_item.added", output_index=output_index, item=added.model_dump(mode="json"))
        )
        if isinstance(item, (MessageItem, ReasoningItem)):
            empty = OutputText(text="") if isinstance(item, MessageItem) else ReasoningText(text="")
            events.append(
                self.part_event("response.content_part.added", item, output_index, part=empty.model_dump(mode="json"))
            )
        return events

    def close_current(self, status: ItemStatus = "completed") -> list[str]:
        item = self.current
        if item is None:
            return []
        self.current = None
        item.status = status
        output_index = self.items.index(item)
        events = []
        if isinstance(item, (MessageItem, ReasoningItem)):
            part = item.content[0]
            if isinstance(item, MessageItem):
                events.append(
                    self.part_event("response.output_text.done", item, output_index, text=part.text, logprobs=[])
                )
            else:
                events.append(self.part_event("response.reasoning_text.done", item, output_index, text=part.text))
            events.append(
                self.part_event("response.content_part.done", item, output_index, part=part.model_dump(mode="json"))
            )
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=output_index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        events.append(
            self.event("response.output_item.done", output_index=output_index, item=item.model_dump(mode="json"))
        )
        return events

    def add(self, delta: DeltaMessage | None) -> list[str]:
        if delta is None:
            return []
        events: list[str] = []
        if delta.reasoning_content:
            reasoning_item = self.current
            if not isinstance(reasoning_item, ReasoningItem):
                reasoning_item = ReasoningItem(id=new_item_id("rs"), content=[ReasoningText(text="")])
                events += self._open(reasoning_item)
            reasoning_item.content[0].text += delta.reasoning_content
            events.append(
                self.part_event(
                    "response.reasoning_text.delta", reasoning_item, len(self.items) - 1, delta=delta.reasoning_content
                )
            )
        if delta.content:
            message_item = self.current
            if not isinstance(message_item, MessageItem):
                message_item = MessageItem(id=new_item_id("msg"), content=[OutputText(text="")])
                events += self._open(message_item)
            message_item.content[0].text += delta.content
            events.append(
                self.part_event(
                    "response.output_text.delta", message_item, len(self.items) - 1, delta=delta.content, logprobs=[]
                )
            )
        for call in delta.tool_calls or []:
            item = self.calls_by_index.get(call.index)
            if item is None:
                name = call.function.name if call.function is not None else None
                item = FunctionCallItem(
                    id=new_item_id("fc"), call_id=new_item_id("call"), name=name or "", arguments=""
                )
                self.calls_by_index[call.index] = item
                events += self._open(item)
            arguments = call.function.arguments if call.function is not None else None
            if arguments:
                item.arguments += arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=self.items.index(item),
                        delta=arguments,
                    )
                )
        return events

    def end(self) -> list[str]:
        final = "response.incomplete" if self.response.status == "incomplete" else "response.completed"
        return [self.event(final, response=self.snapshot())]

    def error(self, exc: BaseException) -> str:
        if isinstance(exc, TokenloomError):
            info = exception_body(exc)["error"]
            return self.event("error", code=str(info.get("code")), message=info["message"], param=info.get("param"))
        return self.event(
            "error", code="server_error", param=None, message="internal server error; the server log has the details"
        )


def responses_routes(handler: ResponsesHandler, guarded: RouteGuard) -> APIRouter:
    """POST /v1/responses, and GET / DELETE / POST cancel of a stored response."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await guarded(raw_request, handler.create(request, raw_request))

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw_request: Request) -> Response:
        return handler.retrieve(response_id, raw_request)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw_request: Request) -> Response:
        return handler.delete(response_id, raw_request)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, raw_request: Request) -> Response:
        return await guarded(raw_request, handler.cancel(response_id, raw_request))

    return router
