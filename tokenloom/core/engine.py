"""The engine: :class:`LLMEngine` (one ``step()`` = schedule -> execute -> apply tokens,
detokenize, check stops) and :class:`AsyncLLM`, which runs that loop in a background thread
and gives every request its own async output stream, aborting it when the stream is closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable

from tokenloom.core.batch import ModelRunnerOutput, TokenLogprobs
from tokenloom.core.config import EngineArgs, EngineConfig
from tokenloom.core.detokenizer import IncrementalDetokenizer
from tokenloom.core.model_loader import resolve_model
from tokenloom.core.pooling import POOLING, check_pooling_params, prepare_pooling_prompt
from tokenloom.core.request import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    SamplingParams,
    unwrap_prompt,
)
from tokenloom.core.sampler import SamplingState, tokenize_bad_words
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.structured_output import StructuredOutputManager
from tokenloom.errors import ContextLengthError, EngineDeadError, InvalidRequestError
from tokenloom.plugins.manager import PluginSet, load_plugins

logger = logging.getLogger(__name__)

DEFAULT_EXECUTOR = "uni"
# how long an idle step waits for a grammar compile before looking at new commands again
GRAMMAR_WAIT_SECONDS = 0.05


@dataclass
class PreparedPrompt:
    """A validated prompt: its token ids (and text when it came as text)."""

    prompt_token_ids: list[int]
    prompt: str | None


@dataclass
class RequestState:
    """One user request: its ``n`` sequences and what has been reported of each."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    sequences: list[Request]
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


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


