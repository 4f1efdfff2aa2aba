"""POST /v1/chat/completions: messages through the chat template to the engine, and back
as OpenAI chat responses or SSE chunks (role delta first), with chat logprobs, echo,
named tool choice, and the ``--tool-call-parser`` / ``--reasoning-parser`` plugins (the reasoning
parser reads the output first, the tool parser its content; ``parallel_tool_calls: false``
keeps the first call). Whole and streamed answers share the per-choice parser state of one run
(:class:`_ChatRun`), which the Responses and Messages layers reuse; the SSE chunks are written
by :mod:`~tokenloom.api.chat_stream`, and tool calls take their wire shape in
:mod:`~tokenloom.api.chat_tool_calls`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response

from tokenloom.api.chat_stream import ChatChunkWriter, ChoiceDelta
from tokenloom.api.chat_tool_calls import (
    merge_deltas,
    new_tool_call_id,
    parse_required_tool_calls,
    required_tool_calls_schema,
    wire_delta,
)
from tokenloom.api.engine_runs import IndexedOutputs, respond
from tokenloom.api.prompt_inputs import tokenize_off_loop_if_large
from tokenloom.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tokenloom.api.serving_base import MIN_LOGPROB, ChoiceState, ServingContext, clamp_logprob, pick_best
from tokenloom.api.serving_completions import check_output
from tokenloom.chat_template import ChatRenderer, message_text
from tokenloom.core import parsers
from tokenloom.core.outputs import Logprob, PromptLogprobs, RequestOutput
from tokenloom.errors import InvalidRequestError

# how a chat request's tools are handled: see ChatHandler.tool_mode
ToolMode = Literal["parser", "required"] | dict[str, Any] | None


async def render_chat_request(renderer: ChatRenderer, request: Any) -> str:
    """The prompt text of a request that carries a chat (``/v1/chat/completions``, ``/tokenize``):
    its messages through the chat template, with the request's template options."""
    return await renderer.render_async(
        request.messages,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        tools=request.tools,
        documents=request.documents,
        chat_template=request.chat_template,
        chat_template_kwargs=request.chat_template_kwargs,
    )


