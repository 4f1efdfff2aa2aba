"""POST /v1/completions: prompts (strings or token ids, one or many) to OpenAI completion
responses or SSE chunks, with echo, legacy logprobs, best_of and usage."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from tokenloom.api.engine_runs import IndexedOutputs, respond
from tokenloom.api.http_errors import sse_error_event
from tokenloom.api.prompt_inputs import OFF_LOOP_DETOKENIZE_TOKENS, input_size, off_loop_if_large
from tokenloom.api.protocol import (
    SSE_DONE,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    sse_event,
)
from tokenloom.api.serving_base import ChoiceState, ServingContext, clamp_logprob, pick_best
from tokenloom.core.outputs import Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from tokenloom.errors import InvalidRequestError, TokenloomError

logger = logging.getLogger(__name__)


def completion_logprobs(
    ctx: ServingContext,
    token_ids: list[int],
    positions: list[dict[int, Logprob] | None],
    num_top: int,
    as_token_ids: bool,
    initial_offset: int = 0,
) -> CompletionLogProbs:
    """OpenAI's legacy format; a position without logprobs (the first prompt token) is null.
    ``top_logprobs`` holds the top ``num_top`` tokens plus the chosen one, as vLLM does."""
    result = CompletionLogProbs()
    offset = initial_offset
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        token = ctx.token_text(token_id, chosen, as_token_ids)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
        top: dict[str, float] = {}
        for candidate_id, candidate in sorted(position.items(), key=lambda item: item[1].rank or 0):
            if candidate_id == token_id or candidate.rank is None or candidate.rank <= num_top:
                top[ctx.token_text(candidate_id, candidate, as_token_ids)] = clamp_logprob(candidate.logprob)
        result.top_logprobs.append(top)
    return result


async def completion_prompt_texts(ctx: ServingContext, prompts: list[Any], prompt_ids: list[list[int]]) -> list[str]:
    """The text of each prompt (for echo): token-id prompts decoded, in a worker thread when
    they are many."""
    id_prompts = [ids for prompt, ids in zip(prompts, prompt_ids) if not isinstance(prompt, str)]

    def texts() -> list[str]:
        return [
            # without a tokenizer (--skip-tokenizer-init) text fields are empty, as in vLLM
            prompt if isinstance(prompt, str) else (ctx.tokenizer.decode(ids) if ctx.tokenizer is not None else "")
            for prompt, ids in zip(prompts, prompt_ids)
        ]

    return await off_loop_if_large(input_size(id_prompts), OFF_LOOP_DETOKENIZE_TOKENS, texts)


class CompletionsHandler:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        ctx = self.ctx
        ctx.check_ready()
        model_name = ctx.check_model(request.model)
        ctx.warn_unknown_fields(request, "/v1/completions")
        if request.suffix is not None:
            raise InvalidRequestError(
                "suffix is not supported by this server (nor by vLLM); remove it and put "
                "the text after the insertion point in the prompt instead",
                param="suffix",
            )
        num_samples = ctx.num_samples(request)
        ctx.check_logprobs(request.logprobs, "logprobs")
        ctx.check_logprobs(request.prompt_logprobs, "prompt_logprobs")

        prompts = request.prompts()
        prompt_ids = await ctx.prepare_prompts(prompts, request.add_special_tokens, request.truncate_prompt_tokens)
        # best_of ranks by cumulative logprob, which needs the sampled tokens' logprobs
        engine_logprobs = request.logprobs if request.logprobs is not None else (0 if num_samples > request.n else None)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(request.logprobs, prompt_logprobs or 0)
        structured = request.structured_output_constraint()
        if request.use_beam_search:
            ctx.check_beam_search(request, num_samples, structured)
            ctx.check_priority(request.priority)
            beam_inputs = [
                (
                    ids,
                    ctx.beam_search_params(request, num_samples, ctx.resolve_max_tokens(len(ids), request.max_tokens)),
                )
                for ids in prompt_ids
            ]
            request_id = ctx.engine_request_id(raw_request, request, "cmpl")
            prompt_texts = await completion_prompt_texts(ctx, prompts, prompt_ids)
            run = _CompletionRun(ctx, request, request_id, model_name, prompt_texts, prompt_ids)
            outputs = ctx.beam_search(
                beam_inputs, request_id, request.priority, request.n, request.logprobs, request.skip_special_tokens
            )
            return await respond(raw_request, run, outputs, request_id, stream=False)
        engine_inputs = []
        for ids in prompt_ids:
            max_tokens = ctx.resolve_max_tokens(len(ids), request.max_tokens)
            params = ctx.sampling_params(
                request,
                n=num_samples,
                max_tokens=max_tokens,
                logprobs=engine_logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured,
            )
            engine_inputs.append((ids, params))

        request_id = ctx.engine_request_id(raw_request, request, "cmpl")
        for index, (ids, params) in enumerate(engine_inputs):
            ctx.log_request(request_id if len(prompts) == 1 else f"{request_id}-{index}", prompts[index], ids, params)
        prompt_texts = await completion_prompt_texts(ctx, prompts, prompt_ids)
        run = _CompletionRun(ctx, request, request_id, model_name, prompt_texts, prompt_ids)
        outputs = ctx.generate_all(engine_inputs, request_id, request.priority, ctx.models.lora_request_for(model_name))
        return await respond(raw_request, run, outputs, request_id, request.stream)


class _CompletionRun:
    """The state of one completions request while its outputs arrive."""

    def __init__(
        self,
        ctx: ServingContext,
        request: CompletionRequest,
        request_id: str,
        model_name: str,
        prompt_texts: list[str],
        prompt_ids: list[list[int]],
    ):
        self.ctx = ctx
        self.request = request
        self.request_id = request_id
        self.model_name = model_name
        self.prompt_ids = prompt_ids
        self.prompt_texts = prompt_texts
        self.as_token_ids = ctx.return_token_ids(request)
        self.created = int(time.time())
        self.num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
        # per prompt: its prompt logprobs, which come once (with its first output), for the
        # echo of every choice, however late that choice's first token comes
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}

    def choice_index(self, prompt_index: int, output_index: int) -> int:
        return prompt_index * self.request.n + output_index

    def logprobs_for(
        self,
        prompt_index: int,
        state_tokens: list[int],
        state_logprobs: SampleLogprobs,
        echo_prompt: bool,
        prompt_logprobs: PromptLogprobs | None,
        initial_offset: int,
    ) -> CompletionLogProbs | None:
        if self.request.logprobs is None:
            return None
        token_ids = list(state_tokens)
        positions: list[dict[int, Logprob] | None] = list(state_logprobs)
        if echo_prompt:
            prompt = self.prompt_ids[prompt_index]
            prompt_positions: PromptLogprobs = list(prompt_logprobs) if prompt_logprobs else [None] * len(prompt)
            token_ids, positions = prompt + token_ids, prompt_positions + positions
        return completion_logprobs(
            self.ctx, token_ids, positions, self.request.logprobs, self.as_token_ids, initial_offset
        )

    async def collect(self, outputs: IndexedOutputs) -> CompletionResponse:
        states: dict[tuple[int, int], ChoiceState] = {}
        prompt_logprobs: dict[int, PromptLogprobs] = {}
        cached_tokens: dict[int, int] = {}
        async for prompt_index, output in outputs:
            check_output(output, self.request_id)
            if output.prompt_logprobs is not None:
                prompt_logprobs.setdefault(prompt_index, output.prompt_logprobs)
            cached_tokens[prompt_index] = output.num_cached_tokens
            for choice in output.outputs:
                states.setdefault((prompt_index, choice.index), ChoiceState()).add(choice)

        choices: list[CompletionChoice] = []
        for prompt_index in range(len(self.prompt_ids)):
            samples = [state for (index, _), state in sorted(states.items()) if index == prompt_index]
            if len(samples) > self.request.n:
                samples = pick_best(samples, self.request.n)
            for output_index, state in enumerate(samples):
                echo = self.request.echo
                text = (self.prompt_texts[prompt_index] if echo else "") + state.text
                choices.append(
                    CompletionChoice(
                        index=self.choice_index(prompt_index, output_index),
                        text=text,
                        logprobs=self.logprobs_for(
                            prompt_index, state.token_ids, state.logprobs, echo, prompt_logprobs.get(prompt_index), 0
                        ),
                        finish_reason=state.finish_reason,
                        stop_reason=state.stop_reason,
                        prompt_logprobs=self.ctx.prompt_logprobs_json(prompt_logprobs.get(prompt_index))
                        if self.request.prompt_logprobs is not None
                        else None,
                        prompt_token_ids=list(self.prompt_ids[prompt_index]) if self.request.return_token_ids else None,
                        token_ids=list(state.token_ids) if self.request.return_token_ids else None,
                    )
                )
        num_generated = sum(len(state.token_ids) for state in states.values())
        usage = self.ctx.usage(self.num_prompt_tokens, num_generated, sum(cached_tokens.values()))
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )

    async def stream(self, first: tuple[int, RequestOutput], outputs: IndexedOutputs) -> AsyncIterator[str]:
        options = self.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = bool(options and options.continuous_usage_stats)
        states: dict[int, ChoiceState] = {}
        cached_tokens: dict[int, int] = {}
        try:
            for chunk in self.chunks(*first, states, cached_tokens, continuous_usage):
                yield chunk
            async for prompt_index, output in outputs:
                for chunk in self.chunks(prompt_index, output, states, cached_tokens, continuous_usage):
                    yield chunk
            if include_usage:
                final = CompletionStreamResponse(
                    id=self.request_id,
                    created=self.created,
                    model=self.model_name,
                    choices=[],
                    usage=self.usage_so_far(states, cached_tokens),
                )
                yield sse_event(final)
        except Exception as exc:
            if not isinstance(exc, TokenloomError):
                logger.exception("request %s failed while streaming", self.request_id)
            yield sse_error_event(exc, self.request_id)
        finally:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
        yield SSE_DONE

    def usage_so_far(self, states: dict[int, ChoiceState], cached_tokens: dict[int, int]) -> UsageInfo:
        return self.ctx.usage(
            self.num_prompt_tokens, sum(len(state.token_ids) for state in states.values()), sum(cached_tokens.values())
        )

    def chunks(
        self,
        prompt_index: int,
        output: RequestOutput,
        states: dict[int, ChoiceState],
        cached_tokens: dict[int, int],
        continuous_usage: bool,
    ) -> list[str]:
        check_output(output, self.request_id)
        cached_tokens[prompt_index] = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs.setdefault(prompt_index, output.prompt_logprobs)
        events = []
        for choice in output.outputs:
            index = self.choice_index(prompt_index, choice.index)
            first_chunk = index not in states
            state = states.setdefault(index, ChoiceState())
            echo_now = self.request.echo and first_chunk
            offset = len(state.text) + (
                len(self.prompt_texts[prompt_index]) if self.request.echo and not first_chunk else 0
            )
            state.add(choice)
            text = (self.prompt_texts[prompt_index] if echo_now else "") + choice.text
            has_logprobs = self.request.logprobs is not None and (choice.token_ids or echo_now)
            with_ids = bool(self.request.return_token_ids)
            if not text and choice.finish_reason is None and not has_logprobs and not (with_ids and choice.token_ids):
                continue
            logprobs = self.logprobs_for(
                prompt_index,
                choice.token_ids,
                choice.logprobs or [],
                echo_now,
                self.prompt_logprobs.get(prompt_index),
                offset,
            )
            chunk = CompletionStreamResponse(
                id=self.request_id,
                created=self.created,
                model=self.model_name,
                choices=[
                    CompletionStreamChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                        prompt_token_ids=list(self.prompt_ids[prompt_index]) if with_ids and first_chunk else None,
                        token_ids=list(choice.token_ids) if with_ids else None,
                    )
                ],
                usage=self.usage_so_far(states, cached_tokens) if continuous_usage else None,
            )
            events.append(sse_event(chunk))
        return events


def check_output(output: RequestOutput, request_id: str) -> None:
    if output.error:
        # the engine's detail goes to the log, the client gets the generic 500 message
        raise RuntimeError(f"the engine failed request {request_id}: {output.error}")