class LLMEngine:
    """The synchronous engine. Not thread-safe: one thread calls it."""

    def __init__(self, config: EngineConfig, plugins: PluginSet):
        started = time.perf_counter()
        self.config = config
        self.plugins = plugins
        config.device.device = choose_platform(config.device.device, plugins)
        config.plugin_tables = plugins.to_plain()
        self.model_info, self.tokenizer = resolve_model(config, plugins)
        config.model_info = self.model_info
        self.max_model_len = self.model_info.max_model_len
        executor_name = config.parallel.distributed_executor_backend or DEFAULT_EXECUTOR
        self.executor = plugins.registry("executor").get(executor_name)(config)
        self.num_blocks = self.executor.initialize()
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks, self.max_model_len)
        self.structured_outputs = self._structured_output_manager()
        # constrained requests whose grammar is still compiling: kept out of the scheduler
        self._awaiting_grammar: list[tuple[RequestState, concurrent.futures.Future]] = []
        self.requests: dict[str, RequestState] = {}
        self._sequence_owner: dict[str, RequestState] = {}
        self._decoded_tokens: dict[int, str] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info("engine ready in %.2fs: %s, %d KV blocks of %d tokens, max_model_len %d",
                    time.perf_counter() - started, self.model_info.architecture, self.num_blocks,
                    config.cache.block_size, self.max_model_len)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, plugins: PluginSet | None = None) -> "LLMEngine":
        return cls(engine_args.create_engine_config(), plugins or load_plugins())

    @property
    def model_name(self) -> str:
        names = self.config.model.served_model_name
        return names[0] if names else self.config.model.model

    @property
    def runner(self) -> str:
        """``generate`` or ``pooling``: which kind of request this engine serves."""
        return self.model_info.runner

    # -- requests ---------------------------------------------------------------------

    def prepare_prompt(self, prompt: Any, params: SamplingParams) -> PreparedPrompt:
        """Tokenize and validate a prompt: text, token ids, or vLLM's dict forms."""
        text: str | None = None
        prompt = unwrap_prompt(prompt, "prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("the tokenizer was skipped (--skip-tokenizer-init): send token ids", param="prompt")
            text = prompt
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
            vocab_size = self.model_info.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is out of the vocabulary [0, {vocab_size})", param="prompt")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        self.check_fits(len(token_ids), params)
        return PreparedPrompt(token_ids, text)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        if num_prompt_tokens + 1 > self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens, but the model's context length is "
                f"{self.max_model_len}: shorten the prompt (or use truncate_prompt_tokens)", param="prompt")
        block_size = self.config.cache.block_size
        if -(-(num_prompt_tokens + 1) // block_size) > self.num_blocks:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens, more than the whole KV cache holds "
                f"({self.num_blocks} blocks of {block_size})", param="prompt")
        SamplingState(params, []).validate(self.model_info.vocab_size)  # token ids in params are in range
        max_logprobs = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise InvalidRequestError(f"{name} {value} is more than --max-logprobs {max_logprobs}", param=name)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *, priority: int = 0,
                    arrival_time: float | None = None, prepared: PreparedPrompt | None = None) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if self.runner == POOLING:
            raise InvalidRequestError(f"{self.model_name} is served as a pooling model (embeddings, scores): it "
                                      "does not generate text", param="model")
        prepared = prepared or self.prepare_prompt(prompt, params)
        params = self._with_bad_words(params)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        sequences = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + index)  # distinct but reproducible
            sequences.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=list(prepared.prompt_token_ids),
                sampling_params=child_params,
                eos_token_ids=set(self.model_info.eos_token_ids),
                arrival_time=arrival_time,
                priority=priority,
                parent_id=request_id,
                index=index,
                prompt=prepared.prompt,
            ))
        state = RequestState(
            request_id=request_id,
            prompt=prepared.prompt,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=params,
            sequences=sequences,
            detokenizers=[self._detokenizer(prepared.prompt_token_ids, seq.sampling_params) for seq in sequences],
            arrival_time=arrival_time,
            sent_text=[0] * params.n,
            sent_tokens=[0] * params.n,
            texts=[""] * params.n,
            num_processed_tokens=[0] * params.n,
            logprobs=[[] if params.logprobs is not None else None for _ in sequences],
        )
        grammar = self.submit_structured_output(params)
        if grammar is not None and not grammar.done():
            self._awaiting_grammar.append((state, grammar))  # the scheduler gets it once compiled
        elif grammar is not None:
            self._admit_constrained(state, grammar.result())  # a bad constraint raises here
        else:
            for seq in sequences:
                self.scheduler.add_request(seq)
        for seq in sequences:
            self._sequence_owner[seq.request_id] = state
        self.requests[request_id] = state
        self.prompt_tokens_total += len(prepared.prompt_token_ids)

    def prepare_pooling_prompt(self, prompt: Any, params: PoolingParams) -> PreparedPrompt:
        """Tokenize, truncate and validate a pooling prompt and its params."""
        if self.runner != POOLING:
            raise InvalidRequestError(f"{self.model_name} is served for generation: it does not pool (start it with "
                                      "--runner pooling or --convert embed for embeddings)", param="model")
        check_pooling_params(params, self.model_info.hf_config)
        token_ids, text = prepare_pooling_prompt(prompt, params, self.tokenizer, self.model_info.vocab_size,
                                                 self.max_model_len)
        return PreparedPrompt(token_ids, text)

    def add_pooling_request(self, request_id: str, prompt: Any, params: PoolingParams | None = None, *,
                            priority: int = 0, arrival_time: float | None = None,
                            prepared: PreparedPrompt | None = None) -> None:
        """Queue a prefill-only request whose output is its pooled hidden states."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params = params or PoolingParams()
        prepared = prepared or self.prepare_pooling_prompt(prompt, params)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # the sampling params are inert: the runner pools this request and never samples it
        sampling_params = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        sequence = Request(request_id=request_id, prompt_token_ids=list(prepared.prompt_token_ids),
                           sampling_params=sampling_params, arrival_time=arrival_time, priority=priority,
                           parent_id=request_id, prompt=prepared.prompt, pooling_params=params)
        state = RequestState(request_id=request_id, prompt=prepared.prompt, prompt_token_ids=prepared.prompt_token_ids,
                             sampling_params=sampling_params, sequences=[sequence], detokenizers=[None],
                             arrival_time=arrival_time, sent_text=[0], sent_tokens=[0], texts=[""],
                             num_processed_tokens=[0], logprobs=[None], pooling_params=params)
        self.scheduler.add_request(sequence)
        self._sequence_owner[request_id] = state
        self.requests[request_id] = state
        self.prompt_tokens_total += len(prepared.prompt_token_ids)

    def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """Tokenize ``bad_words`` once, here, so the worker needs no tokenizer."""
        if not params.bad_words or self.tokenizer is None:
            return params
        extra = dict(params.extra_args or {})
        extra["bad_words_token_ids"] = tokenize_bad_words(self.tokenizer, params.bad_words)
        return params.clone(extra_args=extra)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            self.scheduler.finish_requests([seq.request_id for seq in state.sequences], RequestStatus.FINISHED_ABORTED)
            for seq in state.sequences:
                self._sequence_owner.pop(seq.request_id, None)
            self._forget_constraint(state)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._awaiting_grammar)

    # -- structured outputs -----------------------------------------------------------

    def _structured_output_manager(self) -> StructuredOutputManager | None:
        if self.tokenizer is None:
            return None
        reasoning_parser = self.config.structured_output.reasoning_parser
        return StructuredOutputManager(
            self.config.structured_output, self.plugins.registry("structured_output_backend"), self.tokenizer,
            self.model_info.vocab_size, self.model_info.eos_token_ids,
            self.plugins.registry("reasoning_parser").get(reasoning_parser) if reasoning_parser else None)

    def submit_structured_output(self, params: SamplingParams) -> concurrent.futures.Future | None:
        """Check the request's constraint and start compiling it (or find it in the cache): a
        Future of the compiled constraint, None when unconstrained. Raises InvalidRequestError
        for a constraint no backend can take; compile errors come out of the Future."""
        if params.structured_outputs is None:
            return None
        if self.structured_outputs is None:
            raise InvalidRequestError("structured outputs need the tokenizer, which this server skipped "
                                      "(--skip-tokenizer-init)", param="structured_outputs")
        return self.structured_outputs.submit(*self.structured_outputs.resolve(params.structured_outputs))

    def _admit_constrained(self, state: RequestState, compiled: Any) -> None:
        """Queue the sequences of a request whose grammar compiled, each with its own matcher
        (n > 1: one per sequence); on an error nothing of it stays queued."""
        queued = []
        try:
            for seq in state.sequences:
                self.structured_outputs.add_sequence(seq, compiled)
                self.scheduler.add_request(seq)
                queued.append(seq.request_id)
        except Exception:
            self.scheduler.finish_requests(queued, RequestStatus.FINISHED_ABORTED)
            self.structured_outputs.remove_sequences(seq.request_id for seq in state.sequences)
            raise

    def _admit_compiled_requests(self, touched: dict[str, RequestState]) -> None:
        if not self.scheduler.has_unfinished_requests():
            # nothing else to run: wait (briefly, so commands are still read) for a compile
            concurrent.futures.wait([grammar for _, grammar in self._awaiting_grammar], timeout=GRAMMAR_WAIT_SECONDS,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        waiting = []
        for state, grammar in self._awaiting_grammar:
            if not grammar.done():
                waiting.append((state, grammar))
                continue
            try:
                self._admit_constrained(state, grammar.result())
            except Exception as exc:  # e.g. the schema did not compile: this request fails alone
                message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                for seq in state.sequences:
                    seq.status = RequestStatus.FINISHED_ERROR
                    seq.stop_reason = message
                touched[state.request_id] = state
        self._awaiting_grammar = waiting

    def _advance_grammar(self, seq: Request) -> None:
        """Feed the step's tokens to the sequence's matcher; a backend failure fails it alone."""
        error = self.structured_outputs.advance(seq)
        if error is None or seq.status is RequestStatus.FINISHED_ERROR:
            return
        seq.stop_reason = error
        if seq.finished:
            # it ended on the end-of-sequence token the failed row was limited to
            seq.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_requests([seq.request_id], RequestStatus.FINISHED_ERROR)

    def _forget_constraint(self, state: RequestState) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs.remove_sequences(seq.request_id for seq in state.sequences)
            self._awaiting_grammar = [item for item in self._awaiting_grammar if item[0] is not state]

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        if self._awaiting_grammar:
            self._admit_compiled_requests(touched)
        scheduler_output = self.scheduler.schedule()
        if self.structured_outputs is not None:
            scheduler_output.structured_output = self.structured_outputs.grammar_bitmask(
                scheduler_output, self.scheduler.get_request)
        if scheduler_output.is_empty and not scheduler_output.finished_req_ids:
            runner_output = ModelRunnerOutput()  # the scheduler may still have finished requests
        else:
            runner_output = self.executor.execute(scheduler_output)
        changed = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.monotonic()
        for seq in changed:
            state = self._sequence_owner.get(seq.request_id)
            if state is None:
                continue
            try:
                if self.structured_outputs is not None:
                    self._advance_grammar(seq)
                self._process_sequence(state, seq, runner_output, now)
            except Exception as exc:  # one request's failure never stops the others
                logger.exception("request %s failed while processing its output", state.request_id)
                seq.stop_reason = f"{type(exc).__name__}: {exc}"
                self.scheduler.finish_requests([seq.request_id], RequestStatus.FINISHED_ERROR)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.pooling_params is not None:
                output = self._make_pooling_output(state, runner_output)
            else:
                output = self._make_output(state)
            if output is not None:
                outputs.append(output)
            if state.finished:
                self.requests.pop(state.request_id, None)
                for seq in state.sequences:
                    self._sequence_owner.pop(seq.request_id, None)
                self._forget_constraint(state)
        return outputs

    def _process_sequence(self, state: RequestState, seq: Request, runner_output, now: float) -> None:
        index = seq.index
        if seq.request_id in runner_output.errors:
            seq.stop_reason = runner_output.errors[seq.request_id]
        new_token_ids = seq.output_token_ids[state.num_processed_tokens[index]:]
        state.num_processed_tokens[index] = len(seq.output_token_ids)
        self.generation_tokens_total += len(new_token_ids)
        if new_token_ids and state.first_token_time is None:
            state.first_token_time = now
        if state.sampling_params.prompt_logprobs is not None and state.prompt_logprobs is None and new_token_ids:
            # the prompt is computed: the scheduler kept the entries of each of its chunks (a
            # chunk that samples nothing is not reported here); the first position has none
            state.prompt_logprobs = [None] + [self._logprob_dict(entry) for entry in seq.prompt_logprobs or []]
        if state.logprobs[index] is not None:
            for entry in runner_output.logprobs.get(seq.request_id, []):
                state.logprobs[index].append(self._logprob_dict(entry))
                seq.cumulative_logprob += entry.logprobs[0]
        detokenizer = state.detokenizers[index]
        if detokenizer is None:
            return
        if (new_token_ids and seq.status is RequestStatus.FINISHED_STOPPED and not isinstance(seq.stop_reason, str)
                and not seq.sampling_params.include_stop_str_in_output):
            # the EOS or stop_token_ids token that ended the output is not part of its text
            # (it would show whenever special tokens are kept, e.g. for tool-call parsers)
            new_token_ids = new_token_ids[:-1]
        if new_token_ids:
            detokenizer.update(new_token_ids)
            if detokenizer.stop_string is not None and not seq.finished:
                seq.stop_reason = detokenizer.stop_string
                self.scheduler.finish_requests([seq.request_id], RequestStatus.FINISHED_STOPPED)
        if seq.finished:
            if detokenizer.stop_string is None:
                detokenizer.flush()
            state.texts[index] = detokenizer.output_text
        else:
            # never show a streaming client text that may turn out to start a stop string
            state.texts[index] = detokenizer.released_text

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for position, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
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
            text = self.tokenizer.decode([token_id])
            self._decoded_tokens[token_id] = text
        return text

    def _make_output(self, state: RequestState) -> RequestOutput | None:
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
                text, token_ids = text[state.sent_text[i]:], token_ids[state.sent_tokens[i]:]
                if logprobs is not None:
                    logprobs = logprobs[state.sent_tokens[i]:]
                if not text and not token_ids and not seq.finished:
                    continue
                state.sent_text[i] = len(state.texts[i])
                state.sent_tokens[i] = len(seq.output_token_ids)
            completions.append(CompletionOutput(
                index=i,
                text=text,
                token_ids=list(token_ids),
                cumulative_logprob=seq.cumulative_logprob if logprobs is not None else None,
                logprobs=list(logprobs) if logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
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

    def _make_pooling_output(self, state: RequestState, runner_output: ModelRunnerOutput) -> PoolingRequestOutput:
        sequence = state.sequences[0]
        error = None
        if sequence.status is RequestStatus.FINISHED_ERROR:
            error = str(sequence.stop_reason or "the request failed in the worker")
        pooled = runner_output.pooled.get(sequence.request_id)
        return PoolingRequestOutput(request_id=state.request_id, outputs=PoolingOutput(data=pooled),
                                    prompt_token_ids=state.prompt_token_ids, finished=state.finished,
                                    prompt=state.prompt, error=error)

    def stats(self) -> EngineStats:
        scheduler_stats = self.scheduler.stats()
        return EngineStats(
            num_running=scheduler_stats.num_running,
            num_waiting=scheduler_stats.num_waiting,
            kv_cache_usage=scheduler_stats.kv_cache_usage,
            prefix_cache_queries=scheduler_stats.prefix_cache_queries,
            prefix_cache_hits=scheduler_stats.prefix_cache_hits,
            num_preemptions=scheduler_stats.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    def shutdown(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()
        self.executor.shutdown()


def choose_platform(name: str, plugins: PluginSet) -> str:
    registry = plugins.registry("platform")
    if name != "auto":
        registry.entry(name)
        return name
    for entry in registry.entries():
        if entry.resolve().is_available():
            return entry.name
    raise EngineDeadError(f"no available device platform among {', '.join(registry.names()) or 'none'}")


# KV-cache memory the idle server maps ahead of use (page faults of a lazily zeroed cache cost
# ~1 ms per MB on the CPU, in the first step that writes there), in chunks of about a
# millisecond, once the engine has been idle a while: one client's requests arrive back to
# back, and each would otherwise wait for the chunk that started as the previous one finished
PREFAULT_MAX_BYTES = 1 << 30
PREFAULT_CHUNK_BYTES = 1 << 20
PREFAULT_AFTER_IDLE_SECONDS = 0.05


class AsyncLLM:
    """The engine for the server: a background thread runs ``LLMEngine.step()`` while there is
    work; each request gets an asyncio queue of its outputs.

    While it has no work, the thread maps up to ``PREFAULT_MAX_BYTES`` of never-used KV-cache
    memory ahead of the requests that will need it.

    :meth:`from_engine_args` builds the engine on that same thread. torch keeps one OpenMP
    worker pool per thread that runs parallel ops; with a second pool (the one weight loading
    made on the caller's thread) the process has more OpenMP threads than a 2-core machine has
    cores, libgomp stops its workers spinning between ops, and every decode step runs about
    twice as long.
    """

    def __init__(self, engine: LLMEngine | None):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.errored = False
        self._dead_reason: str | None = None
        self._stats = engine.stats() if engine is not None else None
        self._prefault_budget = PREFAULT_MAX_BYTES
        self._last_step_time = 0.0

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, plugins: PluginSet | None = None) -> "AsyncLLM":
        """Builds the engine on its own thread (see the class docstring) and returns once it
        is built; a build error is raised here."""
        async_llm = cls(None)
        async_llm._start_thread(lambda: LLMEngine.from_engine_args(engine_args, plugins))
        return async_llm

    # what the server reads
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def served_model_names(self) -> list[str]:
        return list(self.engine.config.model.served_model_name or [self.engine.config.model.model])

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def runner(self) -> str:
        return self.engine.runner

    @property
    def hf_config(self) -> Any:
        return self.engine.model_info.hf_config

    @property
    def max_logprobs(self) -> int:
        return self.engine.config.model.max_logprobs

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.errored

    def stats(self) -> EngineStats:
        return self._stats

    async def start(self) -> None:
        """Bind outputs to the running event loop; start the engine thread if not yet running."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._start_thread(None)

    def _start_thread(self, build_engine) -> None:
        built: concurrent.futures.Future = concurrent.futures.Future()

        def main() -> None:
            try:
                if build_engine is not None:
                    self.engine = build_engine()
                    self._stats = self.engine.stats()
            except BaseException as exc:
                built.set_exception(exc)
                return
            built.set_result(None)
            self._run()

        self._thread = threading.Thread(target=main, name="tokenloom-engine", daemon=True)
        self._thread.start()
        try:
            built.result()
        except BaseException:
            self._thread = None
            raise

    async def generate(self, prompt: Any, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        await self._admit(request_id)
        prepared = self.engine.prepare_prompt(prompt, sampling_params)
        grammar = self.engine.submit_structured_output(sampling_params)
        if grammar is not None:
            # compiled off both loops; a bad constraint fails here, before anything is scheduled
            await asyncio.wrap_future(grammar)
        command = ("add", request_id, sampling_params, priority, prepared, time.monotonic())
        async with contextlib.aclosing(self._outputs(command)) as outputs:
            async for item in outputs:
                yield item

    async def encode(self, prompt: Any, pooling_params: PoolingParams | None, request_id: str, *,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """The pooled output of one prompt (a single, final item); bad input raises here,
        before anything is queued."""
        await self._admit(request_id)
        pooling_params = pooling_params or PoolingParams()
        prepared = self.engine.prepare_pooling_prompt(prompt, pooling_params)
        command = ("add_pooling", request_id, pooling_params, priority, prepared, time.monotonic())
        async with contextlib.aclosing(self._outputs(command)) as outputs:
            async for item in outputs:
                yield item

    async def _admit(self, request_id: str) -> None:
        """Raise unless a new request with this id can be taken; start the engine thread if needed."""
        if self.errored:
            raise EngineDeadError(f"the engine is dead: {self._dead_reason}")
        if self._loop is None or self._thread is None:
            await self.start()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")

    async def _outputs(self, command: tuple) -> AsyncIterator[Any]:
        """Queue ``command`` (an add) and yield the request's outputs until the finished one;
        closing this early aborts the request."""
        request_id = command[1]
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(command)
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))
                self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)
        self.engine.shutdown()

    # -- the engine thread ----------------------------------------------------------------

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, params, priority, prepared, arrival = command
                if request_id not in self._streams:
                    continue  # the client went away before the engine saw the request
                try:
                    self.engine.add_request(request_id, None, params, priority=priority,
                                            arrival_time=arrival, prepared=prepared)
                except Exception as exc:
                    self._deliver([(request_id, exc)])
            elif command[0] == "add_pooling":
                _, request_id, params, priority, prepared, arrival = command
                if request_id not in self._streams:
                    continue
                try:
                    self.engine.add_pooling_request(request_id, None, params, priority=priority,
                                                    arrival_time=arrival, prepared=prepared)
                except Exception as exc:
                    self._deliver([(request_id, exc)])
            elif command[0] == "abort":
                self.engine.abort_request(command[1])

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._stats = self.engine.stats()
                    if self._prefault_idle():
                        continue
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._last_step_time = time.monotonic()
                self._stats = self.engine.stats()
                if outputs:
                    self._deliver([(output.request_id, output) for output in outputs])
        except BaseException as exc:  # the engine is dead: every stream learns why
            logger.exception("the engine loop died")
            self.errored = True
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            error = EngineDeadError(f"the engine died: {self._dead_reason}")
            self._deliver([(request_id, error) for request_id in list(self._streams)])

    def _prefault_idle(self) -> bool:
        """Once idle for ``PREFAULT_AFTER_IDLE_SECONDS``, map the next slice of never-used
        KV-cache memory (see ``Executor.prefault_kv_cache``), a chunk at a time so a new request
        waits at most one chunk; True when a chunk was mapped or the idle wait is not over."""
        if self._prefault_budget <= 0 or not self._commands.empty():
            return False
        idle_for = time.monotonic() - self._last_step_time
        if idle_for < PREFAULT_AFTER_IDLE_SECONDS:
            self._wakeup.wait(timeout=PREFAULT_AFTER_IDLE_SECONDS - idle_for)
            self._wakeup.clear()
            return True
        mapped = self.engine.executor.prefault_kv_cache(min(PREFAULT_CHUNK_BYTES, self._prefault_budget))
        self._prefault_budget = self._prefault_budget - mapped if mapped else 0
        return mapped > 0

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        def put_all() -> None:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put_nowait(item)

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(put_all)
