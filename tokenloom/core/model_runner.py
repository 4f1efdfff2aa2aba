"""The model runner (worker side): keeps each running request's tokens and block table, turns
a :class:`SchedulerOutput` into one flat batch (token ids, positions, slot mapping, block
tables, query/sequence lengths), runs the model and samples.

This module owns the request state, the input preparation and the step itself; what the step
hands off lives beside it: the KV cache (:mod:`~tokenloom.core.model_runner_kv_cache`), the
forward pass across pipeline stages (:mod:`~tokenloom.core.model_runner_stages`), sampling and
the step's output (:mod:`~tokenloom.core.model_runner_outputs`), and speculative decoding
(:mod:`~tokenloom.core.model_runner_spec_decode`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.core.batch import (
    KVCacheScales,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenloom.core.config import EngineConfig
from tokenloom.core.distributed import ParallelState
from tokenloom.core.logits_processors import resolve_engine_processors
from tokenloom.core.model_loader import ModelInfo, build_model
from tokenloom.core.model_runner_kv_cache import KVCacheSetup
from tokenloom.core.model_runner_spec_decode import SpeculativeSteps
from tokenloom.core.multimodal.encoder_cache import MIN_ENCODER_CACHE_TOKENS, EncoderCache, merged_input_embeddings
from tokenloom.core.multimodal.mrope import step_positions
from tokenloom.core.platform import attention_backend_target
from tokenloom.core.sampler import Sampler
from tokenloom.core.sampling_metadata import SamplingState
from tokenloom.core.spec_decode.draft_length import AcceptanceEstimate, DraftLengthPolicy
from tokenloom.core.spec_decode.proposer import Draft, Proposer, ProposerSpec
from tokenloom.core.spec_decode.rejection_sampler import RejectionSampler
from tokenloom.core.step_budget import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tokenloom.core.step_inputs import PreparedBatch, prepare_batch
from tokenloom.errors import ConfigError
from tokenloom.plugins.manager import PluginSet
from tokenloom.plugins.registry import resolve_target

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """What the worker keeps for a request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + generated tokens
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingState
    prompt_logprobs: int | None = None
    bad_words: list[list[int]] = field(default_factory=list)
    pooling_params: Any = None  # set for a pooling request (PoolingParams)
    lora_request: Any = None  # the LoRA adapter it runs with (tokenloom.lora.request.LoRARequest)
    # the proposer's latest draft (its probs are needed when the scheduler verifies it)
    draft: Draft | None = None
    # how often its drafts were accepted: the next draft's length follows it
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # the prompt's images (MultiModalItem), embedded through the encoder cache
    mm_items: list[Any] = field(default_factory=list)