def chat_logprobs(
    ctx: ServingContext,
    token_ids: list[int],
    positions: Sequence[dict[int, Logprob] | None],
    num_top: int,
    as_token_ids: bool,
) -> ChatLogProbs:
    content = []
    for token_id, position in zip(token_ids, positions):
        position = position or {}
        chosen = position.get(token_id)
        token = ctx.token_text(token_id, chosen, as_token_ids)
        ranked = sorted(
            (
                (candidate_id, candidate)
                for candidate_id, candidate in position.items()
                if candidate.rank is not None and candidate.rank <= num_top
            ),
            key=lambda item: item[1].rank or 0,  # never None: filtered above
        )
        top = []
        for candidate_id, candidate in ranked[:num_top]:
            text = ctx.token_text(candidate_id, candidate, as_token_ids)
            top.append(
                ChatLogProb(token=text, logprob=clamp_logprob(candidate.logprob), bytes=list(text.encode("utf-8")))
            )
        content.append(
            ChatLogProbsContent(
                token=token,
                logprob=clamp_logprob(chosen.logprob) if chosen is not None else MIN_LOGPROB,
                bytes=list(token.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return ChatLogProbs(content=content)


class _ChoiceParsers:
    """One choice's parser instances: streaming parsers keep state between deltas."""

    def __init__(self, tool_parser: parsers.ToolParser | None, reasoning_parser: parsers.ReasoningParser | None):
        self.tool = tool_parser
        self.reasoning = reasoning_parser
        self.called_tools = False
        self.named_call_started = False
        self.required_calls_text = ""  # tool_choice "required": the JSON array of calls so far


class ChatHandler:
    def __init__(
        self,
        ctx: ServingContext,
        renderer: ChatRenderer,
        response_role: str,
        tool_parser_class: type[parsers.ToolParser] | None = None,
        reasoning_parser_class: type[parsers.ReasoningParser] | None = None,
    ):
        self.ctx = ctx
        self.renderer = renderer
        self.response_role = response_role
        self.tool_parser_class = tool_parser_class
        self.reasoning_parser_class = reasoning_parser_class

    def tool_mode(self, request: ChatCompletionRequest) -> ToolMode:
        """None (plain text), ``"parser"`` (the tool-call parser reads the output),
        ``"required"`` (the output is a JSON array of calls, generated under
        :func:`required_tool_calls_schema`), or the named function's definition (its arguments
        are generated under its JSON schema)."""
        choice = request.tool_choice
        if not request.tools and (isinstance(choice, dict) or choice == "required"):
            # vLLM refuses a tool_choice without tools: there is nothing to call
            raise InvalidRequestError(
                f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} needs tools: "
                "give the function definitions in tools, or remove tool_choice",
                param="tool_choice",
            )
        if not request.tools or choice == "none":
            return None
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            for tool in request.tools:
                function = tool.get("function") or {}
                if function.get("name") == name:
                    return function
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice"
            )
        if choice == "required":
            return "required"
        if choice not in (None, "auto"):
            raise InvalidRequestError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                param="tool_choice",
            )
        if self.tool_parser_class is None or not self.ctx.config.enable_auto_tool_choice:
            if choice == "auto":
                raise InvalidRequestError(
                    "tool_choice 'auto' needs the server to be started with "
                    "--enable-auto-tool-choice and --tool-call-parser",
                    param="tool_choice",
                )
            return None
        return "parser"

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        run, outputs = await self.start(request, raw_request)
        return await respond(raw_request, run, outputs, run.request_id, request.stream)

    async def start(
        self, request: ChatCompletionRequest, raw_request: Request, id_prefix: str = "chatcmpl"
    ) -> tuple[_ChatRun, IndexedOutputs]:
        """Checks and renders ``request`` and submits it: the run that reads its outputs, and the
        outputs. The Responses and Messages endpoints start their converted requests here too."""
        ctx = self.ctx
        ctx.check_ready()
        model_name = ctx.check_model(request.model)
        ctx.warn_unknown_fields(request, "/v1/chat/completions")
        ctx.require_tokenizer("a chat request (its template renders text)", "messages")
        num_samples = ctx.num_samples(request)
        if request.top_logprobs is not None:
            if request.top_logprobs < 0:
                raise InvalidRequestError(
                    f"top_logprobs must be non-negative, got {request.top_logprobs}", param="top_logprobs"
                )
            if request.top_logprobs > 0 and not request.logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs to be true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        ctx.check_logprobs(logprobs, "top_logprobs")
        ctx.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        tool_mode = self.tool_mode(request)
        if tool_mode == "parser" and self.tool_parser_class is not None:  # "parser" implies a parser class
            # e.g. keep the special tokens that delimit tool calls in the output
            request = self.tool_parser_class(ctx.tokenizer).adjust_request(request) or request
        if self.reasoning_parser_class is not None:
            # e.g. keep the special tokens that mark the reasoning section
            request = self.reasoning_parser_class(ctx.tokenizer).adjust_request(request) or request

        request, images = await ctx.multimodal.take_images(request)
        prompt_text = await render_chat_request(self.renderer, request)
        prompt_ids = await tokenize_off_loop_if_large(
            ctx.prepare_prompt, prompt_text, request.add_special_tokens, request.truncate_prompt_tokens
        )
        prompt: list[int] | dict[str, Any] = prompt_ids
        if images:
            prompt = await ctx.multimodal.prompt(prompt_ids, images, request.mm_processor_kwargs)
            prompt_ids = prompt["prompt_token_ids"]
        requested_max = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        max_tokens = ctx.resolve_max_tokens(
            len(prompt_ids),
            requested_max,
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens",
        )
        structured: dict[str, Any] | None
        if isinstance(tool_mode, dict) or tool_mode == "required":
            # Calls are compact JSON: whitespace carries nothing in arguments, and a small model
            # sampling at high temperature can spend max_tokens on it and leave no whole call.
            schema = (
                tool_mode.get("parameters") or {"type": "object"}
                if isinstance(tool_mode, dict)
                else required_tool_calls_schema(request.tools or [], request.parallel_tool_calls)  # tools: given
            )
            structured = {"json": schema, "disable_any_whitespace": True}
        else:
            structured = request.structured_output_constraint()
        if request.use_beam_search:
            ctx.check_beam_search(request, num_samples, structured)
            ctx.check_priority(request.priority)
            request_id = ctx.engine_request_id(raw_request, request, id_prefix)
            run = _ChatRun(self, request, request_id, model_name, prompt_ids, tool_mode)
            beam_params = ctx.beam_search_params(request, num_samples, max_tokens)
            return run, ctx.beam_search(
                [(prompt_ids, beam_params)],
                request_id,
                request.priority,
                request.n,
                logprobs,
                request.skip_special_tokens,
            )
        engine_logprobs = logprobs if logprobs is not None else (0 if num_samples > request.n else None)
        params = ctx.sampling_params(
            request,
            n=num_samples,
            max_tokens=max_tokens,
            logprobs=engine_logprobs,
            prompt_logprobs=request.prompt_logprobs,
            structured_outputs=structured,
        )
        request_id = ctx.engine_request_id(raw_request, request, id_prefix)
        ctx.log_request(request_id, prompt_text, prompt_ids, params)

        run = _ChatRun(self, request, request_id, model_name, prompt_ids, tool_mode)
        lora_request = ctx.models.lora_request_for(model_name)
        return run, ctx.generate_all([(prompt, params)], request_id, request.priority, lora_request)


