"""The engine for the server: :class:`AsyncLLM` runs :class:`LLMEngine` steps on a background
thread while there is work, takes typed commands (:mod:`tokenloom.core.engine.commands`) from
the event loop, and gives every request its own async output stream, aborting the request
when its stream is closed early (the request path it shares with the data-parallel front end:
:class:`~tokenloom.core.engine.request_streams.RequestStreams`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from tokenloom.core.config import EngineArgs, LoRAConfig
from tokenloom.core.engine.commands import (
    AbortRequest,
    AddPoolingRequest,
    AddRequest,
    EngineCommand,
    ResetPrefixCache,
)
from tokenloom.core.engine.engine_stats import EngineStats
from tokenloom.core.engine.llm_engine import LLMEngine
from tokenloom.core.engine.request_streams import RequestStreams, StreamItem
from tokenloom.core.logits_processors import LogitsProcessorResolver
from tokenloom.core.sampling_params import PoolingParams, SamplingParams
from tokenloom.core.structured_output_compile import REQUEST_CLIENT
from tokenloom.errors import ConfigError, EngineDeadError
from tokenloom.plugins.manager import PluginSet

logger = logging.getLogger(__name__)

# KV-cache memory the idle server maps ahead of use (up to the runner's lead), a chunk of about
# a millisecond (at least one block) at a time, once the engine has been idle a while: a lazily
# zeroed cache otherwise pays its page faults in the first step that writes there (figures:
# docs/design.md, "KV cache sizing on the CPU")
PREFAULT_CHUNK_BYTES = 1 << 20
PREFAULT_AFTER_IDLE_SECONDS = 0.05
# how often the engine thread asks the executor whether its workers live (idle or busy)
HEALTH_CHECK_INTERVAL_SECONDS = 1.0


class AsyncLLM(RequestStreams):
    """The engine for the server: a background thread runs ``LLMEngine.step()`` while there is
    work; each request gets an asyncio queue of its outputs.

    While it has no work, the thread maps never-used KV-cache memory ahead of the requests that
    will need it (up to ``KV_PREFAULT_LEAD_BYTES`` ahead of the blocks used so far, topped up
    after each busy spell).

    :meth:`from_engine_args` builds the engine on that same thread: torch keeps one OpenMP
    worker pool per thread that runs parallel ops, and a second pool (the one weight loading
    made on the caller's thread) oversubscribes a small machine's cores, which makes every
    decode step slower (figures: docs/design.md, "AsyncLLM").
    """

    def __init__(self, engine: LLMEngine | None):
        super().__init__()
        self._engine = engine
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats() if engine is not None else None
        self._prefault_pending = True  # more may be mapped: set by each step, cleared when none is
        self._last_step_time = 0.0
        self._last_health_check = 0.0
        self._logits_processor_resolver: LogitsProcessorResolver | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, plugins: PluginSet | None = None) -> AsyncLLM:
        """Builds the engine on its own thread (see the class docstring) and returns once it
        is built; a build error is raised here. One engine: the server builds its engine with
        :func:`~tokenloom.core.engine.protocol.build_engine_client`, which takes data-parallel
        replicas for ``data_parallel_size > 1``."""
        if engine_args.data_parallel_size != 1:
            raise ConfigError(
                f"AsyncLLM runs one engine, not {engine_args.data_parallel_size} data-parallel replicas: "
                "build the engine with tokenloom.core.engine.build_engine_client",
                param="data-parallel-size",
            )
        async_llm = cls(None)
        async_llm._start_thread(lambda: LLMEngine.from_engine_args(engine_args, plugins))
        return async_llm

    @property
    def engine(self) -> LLMEngine:
        """The engine this front drives (built: every public method needs it)."""
        if self._engine is None:
            raise EngineDeadError("the engine is not built")
        return self._engine

    @engine.setter
    def engine(self, engine: LLMEngine) -> None:
        self._engine = engine

    # what the server reads
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def served_model_names(self) -> list[str]:
        config = self.engine.config.model
        return list(config.served_model_name or [config.model])

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def runner_type(self) -> str:
        """``generate`` or ``pooling``: which kind of request the engine serves."""
        return self.engine.runner_type

    @property
    def hf_config(self) -> Any:
        return self.engine.model_info.hf_config

    @property
    def max_logprobs(self) -> int:
        """``--max-logprobs``, with -1 (no cap) resolved to the vocabulary size."""
        return self.engine.max_logprobs

    @property
    def vocab_size(self) -> int:
        return self.engine.model_info.vocab_size

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The request defaults in force (``--generation-config``), under SamplingParams' names."""
        return dict(self.engine.model_info.generation_defaults)

    @property
    def max_num_seqs(self) -> int:
        return self.engine.config.scheduler.max_num_seqs

    @property
    def eos_token_ids(self) -> set[int]:
        """The tokens that end a generation (beam search finishes a beam on them)."""
        return set(self.engine.model_info.eos_token_ids)

    @property
    def scheduling_policy(self) -> str:
        return self.engine.config.scheduler.scheduling_policy

    @property
    def lora_config(self) -> LoRAConfig:
        return self.engine.config.lora

    @property
    def logits_processor_resolver(self) -> LogitsProcessorResolver:
        """Checks a request's ``logits_processors`` against the registered processors and
        ``--logits-processor-pattern``."""
        if self._logits_processor_resolver is None:
            engine = self.engine
            self._logits_processor_resolver = LogitsProcessorResolver(
                engine.plugins.registry("logits_processor"), engine.config.model.logits_processor_pattern
            )
        return self._logits_processor_resolver

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.errored

    def stats(self) -> EngineStats:
        return self._stats if self._stats is not None else self.engine.stats()

    async def start(self) -> None:
        """Bind outputs to the running event loop; start the engine thread if not yet running."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._start_thread(None)

    def _start_thread(self, build_engine: Callable[[], LLMEngine] | None) -> None:
        built: concurrent.futures.Future[None] = concurrent.futures.Future()

        def main() -> None:
            try:
                if build_engine is not None:
                    self._engine = build_engine()
                    self._stats = self._engine.stats()
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

    def resolve_lora(self, lora_request: Any) -> Any:
        """The adapter checked against the model, its path local (see LLMEngine.resolve_lora);
        thread-safe, it reads the adapter's files the first time."""
        return self.engine.resolve_lora(lora_request)

    async def add_lora(self, lora_request: Any) -> bool:
        """Check an adapter (reading its files off the event loop) so requests can name it."""
        await asyncio.to_thread(self.resolve_lora, lora_request)
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    async def _prepare_generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, priority: int, lora_request: Any
    ) -> Any:
        if lora_request is not None:
            lora_request = await asyncio.to_thread(self.resolve_lora, lora_request)
        prepared = self.engine.prepare_prompt(prompt, sampling_params)
        client = REQUEST_CLIENT.get()
        checking = self.engine.check_structured_output(sampling_params, client)
        grammar = None
        if checking is not None:
            # checked and compiled off both loops, in time-bounded jobs; a bad constraint fails
            # here, before anything is scheduled
            backend_name, constraint = await asyncio.wrap_future(checking)
            compiling = self.engine.compile_structured_output(backend_name, constraint, client)
            # shielded: other requests may wait on the same (cached) compile
            grammar = await asyncio.shield(asyncio.wrap_future(compiling))
        return AddRequest(request_id, sampling_params, prepared, priority, time.monotonic(), lora_request, grammar)

    def _prepare_encode(self, prompt: Any, pooling_params: PoolingParams, request_id: str, priority: int) -> Any:
        prepared = self.engine.prepare_pooling_prompt(prompt, pooling_params)
        return AddPoolingRequest(request_id, pooling_params, prepared, priority, time.monotonic())

    def _dispatch(self, request_id: str, request: Any) -> None:
        self._send(request)

    def _release(self, request_id: str, finished: bool) -> None:
        if not finished:
            self._send(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block, on the engine thread between steps."""
        if self.errored:
            raise EngineDeadError(f"the engine died: {self._dead_reason}")
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._send(ResetPrefixCache(done))
        await asyncio.wrap_future(done)

    def _send(self, command: EngineCommand) -> None:
        self._commands.put(command)
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
            self._apply(command)

    def _apply(self, command: EngineCommand) -> None:
        """Apply one command on the engine thread; an add that fails is the request's error."""
        engine = self.engine
        if isinstance(command, AbortRequest):
            engine.abort_request(command.request_id)
            return
        if isinstance(command, ResetPrefixCache):
            try:
                engine.reset_prefix_cache()
            except Exception as exc:
                command.done.set_exception(exc)
            else:
                command.done.set_result(None)
            return
        if command.request_id not in self._streams:
            return  # the client went away before the engine saw the request
        try:
            if isinstance(command, AddRequest):
                # the adapter only when there is one: engines without LoRA keep their signature
                lora = {} if command.lora_request is None else {"lora_request": command.lora_request}
                grammar = {} if command.grammar is None else {"grammar": command.grammar}
                engine.add_request(
                    command.request_id,
                    None,
                    command.sampling_params,
                    priority=command.priority,
                    arrival_time=command.arrival_time,
                    prepared=command.prepared,
                    **lora,
                    **grammar,
                )
            else:
                engine.add_pooling_request(
                    command.request_id,
                    None,
                    command.pooling_params,
                    priority=command.priority,
                    arrival_time=command.arrival_time,
                    prepared=command.prepared,
                )
        except Exception as exc:
            self._deliver([(command.request_id, exc)])

    def _run(self) -> None:
        try:
            engine = self.engine
            while not self._stopping:
                self._check_health_when_due()
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self._stats = engine.stats()
                    if self._prefault_idle():
                        continue
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                self._last_step_time = time.monotonic()
                self._prefault_pending = True
                self._stats = engine.stats()
                if outputs:
                    self._deliver([(output.request_id, output) for output in outputs])
        except BaseException as exc:  # the engine is dead: every stream learns why
            logger.exception("the engine loop died")
            self.errored = True
            self._dead_reason = f"{type(exc).__name__}: {exc}"
            error = EngineDeadError(f"the engine died: {self._dead_reason}")
            self._deliver([(request_id, error) for request_id in list(self._streams)])

    def _check_health_when_due(self) -> None:
        """A worker that died between steps (or while idle) kills the engine now, not at the
        next request: streams end, /health answers 503."""
        now = time.monotonic()
        if now - self._last_health_check >= HEALTH_CHECK_INTERVAL_SECONDS:
            self._last_health_check = now
            self.engine.check_health()

    def _prefault_idle(self) -> bool:
        """Once idle for ``PREFAULT_AFTER_IDLE_SECONDS``, map the next slice of never-used
        KV-cache memory (see ``Executor.prefault_kv_cache``), a chunk at a time so a new request
        waits at most one chunk; True when a chunk was mapped or the idle wait is not over."""
        if not self._prefault_pending or not self._commands.empty():
            return False
        idle_for = time.monotonic() - self._last_step_time
        if idle_for < PREFAULT_AFTER_IDLE_SECONDS:
            self._wakeup.wait(timeout=PREFAULT_AFTER_IDLE_SECONDS - idle_for)
            self._wakeup.clear()
            return True
        mapped = self.engine.executor.prefault_kv_cache(PREFAULT_CHUNK_BYTES)
        self._prefault_pending = mapped > 0
        return mapped > 0

    def _deliver(self, items: list[tuple[str, StreamItem]]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put_outputs, items)
