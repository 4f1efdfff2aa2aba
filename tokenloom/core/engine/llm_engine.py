"""The step loop: :class:`LLMEngine`, one ``step()`` = schedule -> execute -> apply tokens
(grammars, detokenization, stops) -> outputs. Prompts are prepared by the
:class:`~tokenloom.core.engine.input_processor.InputProcessor`, outputs made by the
:class:`~tokenloom.core.engine.output_processor.OutputProcessor`; this module admits requests
(all of a request's sequences or none), runs steps and aborts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput
from tokenloom.core.config import EngineArgs, EngineConfig
from tokenloom.core.engine.engine_setup import (
    check_proposer,
    check_proposer_model,
    choose_executor,
    choose_platform,
    profile_multimodal_items,
)
from tokenloom.core.engine.engine_stats import EngineStats
from tokenloom.core.engine.grammar_gate import GrammarGate
from tokenloom.core.engine.input_processor import InputProcessor, ModelLimits, PreparedPrompt
from tokenloom.core.engine.output_processor import OutputProcessor, RequestState
from tokenloom.core.executor import Executor, WorkerSpec
from tokenloom.core.kv_connector import build_kv_connector, check_kv_transfer
from tokenloom.core.kv_events import build_event_publisher
from tokenloom.core.model_loader import ModelInfo, resolve_model, resolve_source
from tokenloom.core.outputs import PoolingRequestOutput, RequestOutput
from tokenloom.core.platform import check_attention_backend
from tokenloom.core.pooling import POOLING
from tokenloom.core.sampling_params import PoolingParams, SamplingParams
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.sequence import EngineSequence, SequenceStatus
from tokenloom.core.structured_output import CompiledConstraint, StructuredOutputManager
from tokenloom.core.structured_output_constraints import Constraint
from tokenloom.errors import InvalidRequestError
from tokenloom.plugins.manager import PluginSet, load_plugins

logger = logging.getLogger(__name__)


class LLMEngine:
    """The synchronous engine. Not thread-safe: one thread calls it."""

    def __init__(self, config: EngineConfig, plugins: PluginSet):
        started = time.perf_counter()
        self.config = config
        self.plugins = plugins
        self.platform = choose_platform(config.device.device, plugins)
        check_attention_backend(config.device.attention_backend, plugins.registry("attention_backend"))
        check_proposer(config, plugins)
        self.model_info: ModelInfo
        self.model_info, self.tokenizer = resolve_model(config, plugins)
        num_lookahead_tokens = check_proposer_model(config, plugins, self.model_info, self.tokenizer)
        check_kv_transfer(config, plugins)
        # the scheduler side of --kv-transfer-config's connector (its options checked before the
        # workers start), or None
        kv_connector = build_kv_connector(config, self.model_info, plugins) if config.kv_transfer else None
        self.max_model_len = self.model_info.max_model_len
        # vLLM's -1: no cap, i.e. as many as the vocabulary has
        self.max_logprobs = (
            config.model.max_logprobs if config.model.max_logprobs >= 0 else max(1, self.model_info.vocab_size)
        )
        executor_name = choose_executor(config.parallel)
        executor_class: type[Executor] = plugins.registry("executor").get(executor_name)
        self.executor = executor_class(
            WorkerSpec(
                config=config,
                model_info=self.model_info,
                platform=self.platform,
                plugin_tables=plugins.to_plain(),
                profile_mm_items=profile_multimodal_items(plugins, self.platform, self.model_info, self.tokenizer),
            )
        )
        self.num_blocks = self.executor.initialize()
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.num_blocks,
            self.max_model_len,
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            speculative=config.speculative,
            send_token_ids=config.parallel.pipeline_parallel_size > 1,
            num_lookahead_tokens=num_lookahead_tokens,
            enable_kv_cache_events=config.kv_events.publishes,
            kv_connector=kv_connector,
        )
        if kv_connector is not None:
            assert config.kv_transfer is not None  # the connector was built from it
            logger.info(
                "KV connector %s (%s): %s",
                config.kv_transfer.kv_connector,
                config.kv_transfer.kv_role,
                kv_connector.describe(),
            )
        # sends what the prefix cache stored, evicted and cleared (--kv-events-config), or None
        self.kv_event_publisher = build_event_publisher(config.kv_events, config.parallel.data_parallel_rank)
        if self.kv_event_publisher is not None and not config.cache.enable_prefix_caching:
            logger.warning("KV-cache events are on but prefix caching is off: no block is ever cached or evicted")
        # batches handed to the executor whose results are not applied yet, oldest first
        # (more than one only when the executor overlaps steps: pipeline parallelism)
        self._batch_queue: deque[tuple[SchedulerOutput, concurrent.futures.Future[ModelRunnerOutput]]] = deque()
        self.lora_catalog = self._lora_catalog()
        self.grammars = GrammarGate(self._structured_output_manager(), self.scheduler)
        self.input_processor = InputProcessor(
            self.tokenizer,
            ModelLimits(
                max_model_len=self.max_model_len,
                vocab_size=self.model_info.vocab_size,
                block_size=config.cache.block_size,
                num_blocks=self.num_blocks,
                max_logprobs=self.max_logprobs,
                eos_token_ids=tuple(self.model_info.eos_token_ids),
            ),
            hf_config=self.model_info.hf_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.prompt_tokens_total = 0
        self.mm_cache_queries = self.mm_cache_hits = 0
        logger.info(
            "engine ready in %.2fs: %s, %d KV blocks of %d tokens, max_model_len %d",
            time.perf_counter() - started,
            self.model_info.architecture,
            self.num_blocks,
            config.cache.block_size,
            self.max_model_len,
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, plugins: PluginSet | None = None) -> LLMEngine:
        return cls(engine_args.create_engine_config(), plugins or load_plugins())

    @property
    def model_name(self) -> str:
        names = self.config.model.served_model_name
        return names[0] if names else self.config.model.model

    @property
    def runner_type(self) -> str:
        """``generate`` or ``pooling``: which kind of request this engine serves."""
        return self.model_info.runner

    @property
    def requests(self) -> dict[str, RequestState]:
        """The admitted, unfinished requests by id."""
        return self.output_processor.requests

    # -- LoRA adapters ------------------------------------------------------------------

    def _lora_catalog(self) -> Any:
        if not self.config.lora.enable_lora:
            return None
        from tokenloom.lora.catalog import LoRACatalog

        def resolve_path(tag: str, allow_hub: bool) -> str:
            # a request that may not name a Hub repo never reaches the source that downloads one
            skip = () if allow_hub else ("huggingface",)
            return resolve_source(tag, self.plugins, self.config.model, self.config.load.download_dir, skip).path

        import torch

        dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
        return LoRACatalog(
            max_lora_rank=self.config.lora.max_lora_rank,
            hf_config=self.model_info.hf_config,
            resolve_path=resolve_path,
            model_name=self.model_name,
            dtype=dtypes.get(self.config.lora.lora_dtype),
        )

    def resolve_lora(self, lora_request: Any) -> Any:
        """The adapter checked against this model and its path made local (a LoRARequest); a
        bad one raises InvalidRequestError naming what does not fit. None passes through."""
        if lora_request is None:
            return None
        if self.lora_catalog is None:
            raise InvalidRequestError(
                f"LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r} was asked for, but this "
                "engine serves no adapters: start it with --enable-lora (LLM(..., enable_lora=True))",
                param="lora_request",
            )
        if self.runner_type == POOLING:
            raise InvalidRequestError("LoRA adapters are served for generation only", param="lora_request")
        return self.lora_catalog.resolve(lora_request)

    def add_lora(self, lora_request: Any) -> bool:
        """Check an adapter now (vLLM's ``add_lora``), so requests naming it are not the first
        to find out it does not fit; the worker reads it when a request first runs with it."""
        self.resolve_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests already admitted with it run to completion. The worker's
        copy leaves its caches as the least recently used."""
        if self.lora_catalog is None or self.lora_catalog.name_of(lora_int_id) is None:
            return False
        self.lora_catalog.forget(lora_int_id)
        return True

    # -- requests ---------------------------------------------------------------------

    def prepare_prompt(self, prompt: Any, params: SamplingParams) -> PreparedPrompt:
        """Tokenize and validate a prompt: text, token ids, or vLLM's dict forms."""
        return self.input_processor.prepare_prompt(prompt, params)

    def prepare_pooling_prompt(self, prompt: Any, params: PoolingParams) -> PreparedPrompt:
        """Tokenize, truncate and validate a pooling prompt and its params."""
        if self.runner_type != POOLING:
            raise InvalidRequestError(
                f"{self.model_name} is served for generation: it does not pool (start it with "
                "--runner pooling or --convert embed for embeddings)",
                param="model",
            )
        return self.input_processor.prepare_pooling_prompt(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        prepared: PreparedPrompt | None = None,
        lora_request: Any = None,
        grammar: CompiledConstraint | None = None,
    ) -> None:
        """Admit a generate request: all of its ``n`` sequences, or (raising) none of them.
        ``lora_request`` (a :class:`~tokenloom.lora.request.LoRARequest`) runs it with an adapter;
        ``grammar`` is its constraint, compiled already (the server's path: the engine thread
        then never checks a schema itself)."""
        self._check_id_free(request_id)
        if self.runner_type == POOLING:
            raise InvalidRequestError(
                f"{self.model_name} is served as a pooling model (embeddings, scores): it does not generate text",
                param="model",
            )
        lora_request = self.resolve_lora(lora_request)
        prepared = prepared or self.input_processor.prepare_prompt(prompt, params)
        params = self.input_processor.with_bad_words(params)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        sequences = self.input_processor.build_sequences(
            request_id, prepared, params, priority=priority, arrival_time=arrival_time
        )
        for seq in sequences:
            self._check_id_free(seq.seq_id)
            seq.lora_request = lora_request
        state = self.output_processor.new_request_state(request_id, prepared, params, sequences, arrival_time)
        self.grammars.admit(state, params, grammar)
        self.output_processor.add(state)
        self.prompt_tokens_total += len(prepared.prompt_token_ids)

    def add_pooling_request(
        self,
        request_id: str,
        prompt: Any,
        params: PoolingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        prepared: PreparedPrompt | None = None,
    ) -> None:
        """Queue a prefill-only request whose output is its pooled hidden states."""
        self._check_id_free(request_id)
        params = params or PoolingParams()
        prepared = prepared or self.prepare_pooling_prompt(prompt, params)
        sequence = self.input_processor.build_pooling_sequence(
            request_id, prepared, params, priority=priority, arrival_time=arrival_time
        )
        state = self.output_processor.new_pooling_state(request_id, prepared, params, sequence)
        self.scheduler.add_sequences([sequence])
        self.output_processor.add(state)
        self.prompt_tokens_total += len(prepared.prompt_token_ids)

    def _check_id_free(self, request_id: str) -> None:
        if self.output_processor.id_in_use(request_id) or self.scheduler.get_sequence(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            state = self.output_processor.pop(request_id)
            if state is None:
                continue
            self.scheduler.finish_sequences(state.seq_ids, SequenceStatus.FINISHED_ABORTED)
            self.grammars.forget(state)
        self._publish_kv_events()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (vLLM's ``/reset_prefix_cache``)."""
        self.scheduler.reset_prefix_cache()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """Hand what the prefix cache recorded since the last call to the publisher, as one batch."""
        if self.kv_event_publisher is not None:
            events = self.scheduler.block_manager.take_kv_events()
            if events:
                self.kv_event_publisher.publish(events)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_sequences() or bool(self.grammars.awaiting) or bool(self._batch_queue)

    # -- structured outputs -----------------------------------------------------------

    def _structured_output_manager(self) -> StructuredOutputManager | None:
        if self.tokenizer is None:
            return None
        reasoning_parser = self.config.structured_output.reasoning_parser
        return StructuredOutputManager(
            self.config.structured_output,
            self.plugins.registry("structured_output_backend"),
            self.tokenizer,
            self.model_info.vocab_size,
            self.model_info.eos_token_ids,
            self.plugins.registry("reasoning_parser").get(reasoning_parser) if reasoning_parser else None,
        )

    @property
    def structured_outputs(self) -> StructuredOutputManager | None:
        """The guided-decoding manager (None without a tokenizer)."""
        return self.grammars.manager

    def submit_structured_output(self, params: SamplingParams) -> concurrent.futures.Future[CompiledConstraint] | None:
        """Check the request's constraint and start compiling it (or find it in the cache): a
        Future of the compiled constraint, None when unconstrained. Raises InvalidRequestError
        for a constraint no backend can take; compile errors come out of the Future."""
        return self.grammars.submit(params)

    def check_structured_output(
        self, params: SamplingParams, client: str | None = None
    ) -> concurrent.futures.Future[tuple[str, Constraint]] | None:
        """The server's first half of :meth:`submit_structured_output`: the request's constraint
        checked and its backend chosen in the compile pool, as ``client``'s job, bounded in time
        (a Future of ``(backend name, constraint)``); None when unconstrained. Thread-safe."""
        return self.grammars.check(params, client)

    def compile_structured_output(
        self, backend_name: str, constraint: Constraint, client: str | None = None
    ) -> concurrent.futures.Future[CompiledConstraint]:
        """The second half: the checked constraint compiled (or found in the cache). Thread-safe."""
        return self.grammars.compile(backend_name, constraint, client)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        touched: dict[str, RequestState] = {}
        if self.grammars.awaiting:
            self.grammars.admit_compiled(touched)
        if self.executor.max_concurrent_batches > 1:
            return self._step_with_batch_queue(touched)
        scheduler_output = self._schedule()
        if not scheduler_output.needs_worker:
            runner_output = ModelRunnerOutput()  # the scheduler may still have finished requests
        else:
            try:
                runner_output = self.executor.execute(scheduler_output)
            except Exception:
                self.executor.check_health()  # a dead worker is the cause to report, when it is one
                raise
        return self._apply(scheduler_output, runner_output, touched)

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        self.grammars.fill_bitmask(scheduler_output)
        return scheduler_output

    def _step_with_batch_queue(self, touched: dict[str, RequestState]) -> list[RequestOutput | PoolingRequestOutput]:
        """One step with up to ``executor.max_concurrent_batches`` batches in flight (vLLM V1's
        batch queue): while the queue has room, schedule a batch from the requests with none
        in flight and hand it to the executor; return at once if the oldest batch is still
        running and there is room for another. Otherwise wait for the oldest batch (the queue
        is full, or nothing more could be scheduled) and apply its result."""
        queue = self._batch_queue
        max_batches = self.executor.max_concurrent_batches
        outputs: list[RequestOutput | PoolingRequestOutput] = []
        if len(queue) < max_batches:
            scheduler_output = self._schedule()
            if not scheduler_output.needs_worker:
                # nothing new could run; requests the scheduler finished itself come out here
                outputs = self._apply(scheduler_output, ModelRunnerOutput(), touched)
                touched = {}
            else:
                queue.append((scheduler_output, self.executor.execute_async(scheduler_output)))
                if len(queue) < max_batches and not queue[0][1].done():
                    return self._apply(None, None, touched)
        if not queue:
            return outputs
        scheduler_output, future = queue.popleft()
        try:
            runner_output = future.result()
        except Exception:
            self.executor.check_health()  # a dead worker is the cause to report, when it is one
            raise
        return outputs + self._apply(scheduler_output, runner_output, touched)

    def _apply(
        self,
        scheduler_output: SchedulerOutput | None,
        runner_output: ModelRunnerOutput | None,
        touched: dict[str, RequestState],
    ) -> list[RequestOutput | PoolingRequestOutput]:
        """Apply one batch's result (None: none, only ``touched``): the scheduler's tokens and
        stops, grammars, detokenization and stop strings; returns the outputs of every request
        touched."""
        changed: list[EngineSequence] = []
        if scheduler_output is not None and runner_output is not None:
            self.mm_cache_queries += runner_output.mm_cache_queries
            self.mm_cache_hits += runner_output.mm_cache_hits
            changed = self.scheduler.update_from_output(scheduler_output, runner_output)
        else:
            runner_output = ModelRunnerOutput()
        now = time.monotonic()
        for seq in changed:
            state = self.output_processor.owner(seq.seq_id)
            if state is None:
                continue
            try:
                self.grammars.advance(seq)
                if self.output_processor.process_sequence(state, seq, runner_output, now) is not None:
                    # a stop string ended it: the scheduler frees it, then its text is final
                    self.scheduler.finish_sequences([seq.seq_id], SequenceStatus.FINISHED_STOPPED)
                    self.output_processor.update_text(state, seq)
            except Exception as exc:  # one request's failure never stops the others
                logger.exception("request %s failed while processing its output", state.request_id)
                seq.stop_reason = f"{type(exc).__name__}: {exc}"
                self.scheduler.finish_sequences([seq.seq_id], SequenceStatus.FINISHED_ERROR)
            touched[state.request_id] = state
        outputs: list[RequestOutput | PoolingRequestOutput] = []
        for state in touched.values():
            output: RequestOutput | PoolingRequestOutput | None
            if state.pooling_params is not None:
                output = self.output_processor.make_pooling_output(state, runner_output)
            else:
                output = self.output_processor.make_output(state)
            if output is not None:
                outputs.append(output)
            if state.finished:
                self.output_processor.pop(state.request_id)
                self.grammars.forget(state)
        self._publish_kv_events()  # one batch per step: what scheduling and finishing cached or evicted
        return outputs

    def check_health(self) -> None:
        """Raise EngineDeadError when a worker has died (the executor's check: no round trip)."""
        self.executor.check_health()

    def decode_token(self, token_id: int) -> str | None:
        return self.output_processor.decode_token(token_id)

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
            generation_tokens_total=self.output_processor.generation_tokens_total,
            **self._lora_stats(),
            spec_decoding=scheduler_stats.spec_decoding,
            mm_cache_queries=self.mm_cache_queries,
            mm_cache_hits=self.mm_cache_hits,
            kv_connector=scheduler_stats.kv_connector,
        )

    def _lora_stats(self) -> dict[str, Any]:
        if self.lora_catalog is None:
            return {}

        def names(lora_ids: set[int]) -> list[str]:
            return sorted(str(self.lora_catalog.name_of(lora_id) or lora_id) for lora_id in lora_ids)

        return {
            "running_lora_adapters": names(self.scheduler.running_lora_ids()),
            "waiting_lora_adapters": names(self.scheduler.waiting_lora_ids()),
            "max_lora": self.config.lora.max_loras,
        }

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
