"""The KV cache a model runner owns: its element type (``--kv-cache-dtype``, fp8 scales), how
many blocks it gets (``determine_num_blocks``, after a profile run of the largest step, and of
the vision encoder on the worst-case image, where the platform measures activations), its allocation, and the prefaulting of never-used blocks
between steps."""

from __future__ import annotations

import logging
from typing import Any

import torch

from tokenloom.core.batch import AttentionMetadata, KVCacheScales
from tokenloom.core.config import EngineConfig
from tokenloom.core.model_loader import ModelInfo
from tokenloom.core.model_runner_stages import PipelineStageIO
from tokenloom.core.spec_decode.proposer import Proposer
from tokenloom.core.step_budget import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tokenloom.errors import ConfigError

logger = logging.getLogger(__name__)

# memory left free when the KV cache is sized from --gpu-memory-utilization
KV_SAFETY_MARGIN_BYTES = 512 * 1024 * 1024
# never-used KV-cache memory an idle server keeps mapped ahead of the blocks used so far
# (prefault_kv_cache; figures: docs/design.md, "KV cache sizing on the CPU")
KV_PREFAULT_LEAD_BYTES = 1 << 30

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


class KVCacheSetup(PipelineStageIO):
    """Sizes, allocates and prefaults the KV cache. Mixed into
    :class:`~tokenloom.core.model_runner.ModelRunner`, which sets the attributes."""

    config: EngineConfig
    info: ModelInfo
    platform: Any
    proposer: Proposer | None
    attention_backend: Any
    block_size: int
    kv_caches: list[torch.Tensor]
    kv_scales: list[KVCacheScales] | None
    profile_mm_items: list[Any]
    _kv_high_water: int
    _kv_prefaulted: int
    _kv_map_blocks_off: bool

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
        profile, taken after it, then holds the peak activations too, as vLLM's does; a model
        that sees first encodes its worst-case media (``profile_mm_items``). Returns the number
        of tokens run."""
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
        inputs_embeds = self._profile_inputs_embeds(input_ids)
        hidden_states = self._run_model(input_ids, to_device(positions), attn_metadata, intermediate, inputs_embeds)
        if self.parallel.place.is_last_stage:
            self.model.compute_logits(hidden_states.index_select(0, attn_metadata.query_start_loc[1:] - 1))
        return len(positions)

    def _profile_inputs_embeds(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The profile step's input embeddings with the worst-case media encoded into its first
        rows (``profile_mm_items``: the vision encoder's peak joins the profile; each item is
        encoded alone, as a step encodes them), or None for a model that sees nothing."""
        if not self.profile_mm_items or not self.parallel.place.is_first_stage:
            return None
        embeddings = torch.cat(
            [self.model.embed_multimodal(item, self.attention_backend) for item in self.profile_mm_items]
        )
        inputs_embeds: torch.Tensor = self.model.embed_input_ids(input_ids)
        rows = min(embeddings.shape[0], inputs_embeds.shape[0])
        inputs_embeds[:rows] = embeddings[:rows].to(inputs_embeds.dtype)
        return inputs_embeds

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

    def map_new_blocks(self) -> None:
        """Before a step first writes never-used blocks (from the mapped mark up to the high-water
        mark: the block manager hands them out in id order), the platform maps them all at once
        (:meth:`Platform.map_blocks`)."""
        if self._kv_map_blocks_off or not self.kv_caches or self._kv_high_water <= self._kv_prefaulted:
            return
        if self.platform.map_blocks(self.kv_caches, self._kv_prefaulted, self._kv_high_water):
            self._kv_prefaulted = self._kv_high_water
        else:
            self._kv_map_blocks_off = True

    def note_blocks_written(self, block_ids: list[int]) -> None:
        """Blocks written outside a step (a KV connector's loads) before any block table holds
        them: prefault_kv_cache must not zero them."""
        if block_ids:
            self._kv_high_water = max(self._kv_high_water, max(block_ids) + 1)

    def prefault_kv_cache(self, max_bytes: int) -> int:
        """Map the next never-used blocks (ids from the high-water mark up), up to ``max_bytes``
        over all layers and at least one block (a 1.7B model's block is 3 MiB, more than the idle
        loop's chunk), while less than ``KV_PREFAULT_LEAD_BYTES`` is mapped ahead of the
        high-water mark: the platform's lazily zeroed cache then pays its page faults now rather
        than in a request's step, and a server that keeps taking fresh blocks (cached ones are
        evicted only when no never-used block is left) finds the next ones mapped after each
        pause. Through :meth:`Platform.map_blocks` where the platform maps (contents unchanged),
        else by writing zeros over them: blocks at or above the high-water mark were never in a
        block table, so they hold zeros already and nothing is lost. Called between steps on the
        thread that runs them. Returns the bytes mapped (0: nothing left to map now)."""
        if not self.kv_caches:
            return 0
        num_blocks = self.kv_caches[0].shape[1]
        first = max(self._kv_high_water, self._kv_prefaulted)
        bytes_per_block = max(1, sum(cache[:, 0].numel() * cache.element_size() for cache in self.kv_caches))
        lead_blocks = KV_PREFAULT_LEAD_BYTES // bytes_per_block - (first - self._kv_high_water)
        count = min(num_blocks - first, lead_blocks, max(1, max_bytes // bytes_per_block))
        if count <= 0:
            return 0
        if self._kv_map_blocks_off or not self.platform.map_blocks(self.kv_caches, first, first + count):
            self._kv_map_blocks_off = True
            for cache in self.kv_caches:
                cache[:, first : first + count].zero_()
        self._kv_prefaulted = first + count
        return count * bytes_per_block
