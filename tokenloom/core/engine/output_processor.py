"""The output side of the engine: the state of every admitted request (its sequences, their
detokenizers, what has been reported of each), the step's new tokens turned into text and
logprobs, and the :class:`RequestOutput` / :class:`PoolingRequestOutput` handed to callers.

It never touches the scheduler: when a stop string ends a sequence it says so, and the engine
finishes that sequence in the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenloom.core.batch import ModelRunnerOutput, TokenLogprobs
from tokenloom.core.detokenizer import IncrementalDetokenizer
from tokenloom.core.engine.input_processor import PreparedPrompt
from tokenloom.core.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from tokenloom.core.sampling_params import PoolingParams, RequestOutputKind, SamplingParams
from tokenloom.core.sequence import EngineSequence, SequenceStatus


@dataclass
class RequestState:
    """One user request: its ``n`` sequences and what has been reported of each."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    sequences: list[EngineSequence]
    detokenizers: list[IncrementalDetokenizer | None]
    arrival_time: float
    # per sequence: text / tokens / logprobs already sent (for DELTA outputs)
    sent_text: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    num_processed_tokens: list[int] = field(default_factory=list)
    logprobs: list[list[dict[int, Logprob]] | None] = field(default_factory=list)
    # set once, when the first sequence has computed its whole prompt (None until then)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    sent_prompt_logprobs: bool = False  # DELTA outputs carry them once
    first_token_time: float | None = None
    pooling_params: PoolingParams | None = None  # set for a pooling request

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)

    @property
    def seq_ids(self) -> list[str]:
        return [seq.seq_id for seq in self.sequences]


