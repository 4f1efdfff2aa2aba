"""The model runner (worker side): keeps each running request's tokens and block table, turns
a :class:`SchedulerOutput` into one flat batch (token ids, positions, slot mapping, block
tables, query/sequence lengths), runs the model and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.core.batch import AttentionMetadata, ModelRunnerOutput, NewRequestData, SchedulerOutput
from tokenloom.core.config import EngineConfig
from tokenloom.core.model_loader import ModelInfo, build_model
from tokenloom.core.sampler import Sampler, SamplingMetadata, SamplingState, compute_prompt_logprobs
from tokenloom.plugins.manager import PluginSet
from tokenloom.plugins.registry import resolve_target

logger = logging.getLogger(__name__)

# memory left free when the KV cache is sized from --gpu-memory-utilization
KV_SAFETY_MARGIN_BYTES = 512 * 1024 * 1024


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


class ModelRunner:
    """Owns the model, its KV cache and the per-request state; one per worker."""

    def __init__(self, config: EngineConfig, info: ModelInfo, plugins: PluginSet, platform: Any):
        self.config = config
        self.info = info
        self.plugins = plugins
        self.platform = platform
        self.device = platform.torch_device()
        self.block_size = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.attention_backend = resolve_target(platform.attention_backend())()
        self.sampler = Sampler(logprobs_mode=config.model.logprobs_mode)
        self.model = None
        self.dtype = None

    # -- set-up -----------------------------------------------------------------------

    def load_model(self) -> None:
        self.model, self.dtype = build_model(self.config, self.info, self.plugins, self.platform)

    def kv_cache_dtype(self) -> torch.dtype:
        names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        return names.get(self.config.cache.cache_dtype, self.dtype)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        spec = self.model.kv_cache_spec
        element_size = torch.empty((), dtype=self.kv_cache_dtype()).element_size()
        bytes_per_block = spec.bytes_per_block(self.block_size, element_size)
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        else:
            budget = int(cache.gpu_memory_utilization * self.platform.available_memory_bytes()) - KV_SAFETY_MARGIN_BYTES
        max_useful_tokens = self.config.scheduler.max_num_seqs * self.info.max_model_len
        max_useful_blocks = -(-max_useful_tokens // self.block_size) + 1
        num_blocks = min(budget // bytes_per_block, max_useful_blocks)
        if num_blocks < 1:
            raise MemoryError(
                f"no memory left for the KV cache ({budget} bytes for blocks of {bytes_per_block} bytes): "
                "lower --max-model-len or raise --kv-cache-memory-bytes / --gpu-memory-utilization"
            )
        return int(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        spec = self.model.kv_cache_spec
        shape = (2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype(), device=self.device)
                          for _ in range(spec.num_layers)]
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    sum(t.numel() * t.element_size() for t in self.kv_caches) / 2**20)

    # -- one step ---------------------------------------------------------------------

    def _add_request(self, new: NewRequestData) -> None:
        params = new.sampling_params
        bad_words = (params.extra_args or {}).get("bad_words_token_ids", [])
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling=SamplingState(
                params,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                bad_words_token_ids=bad_words,
                eos_token_ids=self.info.eos_token_ids,
                device=self.device,
            ),
            prompt_logprobs=params.prompt_logprobs,
        )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._add_request(new)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        output = ModelRunnerOutput()
        if scheduler_output.is_empty:
            return output
        req_ids = list(scheduler_output.num_scheduled_tokens)
        states = [self.requests[req_id] for req_id in req_ids]
        batch = self._prepare_inputs(states, scheduler_output.num_scheduled_tokens)
        hidden_states = self.model(batch.input_ids, batch.positions, batch.attn_metadata)

        # rows whose known tokens are all computed after this step sample the next token
        sampling_rows = [i for i, state in enumerate(states)
                         if batch.seq_lens[i] == len(state.token_ids)]
        if sampling_rows:
            last_token_index = torch.tensor([batch.query_start_loc[i + 1] - 1 for i in sampling_rows], device=self.device)
            logits = self.model.compute_logits(hidden_states.index_select(0, last_token_index)).float()
            sampling_states = [states[i].sampling for i in sampling_rows]
            metadata = SamplingMetadata.build(sampling_states, logits.shape[-1], self.device)
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
                if sampled.logprobs[row] is not None:
                    output.logprobs[state.req_id] = [sampled.logprobs[row]]
        for i, state in enumerate(states):
            output.sampled_token_ids.setdefault(state.req_id, [])
            if state.prompt_logprobs is not None:
                self._prompt_logprobs(state, i, batch, hidden_states, output)
            state.num_computed_tokens = batch.seq_lens[i]
        return output

    def _prompt_logprobs(self, state, row, batch, hidden_states, output) -> None:
        """Logprobs of the prompt tokens computed this step (each predicted by the one before)."""
        start = state.num_computed_tokens
        end = min(batch.seq_lens[row], state.num_prompt_tokens - 1)  # positions that predict a prompt token
        if end <= start:
            return
        first = batch.query_start_loc[row]
        rows = torch.arange(first, first + (end - start), device=self.device)
        logits = self.model.compute_logits(hidden_states.index_select(0, rows)).float()
        targets = torch.tensor(state.token_ids[start + 1:end + 1], device=self.device)
        output.prompt_logprobs[state.req_id] = compute_prompt_logprobs(logits, targets, state.prompt_logprobs)

    def _prepare_inputs(self, states: list[CachedRequestState], num_scheduled: dict[str, int]) -> "PreparedBatch":
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        max_blocks = 0
        for state in states:
            count = num_scheduled[state.req_id]
            start = state.num_computed_tokens
            end = start + count
            token_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = state.block_ids
            slot_mapping.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
            query_lens.append(count)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + count)
            max_blocks = max(max_blocks, -(-end // block_size))
        block_tables = torch.zeros((len(states), max_blocks), dtype=torch.int64)
        for i, state in enumerate(states):
            used = -(-seq_lens[i] // block_size)
            block_tables[i, :used] = torch.tensor(state.block_ids[:used], dtype=torch.int64)
        device = self.device
        attn_metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            block_tables=block_tables.to(device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            kv_caches=self.kv_caches,
            backend=self.attention_backend,
        )
        return PreparedBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            attn_metadata=attn_metadata,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
        )


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    query_start_loc: list[int]
    seq_lens: list[int]