class ModelRunner(KVCacheSetup, SpeculativeSteps):
    """Owns the model, its KV cache and the per-request state; one per worker."""

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        plugins: PluginSet,
        platform: Any,
        parallel: Any = None,
        *,
        profile_mm_items: list[Any] | None = None,
    ):
        self.config = config
        # this worker's place and communicators (tokenloom.core.distributed.ParallelState)
        self.parallel = parallel if parallel is not None else ParallelState.single()
        if self.parallel.place.pp_size > 1 and config.speculative is not None:
            raise ConfigError(
                "speculative decoding does not run with pipeline parallelism yet: drop --speculative-config "
                "or use --pipeline-parallel-size 1",
                param="speculative_config",
            )
        self.info = info
        self.plugins = plugins
        self.platform = platform
        self.device = platform.torch_device()
        self.block_size = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        # per layer, when the cache is fp8: the scales its elements are multiplied by
        self.kv_scales: list[KVCacheScales] | None = None
        self.attention_backend = resolve_target(
            attention_backend_target(config.device.attention_backend, platform, plugins.registry("attention_backend"))
        )()
        self.sampler = Sampler(logprobs_mode=config.model.logprobs_mode, seed=self._sampling_seed(config.model.seed))
        # seeded requests preempted (forgotten here) and not yet resumed: req id -> their
        # generator, so a resumed request draws the random numbers it would have drawn next
        # instead of replaying its first steps' (vLLM keeps its request state the same way)
        self._preempted_generators: dict[str, torch.Generator] = {}
        # --logits-processors: applied to every request (checked here, before the model loads)
        self.engine_logits_processors = resolve_engine_processors(
            config.model.logits_processors, plugins.registry("logits_processor")
        )
        self.rejection_sampler = RejectionSampler(
            logprobs_mode=config.model.logprobs_mode, unseeded_generator=self.sampler.generator
        )
        self.proposer: Proposer | None = None
        self.draft_length_policy: DraftLengthPolicy | None = None
        if config.speculative is not None:
            proposer_class = plugins.registry("proposer").get(config.speculative.method)
            self.proposer = proposer_class(
                ProposerSpec(config.speculative, config, info, plugins=plugins, platform=platform)
            )
            self.draft_length_policy = self._draft_length_policy(config.speculative, platform)
        # the model plugin's nn.Module (see ModelProtocol), built by load_model; Any because
        # models add their own attributes (pooler, kv_cache_spec) that nn.Module's types hide
        self.model: Any = None
        self.dtype: torch.dtype | None = None
        # the LoRA slots and adapter cache (tokenloom.lora.manager.LoRAModelManager) with --enable-lora
        self.lora_manager: Any = None
        # the worst-case media the profile run encodes (WorkerSpec.profile_mm_items)
        self.profile_mm_items: list[Any] = list(profile_mm_items or ())
        # images' embeddings by hash: a repeated image is encoded once
        self.encoder_cache = EncoderCache(
            max(MIN_ENCODER_CACHE_TOKENS, config.scheduler.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS)
        )
        # blocks at or above this id have never been in a block table: nothing was written there
        self._kv_high_water = 0
        # blocks below this id have been mapped by prefault_kv_cache or map_new_blocks (or used)
        self._kv_prefaulted = 0
        self._kv_map_blocks_off = False  # the platform maps nothing (Platform.map_blocks)

    # -- set-up -----------------------------------------------------------------------

    def _sampling_seed(self, seed: int | None) -> int | None:
        """The unseeded rows' seed. Tensor-parallel ranks sample from the same gathered
        logits and each appends its sampled token to its own request state, so they must draw
        the same random numbers: without ``--seed`` they share tp-rank 0's random one."""
        if seed is not None or self.parallel.tp.size == 1:
            return seed
        return int(self.parallel.tp.broadcast_object(int(torch.randint(0, 2**62, ()).item()), src=0))

    def load_model(self) -> None:
        self.model, self.dtype = build_model(
            self.config, self.info, self.plugins, self.platform, runner=self.info.runner, parallel=self.parallel
        )
        if self.parallel.place.pp_size > 1 and getattr(self.model, "stage", None) is None:
            raise ConfigError(
                f"{self.info.architecture} cannot be split into pipeline stages (its model plugin builds "
                "every layer); use --pipeline-parallel-size 1",
                param="pipeline_parallel_size",
            )
        if self.info.runner == "pooling" and getattr(self.model, "pooler", None) is None:
            raise ConfigError(
                f"{self.info.architecture} has no pooler: it cannot run as a pooling model "
                "(--runner pooling, --task embed, --convert embed)",
                param="runner",
            )
        if self.proposer is not None:
            self.proposer.load_model()  # a draft model, before the KV cache is sized for both
        lora = self.config.lora
        if lora.enable_lora:
            from tokenloom.lora.manager import LoRAModelManager

            dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
            self.lora_manager = LoRAModelManager(
                self.model,
                max_loras=lora.max_loras,
                max_lora_rank=lora.max_lora_rank,
                max_cpu_loras=lora.max_cpu_loras or lora.max_loras,
                dtype=dtypes.get(lora.lora_dtype, self.dtype),
            )

    # -- one step ---------------------------------------------------------------------

    def _add_request(self, new: NewRequestData) -> None:
        params = new.sampling_params
        bad_words = (params.extra_args or {}).get("bad_words_token_ids", [])
        sampling = SamplingState(
            params,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            bad_words_token_ids=bad_words,
            eos_token_ids=self.info.eos_token_ids,
            device=self.device,
            engine_logits_processors=self.engine_logits_processors,
        )
        kept_generator = self._preempted_generators.pop(new.req_id, None)
        if kept_generator is not None and new.output_token_ids:
            sampling.generator = kept_generator
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling=sampling,
            prompt_logprobs=params.prompt_logprobs,
            pooling_params=new.pooling_params,
            lora_request=new.lora_request,
            mm_items=list(new.mm_items),
        )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if req_id not in scheduler_output.preempted_req_ids:
                self._preempted_generators.pop(req_id, None)  # finished while it waited
            elif state is not None and state.sampling.generator is not None:
                self._preempted_generators[req_id] = state.sampling.generator
        if self.proposer is not None and scheduler_output.finished_req_ids:
            self.proposer.remove_requests(set(scheduler_output.finished_req_ids))
        for new in scheduler_output.scheduled_new_reqs:
            self._add_request(new)
            if new.block_ids:
                self._kv_high_water = max(self._kv_high_water, max(new.block_ids) + 1)
        stage_samples = self.parallel.place.is_last_stage
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_token_ids and not stage_samples:
                # a stage that never samples learns the sampled tokens from the scheduler
                start = cached.num_computed_tokens
                state.token_ids[start : start + len(cached.new_token_ids)] = cached.new_token_ids
            if cached.new_block_ids:
                self._kv_high_water = max(self._kv_high_water, max(cached.new_block_ids) + 1)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. A pipeline stage before the last sends its hidden states on to the
        next stage and returns None; the last stage samples and returns the step's output.
        The platform hears of every step when it ends (:meth:`Platform.finish_step`)."""
        try:
            return self._execute(scheduler_output)
        finally:
            self.platform.finish_step(scheduler_output.total_num_scheduled_tokens)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_states(scheduler_output)
        self.map_new_blocks()
        place = self.parallel.place
        if not place.is_last_stage:
            self._execute_stage(scheduler_output)
            return None
        output = ModelRunnerOutput()
        if scheduler_output.is_empty:
            return output
        req_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.requests[req_id] for req_id in req_ids]
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        batch = self._prepare_inputs(states, scheduler_output.num_scheduled_tokens, spec_tokens)
        lora_errors: dict[int, str] = {}
        if self.lora_manager is not None:
            lora_errors = self.lora_manager.prepare_step(
                [state.lora_request for state in states], batch.attn_metadata.query_lens_cpu
            )
            for row, message in lora_errors.items():
                output.errors[states[row].req_id] = message
        intermediate = None
        if not place.is_first_stage:
            intermediate = self._recv_intermediate_tensors(len(batch.positions))
        encoder_stats = self.encoder_cache.stats
        queries, hits = encoder_stats.queries, encoder_stats.hits
        mm_rows = [
            (state.mm_items, state.num_computed_tokens, n)
            for state, n in zip(states, batch.attn_metadata.query_lens_cpu)
        ]
        inputs_embeds = merged_input_embeddings(
            self.model, self.encoder_cache, mm_rows, batch.input_ids, self.attention_backend
        )
        output.mm_cache_queries, output.mm_cache_hits = encoder_stats.queries - queries, encoder_stats.hits - hits
        # the KV slots follow batch.positions; the rotary positions of M-RoPE items differ
        model_positions = step_positions(mm_rows, batch.positions)
        try:
            hidden_states = self._run_model(
                batch.input_ids, model_positions, batch.attn_metadata, intermediate, inputs_embeds
            )
        finally:
            if self.lora_manager is not None:
                self.lora_manager.finish_step()
        if self.info.runner == "pooling":
            self._pool(states, batch, hidden_states, output)
            return output

        # rows whose known tokens (and drafts) are all computed after this step sample
        sampling_rows = [
            i
            for i, state in enumerate(states)
            if batch.seq_lens[i] == len(state.token_ids) + len(spec_tokens.get(state.req_id, ()))
            and i not in lora_errors
        ]
        if sampling_rows and any(states[i].req_id in spec_tokens for i in sampling_rows):
            self._verify(scheduler_output, states, sampling_rows, batch, hidden_states, output)
        elif sampling_rows:
            self._sample(scheduler_output, states, sampling_rows, batch, hidden_states, output)
        for i, state in enumerate(states):
            output.sampled_token_ids.setdefault(state.req_id, [])
            if state.prompt_logprobs is not None:
                self._prompt_logprobs(state, i, batch, hidden_states, output)
            state.num_computed_tokens = batch.seq_lens[i]
        if self.proposer is not None and scheduler_output.propose_drafts and sampling_rows:
            self._propose([states[i] for i in sampling_rows], output)
        return output

    def _execute_stage(self, scheduler_output: SchedulerOutput) -> None:
        """A stage before the last: run its layers over the step's tokens (received from the
        previous stage unless this is the first) and send the result to the next stage. Every
        stage sees the same scheduler outputs in the same order, so sends and receives pair up."""
        if scheduler_output.is_empty:
            return
        req_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.requests[req_id] for req_id in req_ids]
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        batch = self._prepare_inputs(states, scheduler_output.num_scheduled_tokens, spec_tokens)
        intermediate = None
        if not self.parallel.place.is_first_stage:
            intermediate = self._recv_intermediate_tensors(len(batch.positions))
        if self.lora_manager is not None:
            self.lora_manager.prepare_step([state.lora_request for state in states], batch.attn_metadata.query_lens_cpu)
        try:
            result = self._run_model(batch.input_ids, batch.positions, batch.attn_metadata, intermediate)
        finally:
            if self.lora_manager is not None:
                self.lora_manager.finish_step()
        self._send_intermediate_tensors(result)
        for i, state in enumerate(states):
            state.num_computed_tokens = batch.seq_lens[i]

    def _prepare_inputs(
        self,
        states: list[CachedRequestState],
        num_scheduled: dict[str, int],
        spec_tokens: dict[str, list[int]] | None = None,
    ) -> PreparedBatch:
        def rows() -> Iterator[tuple[list[int], int, list[int]]]:
            for state in states:
                start = state.num_computed_tokens
                tokens = state.token_ids[start : start + num_scheduled[state.req_id]]
                if spec_tokens and state.req_id in spec_tokens:
                    # the drafts follow the pending token, in the lookahead slots
                    tokens += spec_tokens[state.req_id]
                yield tokens, start, state.block_ids

        return prepare_batch(
            rows(),
            block_size=self.block_size,
            to_device=self.platform.host_to_device,
            kv_caches=self.kv_caches,
            backend=self.attention_backend,
            kv_scales=self.kv_scales,
            num_draft_tokens_cpu=[len(spec_tokens.get(state.req_id, ())) for state in states] if spec_tokens else None,
            bidirectional_spans=self._bidirectional_spans(states, num_scheduled),
            prompt_lens=[state.num_prompt_tokens for state in states],
        )

    @staticmethod
    def _bidirectional_spans(
        states: list[CachedRequestState], num_scheduled: dict[str, int]
    ) -> list[list[tuple[int, int]]] | None:
        """Per row, the items attending both ways that this step's tokens reach (None: none do)."""
        spans = [
            [
                (item.offset, item.end)
                for item in state.mm_items
                if item.bidirectional
                and item.offset < state.num_computed_tokens + num_scheduled[state.req_id]
                and item.end > state.num_computed_tokens
            ]
            for state in states
        ]
        return spans if any(spans) else None