class OutputProcessor:
    """Owns the admitted requests' state and makes their outputs. One thread uses it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._sequence_owner: dict[str, RequestState] = {}
        self._decoded_tokens: dict[int, str] = {}
        self.generation_tokens_total = 0

    # -- request state --------------------------------------------------------------------

    def new_request_state(
        self,
        request_id: str,
        prepared: PreparedPrompt,
        params: SamplingParams,
        sequences: list[EngineSequence],
        arrival_time: float,
    ) -> RequestState:
        """The state of a generate request (not yet registered: see :meth:`add`)."""
        n = len(sequences)
        return RequestState(
            request_id=request_id,
            prompt=prepared.prompt,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=params,
            sequences=sequences,
            detokenizers=[self._detokenizer(prepared.prompt_token_ids, seq.sampling_params) for seq in sequences],
            arrival_time=arrival_time,
            sent_text=[0] * n,
            sent_tokens=[0] * n,
            texts=[""] * n,
            num_processed_tokens=[0] * n,
            logprobs=[[] if params.logprobs is not None else None for _ in sequences],
        )

    @staticmethod
    def new_pooling_state(
        request_id: str, prepared: PreparedPrompt, params: PoolingParams, sequence: EngineSequence
    ) -> RequestState:
        """The state of a pooling request (not yet registered: see :meth:`add`)."""
        return RequestState(
            request_id=request_id,
            prompt=prepared.prompt,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=sequence.sampling_params,
            sequences=[sequence],
            detokenizers=[None],
            arrival_time=sequence.arrival_time,
            sent_text=[0],
            sent_tokens=[0],
            texts=[""],
            num_processed_tokens=[0],
            logprobs=[None],
            pooling_params=params,
        )

    def id_in_use(self, request_id: str) -> bool:
        """True when ``request_id`` names an admitted request or one of its sequences."""
        return request_id in self.requests or request_id in self._sequence_owner

    def add(self, state: RequestState) -> None:
        """Register an admitted request so that its sequences' progress is reported."""
        self.requests[state.request_id] = state
        for seq in state.sequences:
            self._sequence_owner[seq.seq_id] = state

    def owner(self, seq_id: str) -> RequestState | None:
        return self._sequence_owner.get(seq_id)

    def pop(self, request_id: str) -> RequestState | None:
        """Forget a request (finished or aborted); its state, or None when unknown."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for seq in state.sequences:
                self._sequence_owner.pop(seq.seq_id, None)
        return state

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self.requests.values())

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)

    # -- one step's tokens --------------------------------------------------------------

    def process_sequence(
        self, state: RequestState, seq: EngineSequence, runner_output: ModelRunnerOutput, now: float
    ) -> str | None:
        """Take in the step's new tokens of ``seq``: logprobs, text, stop strings.

        :returns: the stop string that ended an unfinished sequence in this step (the engine
            must then finish it in the scheduler and call :meth:`update_text`), else None.
        """
        index = seq.index
        if seq.seq_id in runner_output.errors:
            seq.stop_reason = runner_output.errors[seq.seq_id]
        new_token_ids = seq.output_token_ids[state.num_processed_tokens[index] :]
        state.num_processed_tokens[index] = len(seq.output_token_ids)
        self.generation_tokens_total += len(new_token_ids)
        if new_token_ids and state.first_token_time is None:
            state.first_token_time = now
        if state.sampling_params.prompt_logprobs is not None and state.prompt_logprobs is None and new_token_ids:
            # the prompt is computed: the scheduler kept the entries of each of its chunks (a
            # chunk that samples nothing is not reported here); the first position has none
            state.prompt_logprobs = [None] + [self.logprob_dict(entry) for entry in seq.prompt_logprobs or []]
        sequence_logprobs = state.logprobs[index]
        if sequence_logprobs is not None:
            # a step may verify several tokens and the scheduler keep fewer (a stop token)
            for entry in runner_output.logprobs.get(seq.seq_id, [])[: len(new_token_ids)]:
                sequence_logprobs.append(self.logprob_dict(entry))
                seq.cumulative_logprob += entry.logprobs[0]
        detokenizer = state.detokenizers[index]
        if detokenizer is None:
            return None
        if (
            new_token_ids
            and seq.status is SequenceStatus.FINISHED_STOPPED
            and not isinstance(seq.stop_reason, str)
            and not seq.sampling_params.include_stop_str_in_output
        ):
            # the EOS or stop_token_ids token that ended the output is not part of its text
            # (it would show whenever special tokens are kept, e.g. for tool-call parsers)
            new_token_ids = new_token_ids[:-1]
        stopped_by = None
        if len(new_token_ids) > 1 and detokenizer.has_stop_strings and not seq.finished:
            # several tokens in one step (speculative decoding): the output must end with the
            # token that completed a stop string, as it would one token at a time
            for position, token_id in enumerate(new_token_ids):
                detokenizer.update([token_id])
                if detokenizer.stop_string is not None:
                    self._drop_tokens_after(state, seq, len(new_token_ids) - position - 1)
                    seq.stop_reason = stopped_by = detokenizer.stop_string
                    break
        elif new_token_ids:
            detokenizer.update(new_token_ids)
            if detokenizer.stop_string is not None and not seq.finished:
                seq.stop_reason = stopped_by = detokenizer.stop_string
        if stopped_by is None:
            self.update_text(state, seq)
        return stopped_by

    def _drop_tokens_after(self, state: RequestState, seq: EngineSequence, num_dropped: int) -> None:
        """Take back the last ``num_dropped`` output tokens (they followed a stop string)."""
        if num_dropped <= 0:
            return
        del seq.output_token_ids[-num_dropped:]
        if seq.logprobs is not None:
            del seq.logprobs[len(seq.output_token_ids) :]
        sequence_logprobs = state.logprobs[seq.index]
        if sequence_logprobs is not None:
            for entry in sequence_logprobs[len(seq.output_token_ids) :]:
                seq.cumulative_logprob -= next(iter(entry.values())).logprob
            del sequence_logprobs[len(seq.output_token_ids) :]
        state.num_processed_tokens[seq.index] = len(seq.output_token_ids)
        self.generation_tokens_total -= num_dropped
        # the scheduler caches blocks only over tokens the sequence really holds
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)

    def update_text(self, state: RequestState, seq: EngineSequence) -> None:
        """The text of ``seq`` that may be shown: all of it once finished, else what can no
        longer turn out to start a stop string."""
        detokenizer = state.detokenizers[seq.index]
        if detokenizer is None:
            return
        if seq.finished:
            if detokenizer.stop_string is None:
                detokenizer.flush()
            state.texts[seq.index] = detokenizer.output_text
        else:
            state.texts[seq.index] = detokenizer.released_text

    def logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for position, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs, strict=True)):
            if token_id in result:
                continue
            rank = entry.rank if position == 0 else position
            result[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=self.decode_token(token_id))
        return result

    def decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._decoded_tokens.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id]))
            self._decoded_tokens[token_id] = text
        return text

    # -- outputs ------------------------------------------------------------------------

    def make_output(self, state: RequestState) -> RequestOutput | None:
        """The request's output for this step by its output kind; None when there is
        nothing to report (FINAL_ONLY before the end, DELTA without news)."""
        kind = state.sampling_params.output_kind
        finished = state.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = []
        for seq in state.sequences:
            i = seq.index
            text = state.texts[i]
            token_ids = seq.output_token_ids
            logprobs = state.logprobs[i]
            if delta:
                text, token_ids = text[state.sent_text[i] :], token_ids[state.sent_tokens[i] :]
                if logprobs is not None:
                    logprobs = logprobs[state.sent_tokens[i] :]
                if not text and not token_ids and not seq.finished:
                    continue
                state.sent_text[i] = len(state.texts[i])
                state.sent_tokens[i] = len(seq.output_token_ids)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(token_ids),
                    cumulative_logprob=seq.cumulative_logprob if logprobs is not None else None,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        if delta and not completions:
            return None
        prompt_logprobs = None if delta and state.sent_prompt_logprobs else state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            state.sent_prompt_logprobs = True
        first = state.sequences[0]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=RequestMetrics(
                arrival_time=state.arrival_time,
                first_scheduled_time=first.first_scheduled_time,
                first_token_time=state.first_token_time,
                finished_time=time.monotonic() if finished else None,
                num_cached_tokens=first.num_cached_tokens,
                num_preemptions=sum(seq.num_preemptions for seq in state.sequences),
            ),
            num_cached_tokens=first.num_cached_tokens,
        )

    @staticmethod
    def make_pooling_output(state: RequestState, runner_output: ModelRunnerOutput) -> PoolingRequestOutput:
        sequence = state.sequences[0]
        error = None
        if sequence.status is SequenceStatus.FINISHED_ERROR:
            error = str(sequence.stop_reason or "the request failed in the worker")
        pooled = runner_output.pooled.get(sequence.seq_id)
        return PoolingRequestOutput(
            request_id=state.request_id,
            outputs=PoolingOutput(data=pooled),
            prompt_token_ids=state.prompt_token_ids,
            finished=state.finished,
            prompt=state.prompt,
            error=error,
        )
