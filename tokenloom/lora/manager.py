"""The worker's side of LoRA: :class:`LoRAModelManager` attaches a :class:`LinearLoRA` to every
adaptable projection of the model (and an embedding and logits LoRA to ``embed_tokens`` and
``lm_head``), keeps up to ``--max-cpu-loras`` adapters read from disk in
an LRU cache, and before each step puts the step's adapters into the ``--max-loras`` slots
(keeping those already there, evicting the least recently used) and tells the layers each
token's slot."""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenloom.layers.linear import LinearBase
from tokenloom.layers.weight_loading import DECODER_STACKED_PARAMS
from tokenloom.lora.layers import EmbeddingLoRA, LinearLoRA, LogitsLoRA, LoRABatchState
from tokenloom.lora.peft import LoRAAdapterError, PeftAdapter, canonical_name, load_peft_adapter
from tokenloom.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_PROJECTION_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z0-9_]+)$")


class LoRAModelManager:
    """One per model runner, built after the model's weights are loaded."""

    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype):
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.state = LoRABatchState(max_loras, max_lora_rank, dtype)
        # canonical name (layers.0.self_attn.q_proj) -> the LoRA of its layer and its shard index
        self.targets: dict[str, tuple[LinearLoRA | EmbeddingLoRA, int]] = {}
        # canonical name -> (input features, output features) of that projection
        self.module_shapes: dict[str, tuple[int, int]] = {}
        self._attach(model)
        if not self.targets:
            raise LoRAAdapterError(f"{type(model).__name__} has no projections LoRA adapters can target")
        self._cpu_cache: OrderedDict[int, PeftAdapter] = OrderedDict()
        self._slot_lora_ids: list[int | None] = [None] * max_loras
        self._slot_adapters: list[PeftAdapter | None] = [None] * max_loras
        self._slot_last_used = [0] * max_loras
        self._step = 0

    def _attach(self, model: nn.Module) -> None:
        fused: dict[str, list[tuple[str, Any]]] = {}
        for fused_name, checkpoint_name, shard_id in getattr(model, "stacked_params", DECODER_STACKED_PARAMS):
            fused.setdefault(fused_name, []).append((checkpoint_name, shard_id))
        for path, module in model.named_modules():
            name = path.rsplit(".", 1)[-1]
            if name == "embed_tokens" and type(module) is VocabParallelEmbedding and module.tp_size == 1:
                module.lora = EmbeddingLoRA(module.num_embeddings, module.embedding_dim, [(0, 0)], self.state)
                self.targets[name] = (module.lora, 0)
                self.module_shapes[name] = (module.num_embeddings, module.embedding_dim)
                continue
            if name == "lm_head" and isinstance(module, ParallelLMHead) and module.tp_size == 1:
                # a tied head shares the embedding's weight, never its LoRA
                module.lora = LogitsLoRA(
                    module.embedding_dim, module.num_embeddings, [(0, module.num_embeddings)], self.state
                )
                self.targets[name] = (module.lora, 0)
                self.module_shapes[name] = (module.embedding_dim, module.num_embeddings)
                continue
            match = _PROJECTION_PATH.search(path)
            if match is None or not isinstance(module, LinearBase):
                continue
            if module.tp_size != 1:
                raise LoRAAdapterError("LoRA adapters are not supported with tensor parallelism yet")
            layer_index, block, name = int(match[1]), match[2], match[3]
            parts = fused.get(name, [(name, None)])
            shards = [module.shard_rows(shard_id)[:2] for _, shard_id in parts]
            lora = LinearLoRA(module.input_size, module.output_size, shards, self.state)
            module.lora = lora
            for shard_index, (checkpoint_name, _) in enumerate(parts):
                key = canonical_name(layer_index, block, checkpoint_name)
                self.targets[key] = (lora, shard_index)
                self.module_shapes[key] = (module.input_size, shards[shard_index][1])

    # -- adapters in memory -----------------------------------------------------------------

    def get_adapter(self, lora_request: LoRARequest) -> PeftAdapter:
        """The adapter's weights, from the CPU cache or read (and checked) from its folder."""
        lora_id = lora_request.lora_int_id
        adapter = self._cpu_cache.get(lora_id)
        if adapter is not None and adapter.path == lora_request.lora_path:
            self._cpu_cache.move_to_end(lora_id)
            return adapter
        adapter = load_peft_adapter(
            lora_request.lora_path,
            max_lora_rank=self.max_lora_rank,
            module_shapes=self.module_shapes,
            dtype=self.state.dtype,
        )
        self._cpu_cache[lora_id] = adapter
        while len(self._cpu_cache) > self.max_cpu_loras:
            evicted_id, _ = self._cpu_cache.popitem(last=False)
            logger.info("LoRA adapter %d leaves the CPU cache (--max-cpu-loras %d)", evicted_id, self.max_cpu_loras)
        return adapter

    def remove_adapter(self, lora_id: int) -> None:
        """Forget an adapter (unloaded at runtime): its cached weights and its slot."""
        self._cpu_cache.pop(lora_id, None)
        for slot, slot_lora_id in enumerate(self._slot_lora_ids):
            if slot_lora_id == lora_id:
                self._clear_slot(slot)

    @property
    def cached_lora_ids(self) -> list[int]:
        """Adapters in the CPU cache, least recently used first."""
        return list(self._cpu_cache)

    @property
    def slot_lora_ids(self) -> list[int | None]:
        return list(self._slot_lora_ids)

    # -- slots ------------------------------------------------------------------------------

    def _clear_slot(self, slot: int) -> None:
        for lora in {id(lora): lora for lora, _ in self.targets.values()}.values():
            lora.clear_slot(slot)
        self._slot_lora_ids[slot] = None
        self._slot_adapters[slot] = None

    def _fill_slot(self, slot: int, lora_id: int, adapter: PeftAdapter) -> None:
        self._clear_slot(slot)
        for name, (lora_a, lora_b) in adapter.weights.items():
            lora, shard_index = self.targets[name]
            lora.set_slot(slot, shard_index, lora_a.to(self.state.dtype), lora_b.to(self.state.dtype))
        self._slot_lora_ids[slot] = lora_id
        self._slot_adapters[slot] = adapter

    def _slot_for(self, lora_request: LoRARequest, in_this_step: set[int]) -> int:
        lora_id = lora_request.lora_int_id
        adapter = self.get_adapter(lora_request)
        if lora_id in self._slot_lora_ids:
            slot = self._slot_lora_ids.index(lora_id)
            if self._slot_adapters[slot] is adapter:
                return slot
            self._clear_slot(slot)  # the id now names other files: reload
        free = [slot for slot, held in enumerate(self._slot_lora_ids) if held is None]
        if free:
            slot = free[0]  # the lowest: the layers' stacks are cut after the highest used slot
        else:
            evictable = [slot for slot, held in enumerate(self._slot_lora_ids) if held not in in_this_step]
            if not evictable:
                raise RuntimeError(f"more distinct LoRA adapters in one step than --max-loras {self.max_loras}")
            slot = min(evictable, key=lambda candidate: self._slot_last_used[candidate])
        self._fill_slot(slot, lora_id, adapter)
        return slot

    def prepare_step(self, row_lora_requests: list[LoRARequest | None], query_lens: list[int]) -> dict[int, str]:
        """Put this step's adapters into slots and give the layers each token's slot.

        :returns: ``row -> error`` for rows whose adapter could not be loaded (they run as the
            base model this step, and the runner fails them).
        """
        self._step += 1
        in_this_step = {request.lora_int_id for request in row_lora_requests if request is not None}
        slots: dict[int, int] = {}
        errors: dict[int, str] = {}
        for row, request in enumerate(row_lora_requests):
            if request is None:
                continue
            lora_id = request.lora_int_id
            if lora_id not in slots:
                try:
                    slots[lora_id] = self._slot_for(request, in_this_step)
                except LoRAAdapterError as exc:
                    slots[lora_id] = -1
                    errors[row] = exc.message
                    continue
            if slots[lora_id] < 0:
                errors[row] = f"LoRA adapter {request.lora_name!r} could not be loaded"
                continue
            self._slot_last_used[slots[lora_id]] = self._step
        token_slots: list[int] = []
        for row, (request, query_len) in enumerate(zip(row_lora_requests, query_lens)):
            slot = -1 if request is None or row in errors else slots[request.lora_int_id]
            token_slots.extend([slot] * query_len)
        self.state.set_batch(token_slots)
        return errors

    def select_logit_rows(self, token_index: torch.Tensor) -> None:
        """The next ``compute_logits`` gets the hidden states of these tokens of the step (the
        LM head's LoRA gives each row its request's adapter)."""
        self.state.select_rows(token_index)

    def finish_step(self) -> None:
        """The forward is done: the layers stop adding deltas; the slots stay for the logits."""
        self.state.end_forward()