class _ChatRun:
    """The state of one chat request while its outputs arrive."""

    def __init__(
        self,
        handler: ChatHandler,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        prompt_ids: list[int],
        tool_mode: ToolMode,
    ):
        self.ctx = handler.ctx
        self.handler = handler
        self.request = request
        self.request_id = request_id
        self.model_name = model_name
        self.num_prompt_tokens = len(prompt_ids)
        self.tool_mode = tool_mode
        self.as_token_ids = self.ctx.return_token_ids(request)
        self.created = int(time.time())
        last_message = request.messages[-1]
        self.role = handler.response_role if request.add_generation_prompt else last_message.get("role", "assistant")
        self.echo_text = message_text(last_message) if request.echo and last_message.get("role") == self.role else ""
        self._parsers: dict[int, _ChoiceParsers] = {}

    def parsers_for(self, index: int) -> _ChoiceParsers:
        if index not in self._parsers:
            tokenizer = self.ctx.tokenizer
            tool_parser_class = self.handler.tool_parser_class if self.tool_mode == "parser" else None
            tool = tool_parser_class(tokenizer) if tool_parser_class is not None else None
            reasoning = self.handler.reasoning_parser_class(tokenizer) if self.handler.reasoning_parser_class else None
            self._parsers[index] = _ChoiceParsers(tool, reasoning)
        return self._parsers[index]

    def logprobs_for(self, token_ids: list[int], positions: Sequence[dict[int, Logprob] | None]) -> ChatLogProbs | None:
        if not self.request.logprobs:
            return None
        return chat_logprobs(self.ctx, token_ids, positions, self.request.top_logprobs or 0, self.as_token_ids)

    # -- whole responses --------------------------------------------------------------

    async def collect(self, outputs: IndexedOutputs) -> ChatCompletionResponse:
        states: dict[int, ChoiceState] = {}
        prompt_logprobs: PromptLogprobs | None = None
        cached_tokens = 0
        async for _, output in outputs:
            check_output(output, self.request_id)
            if output.prompt_logprobs is not None and prompt_logprobs is None:
                prompt_logprobs = output.prompt_logprobs
            cached_tokens = output.num_cached_tokens
            for choice in output.outputs:
                states.setdefault(choice.index, ChoiceState()).add(choice)
        samples = [state for _, state in sorted(states.items())]
        if len(samples) > self.request.n:
            samples = pick_best(samples, self.request.n)
        choices = [self.choice(index, state) for index, state in enumerate(samples)]
        usage = self.ctx.usage(
            self.num_prompt_tokens, sum(len(state.token_ids) for state in states.values()), cached_tokens
        )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            prompt_logprobs=self.ctx.prompt_logprobs_json(prompt_logprobs)
            if self.request.prompt_logprobs is not None
            else None,
        )

    def choice(self, index: int, state: ChoiceState) -> ChatChoice:
        content: str | None = state.text
        reasoning = None
        tool_calls: list[ToolCall] = []
        finish_reason = state.finish_reason
        parsers_ = self.parsers_for(index)
        if parsers_.reasoning is not None:
            reasoning, content = parsers_.reasoning.extract_reasoning(state.text, self.request)
        if isinstance(self.tool_mode, dict):
            tool_calls = [
                ToolCall(
                    id=new_tool_call_id(), function=FunctionCall(name=self.tool_mode["name"], arguments=content or "")
                )
            ]
            content = None
        elif self.tool_mode == "required":
            tool_calls = parse_required_tool_calls(content or "")
            if tool_calls:
                content = None
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        elif parsers_.tool is not None:
            extracted = parsers_.tool.extract(content or "", self.request)
            if extracted.tools_called:
                tool_calls = [
                    ToolCall(
                        id=call.id or new_tool_call_id(),
                        function=FunctionCall(name=call.name, arguments=call.arguments),
                    )
                    for call in extracted.tool_calls
                ]
                if self.request.parallel_tool_calls is False:
                    tool_calls = tool_calls[:1]
                content = extracted.content
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
            elif extracted.content:
                # no call: the parser's content still stands when it has one, as in vLLM (mistral
                # returns a malformed call without its [TOOL_CALLS] marker)
                content = extracted.content
        if self.echo_text:
            content = self.echo_text + (content or "")
        message = ChatMessage(role=self.role, content=content, reasoning_content=reasoning, tool_calls=tool_calls)
        return ChatChoice(
            index=index,
            message=message,
            logprobs=self.logprobs_for(state.token_ids, state.logprobs),
            finish_reason=finish_reason,
            stop_reason=state.stop_reason,
        )

    # -- streaming --------------------------------------------------------------------

    def stream(self, first: tuple[int, RequestOutput], outputs: IndexedOutputs) -> AsyncIterator[str]:
        return ChatChunkWriter(self).stream(first, outputs)

    def deltas(
        self, output: RequestOutput, states: dict[int, ChoiceState], cached: dict[str, int]
    ) -> list[ChoiceDelta]:
        """What one engine output adds to each choice, through the parsers; ``states``
        accumulates the choices, ``cached["tokens"]`` the prompt's cached-token count."""
        check_output(output, self.request_id)
        cached["tokens"] = output.num_cached_tokens
        pieces = []
        for choice in output.outputs:
            state = states.setdefault(choice.index, ChoiceState())
            state.add(choice)
            parsers_ = self.parsers_for(choice.index)
            delta = self.parse_delta(parsers_, choice.text)
            finish_reason = choice.finish_reason
            if finish_reason is not None:
                delta = merge_deltas(delta, self.finish_parsers(parsers_))
            if delta is not None and delta.tool_calls and parsers_.tool is not None:
                parsers_.called_tools = True
            if finish_reason == "stop" and parsers_.called_tools:
                finish_reason = "tool_calls"
            logprobs = self.logprobs_for(choice.token_ids, choice.logprobs or []) if choice.token_ids else None
            if delta is None and finish_reason is None and logprobs is None:
                continue
            pieces.append(ChoiceDelta(choice.index, delta, finish_reason, choice.stop_reason, logprobs))
        return pieces

    def parse_delta(self, parsers_: _ChoiceParsers, text: str) -> DeltaMessage | None:
        if not text:
            return None
        if isinstance(self.tool_mode, dict):
            # a named function: the whole output is its arguments
            call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
            if not parsers_.named_call_started:
                parsers_.named_call_started = True
                call = DeltaToolCall(
                    index=0,
                    id=new_tool_call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=self.tool_mode["name"], arguments=text),
                )
            return DeltaMessage(tool_calls=[call])
        content: str | None = text
        reasoning: str | None = None
        if parsers_.reasoning is not None:
            piece = parsers_.reasoning.extract_reasoning_delta(text, self.request)
            content = piece.content if piece else None
            reasoning = piece.reasoning_content if piece else None
        if self.tool_mode == "required":
            parsers_.required_calls_text += content or ""
            return DeltaMessage(reasoning_content=reasoning) if reasoning else None
        if parsers_.tool is not None and content:
            return merge_deltas(
                DeltaMessage(reasoning_content=reasoning) if reasoning else None,
                self.tool_delta(parsers_.tool.extract_delta(content, self.request)),
            )
        if content is None and reasoning is None:
            return None
        return DeltaMessage(content=content, reasoning_content=reasoning)

    def finish_parsers(self, parsers_: _ChoiceParsers) -> DeltaMessage | None:
        """What the parsers still hold when the output ends; the reasoning parser's rest goes
        through the tool parser like any other content."""
        if isinstance(self.tool_mode, dict):
            return None
        if self.tool_mode == "required":
            # the calls are whole only when the array is: they are sent at the end
            calls = parse_required_tool_calls(parsers_.required_calls_text)
            parsers_.called_tools = bool(calls)
            return (
                DeltaMessage(
                    tool_calls=[
                        DeltaToolCall(
                            index=index,
                            id=call.id,
                            type="function",
                            function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
                        )
                        for index, call in enumerate(calls)
                    ]
                )
                if calls
                else DeltaMessage(content=parsers_.required_calls_text)
            )
        delta = None
        rest = parsers_.reasoning.finish(self.request) if parsers_.reasoning is not None else None
        if rest is not None and rest.reasoning_content:
            delta = DeltaMessage(reasoning_content=rest.reasoning_content)
        if rest is not None and rest.content:
            content_delta = (
                self.tool_delta(parsers_.tool.extract_delta(rest.content, self.request))
                if parsers_.tool is not None
                else DeltaMessage(content=rest.content)
            )
            delta = merge_deltas(delta, content_delta)
        if parsers_.tool is not None:
            delta = merge_deltas(delta, self.tool_delta(parsers_.tool.finish(self.request)))
        return delta

    def tool_delta(self, piece: parsers.DeltaMessage | None) -> DeltaMessage | None:
        """A tool parser's delta on the wire; with parallel_tool_calls false, the first call only."""
        if piece is not None and self.request.parallel_tool_calls is False:
            piece = dataclasses.replace(piece, tool_calls=[call for call in piece.tool_calls if call.index == 0])
        return wire_delta(piece)
