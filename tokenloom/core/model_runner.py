"""The model runner (worker side): keeps each running request's tokens and block table, turns
a :class:`SchedulerOutput` into one flat batch (token ids, positions, slot mapping, block
tables, query/sequence lengths), runs the model and samples.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.core.batch import (
    AttentionMetadata,
    KVCacheScales,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenloom.core.config import EngineConfig
from tokenloom.core.distributed import ParallelState
from tokenloom.core.logits_processors import resolve_engine_processors
from tokenloom.core.model_interface import IntermediateTensors
from tokenloom.core.model_loader import ModelInfo, build_model
from tokenloom.core.multimodal.encoder_cache import MIN_ENCODER_CACHE_TOKENS, EncoderCache, merged_input_embeddings
from tokenloom.core.platform import attention_backend_target
from tokenloom.core.sampler import Sampler, compute_prompt_logprobs
from tokenloom.core.sampling_metadata import SamplingMetadata, SamplingState
from tokenloom.core.spec_decode.draft_length import AcceptanceEstimate, DraftLengthPolicy
from tokenloom.core.spec_decode.proposer import Draft, DraftRequest, Proposer, ProposerSpec
from tokenloom.core.spec_decode.rejection_sampler import DraftPrefixState, RejectionSampler
from tokenloom.core.step_budget import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tokenloom.core.step_inputs import PreparedBatch, prepare_batch
from tokenloom.errors import ConfigError
from tokenloom.plugins.manager import PluginSet
from tokenloom.plugins.registry import resolve_target

logger = logging.getLogger(__name__)

# memory left free when the KV cache is sized from --gpu-memory-utilization
KV_SAFETY_MARGIN_BYTES = 512 * 1024 * 1024

# --kv-cache-dtype values and the cache's element type (None: the model's dtype); fp8 is e4m3,
# as in vLLM on the CPU and CUDA
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_KV_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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


class ModelRunner:
    """Owns the model, its KV cache and the per-request state; one per worker."""

    def __init__(self, config: EngineConfig, info: ModelInfo, plugins: PluginSet, platform: Any, parallel: Any = None):
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
        # images' embeddings by hash: a repeated image is encoded once
        self.encoder_cache = EncoderCache(
            max(MIN_ENCODER_CACHE_TOKENS, config.scheduler.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS)
        )
        # blocks at or above this id have never been in a block table: nothing was written there
        self._kv_high_water = 0
        # blocks below this id have been mapped by prefault_kv_cache (or used)
        self._kv_prefaulted = 0

    # -- set-up -----------------------------------------------------------------------

    @staticmethod
    def _draft_length_policy(speculative: Any, platform: Any) -> DraftLengthPolicy:
        adaptive = speculative.adaptive_num_speculative_tokens
        row_cost = speculative.verify_row_cost
        if adaptive and row_cost is None:
            row_cost = platform.verify_row_cost()
        if adaptive:
            logger.info(
                "speculative decoding: each request drafts 1 to %d tokens, as its acceptance pays for "
                "(a verified row costs %.3g of a decode step)",
                speculative.num_speculative_tokens,
                row_cost,
            )
        return DraftLengthPolicy(speculative.num_speculative_tokens, adaptive, float(row_cost or 0.0))

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

    def kv_cache_dtype(self) -> torch.dtype:
        """The cache's element type for ``--kv-cache-dtype``; an fp8 cache needs an attention
        backend that reads one (ConfigError naming the flag otherwise)."""
        name = self.config.cache.cache_dtype
        if name not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype {name}: not a KV-cache type tokenloom builds; use one of "
                + ", ".join(KV_CACHE_DTYPES),
                param="kv_cache_dtype",
            )
        dtype = KV_CACHE_DTYPES[name]
        if dtype in FP8_KV_CACHE_DTYPES and not getattr(self.attention_backend, "supports_fp8_kv_cache", False):
            raise ConfigError(
                f"--kv-cache-dtype {name}: the attention backend {type(self.attention_backend).__name__} "
                "cannot read an fp8 KV cache; use --kv-cache-dtype auto with it",
                param="kv_cache_dtype",
            )
        if dtype is not None:
            return dtype
        if self.dtype is None:
            raise RuntimeError("the KV cache's dtype follows the model's: load the model first")
        return self.dtype

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        spec = self.model.kv_cache_spec
        if spec.num_layers == 0:
            # an encoder keeps no KV cache: its blocks are only the scheduler's bookkeeping
            return self._pooling_step_blocks()
        element_size = torch.empty((), dtype=self.kv_cache_dtype()).element_size()
        bytes_per_block = spec.bytes_per_block(self.block_size, element_size)
        if self.proposer is not None:
            # a draft model's KV lives in blocks of the same ids: one pool block holds both
            bytes_per_block += self.proposer.kv_cache_bytes_per_block(self.block_size)
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        else:
            if getattr(self.platform, "profiles_activations", False) and self.info.runner != "pooling":
                self.profile_run()
            budget = self.platform.kv_cache_budget_bytes(cache.gpu_memory_utilization) - KV_SAFETY_MARGIN_BYTES
            default_cap = self.platform.default_kv_cache_bytes()
            if default_cap is not None:
                budget = min(budget, default_cap)
        max_useful_tokens = self.config.scheduler.max_num_seqs * self.info.max_model_len
        max_useful_blocks = -(-max_useful_tokens // self.block_size) + 1
        if self.info.runner == "pooling":
            max_useful_blocks = min(max_useful_blocks, self._pooling_step_blocks())
        num_blocks = min(budget // bytes_per_block, max_useful_blocks)
        if num_blocks < 1:
            raise MemoryError(
                f"no memory left for the KV cache ({budget} bytes for blocks of {bytes_per_block} bytes): "
                "lower --max-model-len or raise --kv-cache-memory-bytes / --gpu-memory-utilization"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward pass of the largest step the scheduler may make: the token budget as
        prompts of at most ``max_model_len`` tokens (at most ``max_num_seqs`` of them), logits
        for every prompt, over a throwaway KV cache just large enough. The platform's memory
        profile, taken after it, then holds the peak activations too, as vLLM's does. Returns
        the number of tokens run."""
        spec = self.model.kv_cache_spec
        scheduler = self.config.scheduler
        remaining = scheduler.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        query_lens: list[int] = []
        while remaining > 0 and len(query_lens) < scheduler.max_num_seqs:
            query_lens.append(min(remaining, self.info.max_model_len))
            remaining -= query_lens[-1]
        block_size = self.block_size
        blocks_per_seq = [-(-query_len // block_size) for query_len in query_lens]
        shape = (2, sum(blocks_per_seq), block_size, spec.num_kv_heads, spec.head_size)
        kv_caches = [self.platform.zeros(shape, self.kv_cache_dtype()) for _ in range(spec.num_layers)]
        block_tables = torch.zeros((len(query_lens), max(blocks_per_seq)), dtype=torch.int64)
        first_block = 0
        for row, num_blocks in enumerate(blocks_per_seq):
            block_tables[row, :num_blocks] = torch.arange(first_block, first_block + num_blocks)
            first_block += num_blocks
        positions = torch.cat([torch.arange(query_len) for query_len in query_lens])
        slot_mapping = torch.cat(
            [
                block_tables[row, torch.arange(query_len) // block_size] * block_size
                + torch.arange(query_len) % block_size
                for row, query_len in enumerate(query_lens)
            ]
        )
        query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int64).cumsum(0)
        to_device = self.platform.host_to_device
        attn_metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping),
            query_start_loc=to_device(query_start_loc),
            seq_lens=to_device(torch.tensor(query_lens, dtype=torch.int64)),
            block_tables=to_device(block_tables),
            query_lens_cpu=query_lens,
            seq_lens_cpu=list(query_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(query_lens),
            block_size=block_size,
            kv_caches=kv_caches,
            backend=self.attention_backend,
        )
        input_ids = to_device(torch.zeros(len(positions), dtype=torch.int64))
        intermediate = None
        if not self.parallel.place.is_first_stage:
            intermediate = self._zero_intermediate_tensors(len(positions))
        hidden_states = self._run_model(input_ids, to_device(positions), attn_metadata, intermediate)
        if self.parallel.place.is_last_stage:
            self.model.compute_logits(hidden_states.index_select(0, attn_metadata.query_start_loc[1:] - 1))
        return len(positions)

    def _pooling_step_blocks(self) -> int:
        """Blocks one step of pooling requests can hold: they are freed in the step that
        computed them, and a step holds the token budget (or one longer prompt)."""
        scheduler = self.config.scheduler
        step_tokens = max(scheduler.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, self.info.max_model_len)
        return -(-step_tokens // self.block_size) + scheduler.max_num_seqs + 1

    def allocate_kv_cache(self, num_blocks: int) -> None:
        spec = self.model.kv_cache_spec
        shape = (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)
        dtype = self.kv_cache_dtype()
        self.kv_caches = [self.platform.zeros(shape, dtype) for _ in range(spec.num_layers)]
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)
        self.kv_scales = None
        if dtype in FP8_KV_CACHE_DTYPES:
            pending = self.config.cache.calculate_kv_scales
            self.kv_scales = [KVCacheScales(pending=pending) for _ in range(spec.num_layers)]
        elif self.config.cache.calculate_kv_scales:
            logger.warning("--calculate-kv-scales has no effect: the KV cache is %s, not fp8", dtype)
        logger.info(
            "KV cache: %d blocks of %d tokens, %s, %d bytes per block (%.1f MiB)",
            num_blocks,
            self.block_size,
            str(dtype).removeprefix("torch."),
            sum(t[:, 0].numel() * t.element_size() for t in self.kv_caches),
            sum(t.numel() * t.element_size() for t in self.kv_caches) / 2**20,
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

    def note_blocks_written(self, block_ids: list[int]) -> None:
        """Blocks written outside a step (a KV connector's loads) before any block table holds
        them: prefault_kv_cache must not zero them."""
        if block_ids:
            self._kv_high_water = max(self._kv_high_water, max(block_ids) + 1)

    def prefault_kv_cache(self, max_bytes: int) -> int:
        """Write zeros over the next never-used blocks (ids from the high-water mark up), up to
        ``max_bytes`` over all layers: the platform's lazily zeroed cache then pays its page
        faults now rather than in a request's step. Blocks at or above the high-water mark were
        never in a block table, so they hold zeros already and nothing is lost; called between
        steps on the thread that runs them. Returns the bytes written (0: nothing left)."""
        if not self.kv_caches:
            return 0
        num_blocks = self.kv_caches[0].shape[1]
        first = max(self._kv_high_water, self._kv_prefaulted)
        bytes_per_block = sum(cache[:, 0].numel() * cache.element_size() for cache in self.kv_caches)
        count = min(num_blocks - first, max_bytes // max(bytes_per_block, 1))
        if count <= 0:
            return 0
        for cache in self.kv_caches:
            cache[:, first : first + count].zero_()
        self._kv_prefaulted = first + count
        return count * bytes_per_block

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. A pipeline stage before the last sends its hidden states on to the
        next stage and returns None; the last stage samples and returns the step's output."""
        self._update_states(scheduler_output)
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
        inputs_embeds = merged_input_embeddings(
            self.model,
            self.encoder_cache,
            [
                (state.mm_items, state.num_computed_tokens, n)
                for state, n in zip(states, batch.attn_metadata.query_lens_cpu)
            ],
            batch.input_ids,
            self.attention_backend,
        )
        output.mm_cache_queries, output.mm_cache_hits = encoder_stats.queries - queries, encoder_stats.hits - hits
        try:
            hidden_states = self._run_model(
                batch.input_ids, batch.positions, batch.attn_metadata, intermediate, inputs_embeds
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
            last_token_index = torch.tensor(
                [batch.query_start_loc[i + 1] - 1 for i in sampling_rows], device=self.device
            )
            self._select_lora_logit_rows(last_token_index)
            logits = self.model.compute_logits(hidden_states.index_select(0, last_token_index)).float()
            sampling_states = [states[i].sampling for i in sampling_rows]
            grammar_rows, grammar_bitmask = self._grammar_bitmask(
                scheduler_output.structured_output, [states[i].req_id for i in sampling_rows], None
            )
            metadata = SamplingMetadata.build(
                sampling_states,
                logits.shape[-1],
                self.device,
                grammar_rows=grammar_rows,
                grammar_bitmask=grammar_bitmask,
            )
            sampled = self.sampler(logits, metadata)
            for row, i in enumerate(sampling_rows):
                state = states[i]
                if row in sampled.errors:
                    output.errors[state.req_id] = sampled.errors[row]
                    continue
                token_id = sampled.token_ids[row]
                state.token_ids.append(token_id)
                state.sampling.output_token_ids.append(token_id)
                output.sampled_token_ids[state.req_id] = [token_id]
                token_logprobs = sampled.logprobs[row]
                if token_logprobs is not None:
                    output.logprobs[state.req_id] = [token_logprobs]
        for i, state in enumerate(states):
            output.sampled_token_ids.setdefault(state.req_id, [])
            if state.prompt_logprobs is not None:
                self._prompt_logprobs(state, i, batch, hidden_states, output)
            state.num_computed_tokens = batch.seq_lens[i]
        if self.proposer is not None and scheduler_output.propose_drafts and sampling_rows:
            self._propose([states[i] for i in sampling_rows], output)
        return output

    def _select_lora_logit_rows(self, token_index: torch.Tensor) -> None:
        """Before ``compute_logits`` of these tokens' hidden states: an adapter's LM head
        applies to the rows of its own requests only."""
        if self.lora_manager is not None:
            self.lora_manager.select_logit_rows(token_index)

    # -- pipeline stages ---------------------------------------------------------------

    def _run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> Any:
        if inputs_embeds is not None:  # a multimodal model's step that computes image placeholders
            return self.model(input_ids, positions, attn_metadata, inputs_embeds=inputs_embeds)
        if self.parallel.place.pp_size == 1:
            return self.model(input_ids, positions, attn_metadata)  # models that know no stages
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors=intermediate)

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

    def _intermediate_shape(self, num_tokens: int) -> tuple[int, int, int]:
        # hidden states and residual travel as one [2, num_tokens, hidden_size] tensor: one
        # message per stage boundary instead of two
        return (2, num_tokens, self.model.config.hidden_size)

    def _activation_dtype(self) -> torch.dtype:
        if self.dtype is None:
            raise RuntimeError("a pipeline stage's activations follow the model's dtype: load the model first")
        return self.dtype

    def _zero_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        shape = self._intermediate_shape(num_tokens)
        both = torch.zeros(shape, dtype=self._activation_dtype(), device=self.device)
        return IntermediateTensors(both[0], both[1])

    def _send_intermediate_tensors(self, intermediate: IntermediateTensors) -> None:
        both = torch.stack([intermediate.hidden_states, intermediate.residual]).cpu()
        self.parallel.pp.send(both, dst=self.parallel.place.pp_rank + 1)

    def _recv_intermediate_tensors(self, num_tokens: int) -> IntermediateTensors:
        place = self.parallel.place
        shape = self._intermediate_shape(num_tokens)
        both = self.parallel.pp.recv(shape, self._activation_dtype(), src=place.pp_rank - 1)
        both = both.to(self.device)
        return IntermediateTensors(both[0], both[1])

    # -- speculative decoding ----------------------------------------------------------

    def _verify(
        self,
        scheduler_output: SchedulerOutput,
        states: list[CachedRequestState],
        sampling_rows: list[int],
        batch: PreparedBatch,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Logits at each verified position (a request's last ``k + 1``), then the rejection
        sampler: each request gets its accepted drafts and one more token."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        row_indices: list[int] = []
        row_states: list[Any] = []
        row_req_ids: list[str] = []
        row_offsets: list[int] = []
        drafts_per_request: list[list[int]] = []
        draft_probs: list[torch.Tensor | None] = []
        for i in sampling_rows:
            state = states[i]
            drafts = spec_tokens.get(state.req_id, [])
            end = batch.query_start_loc[i + 1]
            row_indices.extend(range(end - len(drafts) - 1, end))
            for position in range(len(drafts) + 1):
                row_states.append(DraftPrefixState(state.sampling, drafts[:position]) if position else state.sampling)
                row_req_ids.append(state.req_id)
                row_offsets.append(position)
            drafts_per_request.append(drafts)
            probs = state.draft.probs if state.draft is not None and drafts else None
            draft_probs.append(probs[: len(drafts)] if probs is not None else None)
            state.draft = None
        index = torch.tensor(row_indices, device=self.device)
        self._select_lora_logit_rows(index)
        logits = self.model.compute_logits(hidden_states.index_select(0, index)).float()
        grammar_rows, grammar_bitmask = self._grammar_bitmask(
            scheduler_output.structured_output, row_req_ids, row_offsets
        )
        metadata = SamplingMetadata.build(
            row_states, logits.shape[-1], self.device, grammar_rows=grammar_rows, grammar_bitmask=grammar_bitmask
        )
        verified = self.rejection_sampler(logits, metadata, drafts_per_request, draft_probs)
        for position, i in enumerate(sampling_rows):
            state = states[i]
            if position in verified.errors:
                output.errors[state.req_id] = verified.errors[position]
                continue
            token_ids = verified.token_ids[position]
            state.token_ids.extend(token_ids)
            state.sampling.output_token_ids.extend(token_ids)
            output.sampled_token_ids[state.req_id] = token_ids
            token_logprobs = verified.logprobs[position]
            if token_logprobs is not None:
                output.logprobs[state.req_id] = token_logprobs
            state.acceptance.observe(len(drafts_per_request[position]), len(token_ids) - 1)
            # the KV computed this step covers the accepted drafts, not the rejected ones
            num_rejected = len(drafts_per_request[position]) + 1 - len(token_ids)
            batch.seq_lens[i] -= num_rejected

    def _propose(self, states: list[CachedRequestState], output: ModelRunnerOutput) -> None:
        """Ask the proposer for the next step's drafts of the requests that just sampled, each
        for as many as its acceptance so far makes worth verifying (the draft-length policy)."""
        assert self.proposer is not None and self.draft_length_policy is not None  # speculation is on
        requests = [
            DraftRequest(
                state.req_id,
                state.token_ids,
                state.num_prompt_tokens,
                self.draft_length_policy.next_length(state.acceptance),
                block_ids=state.block_ids,
                temperature=0.0 if state.sampling.is_greedy else state.sampling.sampling_params.temperature,
            )
            for state in states
            if state.req_id not in output.errors
        ]
        if not requests:
            return
        drafts = self.proposer.propose(requests)
        for request, draft in zip(requests, drafts, strict=True):
            if draft.token_ids:
                draft.token_ids = list(draft.token_ids[: request.max_draft_tokens])
                self.requests[request.req_id].draft = draft
                output.draft_token_ids[request.req_id] = draft.token_ids

    def _pool(
        self,
        states: list[CachedRequestState],
        batch: PreparedBatch,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Pool each request's prompt, which the scheduler schedules whole (never chunked)."""
        query_lens = batch.attn_metadata.query_lens_cpu
        for i, state in enumerate(states):
            state.num_computed_tokens = batch.seq_lens[i]
            if query_lens[i] != state.num_prompt_tokens:
                output.errors[state.req_id] = (
                    f"a pooling prompt must run whole in one step, but {query_lens[i]} "
                    f"of its {state.num_prompt_tokens} tokens were scheduled"
                )
        rows = [i for i, state in enumerate(states) if state.req_id not in output.errors]
        if not rows:
            return
        if len(rows) < len(states):
            hidden_states = torch.cat(
                [hidden_states[batch.query_start_loc[i] : batch.query_start_loc[i + 1]] for i in rows]
            )
        pooled = self.model.pooler(
            hidden_states, [query_lens[i] for i in rows], [states[i].pooling_params for i in rows]
        )
        for i, vector in zip(rows, pooled):
            output.pooled[states[i].req_id] = vector

    def _grammar_bitmask(
        self, masks: Any, req_ids: list[str], offsets: list[int] | None
    ) -> tuple[list[int] | None, torch.Tensor | None]:
        """The sampling rows a structured-output mask applies to, and their mask rows in order.
        A request verifying drafts has consecutive mask rows; ``offsets[row]`` is the sampling
        row's position among its request's (None: all 0)."""
        if masks is None:
            return None, None
        mask_row: dict[str, int] = {}
        for row, req_id in enumerate(masks.req_ids):
            mask_row.setdefault(req_id, row)
        rows = [row for row, req_id in enumerate(req_ids) if req_id in mask_row]
        if not rows:
            return None, None
        order = torch.tensor(
            [mask_row[req_ids[row]] + (offsets[row] if offsets else 0) for row in rows], dtype=torch.long
        )
        return rows, torch.from_numpy(masks.bitmask).index_select(0, order).to(self.device)

    def _prompt_logprobs(
        self,
        state: CachedRequestState,
        row: int,
        batch: PreparedBatch,
        hidden_states: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        """Logprobs of the prompt tokens computed this step (each predicted by the one before)."""
        num_logprobs = state.prompt_logprobs
        if num_logprobs is None:
            return
        start = state.num_computed_tokens
        end = min(batch.seq_lens[row], state.num_prompt_tokens - 1)  # positions that predict a prompt token
        if end <= start:
            return
        first = batch.query_start_loc[row]
        rows = torch.arange(first, first + (end - start), device=self.device)
        self._select_lora_logit_rows(rows)
        logits = self.model.compute_logits(hidden_states.index_select(0, rows)).float()
        targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=self.device)
        output.prompt_logprobs[state.req_id] = compute_prompt_logprobs(logits, targets, num_logprobs)

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
        )
