"""The LoRA path beside a linear layer: each adaptable layer gets a :class:`LinearLoRA` holding
every slot's ``A`` and ``B`` stacked, and adds ``x @ A_slot.T @ B_slot.T`` for each token's
slot. The base matmul is untouched (float, oneDNN-packed or int4/int8 GGUF alike): the delta
is a second, small product added to its output.

The batched form (vLLM's punica BGMV, as two dense matmuls): ``x @ A_stack.T`` computes
every used slot's ``x @ A`` at once (``[tokens, used_slots * shards * max_rank]``), a per-token
mask keeps each token's own slot's columns (zero for base-model tokens), and one more matmul
with ``B_stack`` gives each token its own adapter's delta. The stacks are cut at the highest
used slot, so the cost follows the adapters in the batch, not ``--max-loras``.
"""

from __future__ import annotations

from typing import Any

import torch


class LoRABatchState:
    """What every LoRA layer of a model reads in a step: each token's slot (-1: the base
    model), as masks over the stacked columns, built once per step and shared."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.active = False  # some token of this step runs an adapter
        self.num_used_slots = 0
        self._token_slots: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def set_batch(self, token_slots: list[int]) -> None:
        """This step's slot per token, in batch order."""
        self._masks = {}
        used = [slot for slot in token_slots if slot >= 0]
        self.active = bool(used)
        if not self.active:
            self._token_slots = None
            self.num_used_slots = 0
            return
        self.num_used_slots = max(used) + 1
        self._token_slots = torch.tensor(token_slots, dtype=torch.long)

    def clear(self) -> None:
        self.set_batch([])

    def mask(self, num_shards: int) -> torch.Tensor:
        """``[tokens, used_slots * num_shards * max_rank]``: 1 on each token's own slot's
        columns, 0 elsewhere (everywhere for a base-model token)."""
        mask = self._masks.get(num_shards)
        if mask is None:
            assert self._token_slots is not None  # only asked for while active
            columns_per_slot = num_shards * self.max_rank
            column_slot = torch.arange(self.num_used_slots * columns_per_slot) // columns_per_slot
            mask = (column_slot.unsqueeze(0) == self._token_slots.unsqueeze(1)).to(self.dtype)
            self._masks[num_shards] = mask
        return mask


class LinearLoRA:
    """The slots of one linear layer. ``shards`` are the ``(output offset, output size)`` of the
    projections fused in the layer (q, k, v; gate, up; or the whole output)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        shards: list[tuple[int, int]],
        state: LoRABatchState,
    ):
        self.input_size = input_size
        self.output_size = output_size
        self.shards = shards
        self.state = state
        columns = state.max_loras * len(shards) * state.max_rank
        self.lora_a = torch.zeros(columns, input_size, dtype=state.dtype)
        self.lora_b = torch.zeros(output_size, columns, dtype=state.dtype)

    def _columns(self, slot: int, shard_index: int) -> int:
        return (slot * len(self.shards) + shard_index) * self.state.max_rank

    def set_slot(self, slot: int, shard_index: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Write one shard's ``A [rank, in]`` and scaled ``B [out_shard, rank]`` into ``slot``."""
        start = self._columns(slot, shard_index)
        rank = lora_a.shape[0]
        offset, size = self.shards[shard_index]
        self.lora_a[start : start + self.state.max_rank].zero_()
        self.lora_b[:, start : start + self.state.max_rank].zero_()
        self.lora_a[start : start + rank].copy_(lora_a)
        self.lora_b[offset : offset + size, start : start + rank].copy_(lora_b)

    def clear_slot(self, slot: int) -> None:
        start, end = self._columns(slot, 0), self._columns(slot + 1, 0)
        self.lora_a[start:end].zero_()
        self.lora_b[:, start:end].zero_()

    def add_delta(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """``output`` plus each token's adapter delta (``output`` itself when no token has one)."""
        state = self.state
        if not state.active:
            return output
        mask = state.mask(len(self.shards))
        if x.dim() != 2 or x.shape[0] != mask.shape[0]:
            # every adapted layer sees the whole flat batch; anything else would mix tokens' slots
            raise RuntimeError(f"LoRA layer got input {tuple(x.shape)} for a batch of {mask.shape[0]} tokens")
        width = state.num_used_slots * len(self.shards) * state.max_rank
        projected = torch.nn.functional.linear(x.to(state.dtype), self.lora_a[:width])
        projected = projected * mask
        delta = torch.nn.functional.linear(projected, self.lora_b[:, :width])
        return output + delta.to(output.dtype)


def lora_of(module: Any) -> LinearLoRA | None:
    return getattr(module, "lora", None)
