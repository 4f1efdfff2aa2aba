"""The server-sent events of a streamed chat completion: per choice the role delta first (and
the echoed message with echo), then one chunk per parsed choice delta (:class:`ChoiceDelta`, the
streaming path's unit, which :meth:`_ChatRun.deltas` gives and the Responses and Messages
writers read too), the usage chunk last when asked (or the usage so far in every chunk), an
error event if the run fails, and ``data: [DONE]``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio

from tokenloom.api.engine_runs import IndexedOutputs
from tokenloom.api.http_errors import sse_error_event
from tokenloom.api.protocol import (
    SSE_DONE,
    ChatCompletionStreamResponse,
    ChatLogProbs,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    sse_event,
)
from tokenloom.api.serving_base import ChoiceState
from tokenloom.core.outputs import RequestOutput
from tokenloom.errors import TokenloomError

if TYPE_CHECKING:
    from tokenloom.api.serving_chat import _ChatRun

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ChoiceDelta:
    """What one engine output added to one choice, parsed: the streaming path's unit."""

    index: int
    delta: DeltaMessage | None
    finish_reason: str | None
    stop_reason: Any
    logprobs: ChatLogProbs | None


class ChatChunkWriter:
    """The chunks of one streamed chat completion, from its run's parsed deltas."""

    def __init__(self, run: _ChatRun):
        self.run = run

    def chunk(
        self,
        index: int,
        delta: DeltaMessage,
        *,
        logprobs: ChatLogProbs | None = None,
        finish_reason: str | None = None,
        stop_reason: Any = None,
        usage: UsageInfo | None = None,
    ) -> str:
        choice = ChatStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason
        )
        return sse_event(
            ChatCompletionStreamResponse(
                id=self.run.request_id,
                created=self.run.created,
                model=self.run.model_name,
                choices=[choice],
                usage=usage,
            )
        )

    async def stream(self, first: tuple[int, RequestOutput], outputs: IndexedOutputs) -> AsyncIterator[str]:
        options = self.run.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = bool(options and options.continuous_usage_stats)
        states: dict[int, ChoiceState] = {}
        cached = {"tokens": first[1].num_cached_tokens}

        def usage() -> UsageInfo:
            return self.run.ctx.usage(
                self.run.num_prompt_tokens, sum(len(s.token_ids) for s in states.values()), cached["tokens"]
            )

        try:
            for index in range(self.run.request.n):
                yield self.chunk(index, DeltaMessage(role=self.run.role), usage=usage() if continuous_usage else None)
                if self.run.echo_text:
                    yield self.chunk(
                        index, DeltaMessage(content=self.run.echo_text), usage=usage() if continuous_usage else None
                    )
            for event in self.chunks(first[1], states, cached, usage if continuous_usage else None):
                yield event
            async for _, output in outputs:
                for event in self.chunks(output, states, cached, usage if continuous_usage else None):
                    yield event
            if include_usage:
                yield sse_event(
                    ChatCompletionStreamResponse(
                        id=self.run.request_id,
                        created=self.run.created,
                        model=self.run.model_name,
                        choices=[],
                        usage=usage(),
                    )
                )
        except Exception as exc:
            if not isinstance(exc, TokenloomError):
                logger.exception("request %s failed while streaming", self.run.request_id)
            yield sse_error_event(exc, self.run.request_id)
        finally:
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
        yield SSE_DONE

    def chunks(
        self,
        output: RequestOutput,
        states: dict[int, ChoiceState],
        cached: dict[str, int],
        usage: Callable[[], UsageInfo] | None,
    ) -> list[str]:
        return [
            self.chunk(
                piece.index,
                piece.delta or DeltaMessage(),
                logprobs=piece.logprobs,
                finish_reason=piece.finish_reason,
                stop_reason=piece.stop_reason,
                usage=usage() if usage else None,
            )
            for piece in self.run.deltas(output, states, cached)
        ]
