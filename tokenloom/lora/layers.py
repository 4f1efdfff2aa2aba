"""The LoRA path beside a linear layer, the token embedding and the LM head: each adaptable
layer gets a LoRA object holding every slot's ``A`` and ``B`` stacked, and adds each token's
own adapter's delta to the base output. The base computation is untouched (float,
oneDNN-packed or int4/int8 GGUF alike): the delta is a second, small product added to its output.

The batched form (vLLM's punica BGMV, as two dense matmuls): ``x @ A_stack.T`` computes
every used slot's ``x @ A`` at once (``[tokens, used_slots * shards * max_rank]``), a per-token
mask keeps each token's own slot's columns (zero for base-model tokens), and one more matmul
with ``B_stack`` gives each token its own adapter's delta. The stacks are cut at the highest
used slot, so the cost follows the adapters in the batch, not ``--max-loras``.

The embedding's ``A`` is a lookup instead of a product (PEFT's ``lora_embedding_A`` is
``[rank, vocab]``: a token's column is its ``x @ A``); the LM head's delta is one per logits
row, so it reads the slots of the rows the runner selected (:meth:`LoRABatchState.select_rows`)
rather than the step's tokens. A tied LM head and embedding share the base weight only: each
has its own LoRA object, so an adapter on one never changes the other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


class LoRABatchState:
    """What every LoRA layer of a model reads in a step: each token's slot (-1: the base
    model), as masks over the stacked columns, built once per step and shared."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.active = False  # some token of this step's forward runs an adapter
        self.num_used_slots = 0
        self.used_slots: frozenset[int] = frozenset()
        self._token_slots: torch.Tensor | None = None  # kept after the forward, for the logits rows
        self._masks: dict[int, torch.Tensor] = {}
        self._row_slots: torch.Tensor | None = None

    def set_batch(self, token_slots: list[int]) -> None:
        """This step's slot per token, in batch order."""
        self._masks = {}
        self._row_slots = None
        used = {slot for slot in token_slots if slot >= 0}
        self.active = bool(used)
        self.used_slots = frozenset(used)
        if not self.active:
            self._token_slots = None
            self.num_used_slots = 0
            return
        self.num_used_slots = max(used) + 1
        self._token_slots = torch.tensor(token_slots, dtype=torch.long)

    def clear(self) -> None:
        self.set_batch([])

    @property
    def token_slots(self) -> torch.Tensor:
        """``[tokens]`` int64, each token's slot (-1: the base model); only while active."""
        assert self._token_slots is not None  # only asked for while active
        return self._token_slots

    @property
    def num_tokens(self) -> int:
        return 0 if self._token_slots is None else self._token_slots.shape[0]

    def end_forward(self) -> None:
        """The step's forward is done: the layers stop adding deltas (a drafter running the
        model after it runs the base model), while the token slots stay for the logits rows."""
        self.active = False
        self._masks = {}

    def select_rows(self, token_index: torch.Tensor) -> None:
        """The next ``compute_logits`` gets the hidden states of these tokens of the step:
        the LM head's LoRA gives each row its token's adapter (once; then it is forgotten)."""
        if self._token_slots is None:
            self._row_slots = None
            return
        self._row_slots = self._token_slots.index_select(0, token_index.to(torch.long).cpu())

    def take_row_slots(self) -> torch.Tensor | None:
        row_slots, self._row_slots = self._row_slots, None
        return row_slots

    def mask(self, num_shards: int) -> torch.Tensor:
        """``[tokens, used_slots * num_shards * max_rank]``: 1 on each token's own slot's
        columns, 0 elsewhere (everywhere for a base-model token)."""
        mask = self._masks.get(num_shards)
        if mask is None:
            assert self._token_slots is not None  # only asked for while active
            mask = self.mask_for(self._token_slots, num_shards)
            self._masks[num_shards] = mask
        return mask

    def mask_for(self, slots: torch.Tensor, num_shards: int) -> torch.Tensor:
        columns_per_slot = num_shards * self.max_rank
        num_used_slots = int(slots.max()) + 1
        column_slot = torch.arange(num_used_slots * columns_per_slot) // columns_per_slot
        return (column_slot.unsqueeze(0) == slots.unsqueeze(1)).to(self.dtype)


class _SlotStacks:
    """``A [slots * shards * max_rank, in]`` and ``B [out, same columns]`` of one layer, made on
    the first adapter that targets it (an embedding's or LM head's stacks are as large as the
    vocabulary: a server whose adapters leave them alone never holds them)."""

    #: made with the layer (a projection's are small) rather than on the first adapter
    allocate_eagerly = True

    def __init__(self, input_size: int, output_size: int, shards: list[tuple[int, int]], state: LoRABatchState):
        self.input_size = input_size
        self.output_size = output_size
        self.shards = shards
        self.state = state
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.lora_b_t: torch.Tensor | None = None
        self.shard_table: torch.Tensor | None = None
        self._filled = [False] * state.max_loras  # slots whose adapter targets this layer
        if self.allocate_eagerly:
            self._allocate()

    def _allocate(self) -> None:
        if self.lora_a is None:
            columns = self.state.max_loras * len(self.shards) * self.state.max_rank
            self.lora_a = torch.zeros(columns, self.input_size, dtype=self.state.dtype)
            # B transposed, [columns, out]: the native BGMV's expand reads a slot's rows whole;
            # lora_b is its [out, columns] view, the weight of the torch path's F.linear
            self.lora_b_t = torch.zeros(columns, self.output_size, dtype=self.state.dtype)
            self.lora_b = self.lora_b_t.T
            self.shard_table = torch.tensor(self.shards, dtype=torch.long).reshape(-1, 2)

    def _columns(self, slot: int, shard_index: int) -> int:
        return (slot * len(self.shards) + shard_index) * self.state.max_rank

    def set_slot(self, slot: int, shard_index: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Write one shard's ``A [rank, in]`` and scaled ``B [out_shard, rank]`` into ``slot``."""
        self._allocate()
        start = self._columns(slot, shard_index)
        rank = lora_a.shape[0]
        offset, size = self.shards[shard_index]
        self.lora_a[start : start + self.state.max_rank].zero_()
        self.lora_b[:, start : start + self.state.max_rank].zero_()
        self.lora_a[start : start + rank].copy_(lora_a)
        self.lora_b[offset : offset + size, start : start + rank].copy_(lora_b)
        self._filled[slot] = True

    def clear_slot(self, slot: int) -> None:
        self._filled[slot] = False
        if self.lora_a is None:
            return
        start, end = self._columns(slot, 0), self._columns(slot + 1, 0)
        self.lora_a[start:end].zero_()
        self.lora_b[:, start:end].zero_()

    def applies(self) -> bool:
        """Some token of this step's forward runs an adapter that targets this layer."""
        state = self.state
        return state.active and any(self._filled[slot] for slot in state.used_slots)

    def _check_rows(self, rows: int, expected: int) -> None:
        if rows != expected:
            # every adapted layer sees the whole flat batch; anything else would mix tokens' slots
            raise RuntimeError(f"{type(self).__name__} got {rows} rows for a batch of {expected} tokens")


class LinearLoRA(_SlotStacks):
    """The slots of one linear layer. ``shards`` are the ``(output offset, output size)`` of the
    projections fused in the layer (q, k, v; gate, up; or the whole output)."""

    def add_delta(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """``output`` plus each token's adapter delta (``output`` itself when no token has one)."""
        if not self.applies():
            return output
        state = self.state
        if x.dim() != 2:
            raise RuntimeError(f"LoRA layer got input {tuple(x.shape)} for a batch of {state.num_tokens} tokens")
        self._check_rows(x.shape[0], state.num_tokens)
        bgmv = _native_bgmv(x, output)
        if bgmv is not None and self.lora_a.dtype in _NATIVE_DTYPES:
            # one token's slot at a time, in place (the fused decode layer calls the same operator)
            bgmv(
                output, x.contiguous(), self.lora_a, self.lora_b_t, state.token_slots, self.shard_table, state.max_rank
            )
            return output
        mask = state.mask(len(self.shards))
        return output + self._delta(x, mask).to(output.dtype)

    def _delta(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        width = mask.shape[1]
        projected = F.linear(x.to(self.state.dtype), self.lora_a[:width])
        return F.linear(projected * mask, self.lora_b[:, :width])


class LogitsLoRA(LinearLoRA):
    """The LM head's slots: ``hidden [rows, hidden] -> logits [rows, vocab]``, each row with the
    adapter of the token the runner selected it from (after the forward, not per token)."""

    allocate_eagerly = False

    def add_delta(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        row_slots = self.state.take_row_slots()
        if row_slots is None or self.lora_a is None:
            return output
        if not any(self._filled[slot] for slot in set(row_slots.tolist()) if slot >= 0):
            return output
        self._check_rows(x.shape[0], row_slots.shape[0])
        mask = self.state.mask_for(row_slots, 1)
        return output + self._delta(x, mask).to(output.dtype)


class EmbeddingLoRA(_SlotStacks):
    """The token embedding's slots (PEFT's ``lora_embedding_A [rank, vocab]`` and
    ``lora_embedding_B [hidden, rank]``): a token's delta is ``B @ A[:, token]``. ``A`` is kept
    transposed, ``[vocab, columns]``, so a step's lookup reads one row per token."""

    allocate_eagerly = False

    def _allocate(self) -> None:
        if self.lora_a is None:
            columns = self.state.max_loras * self.state.max_rank
            self.lora_a = torch.zeros(self.input_size, columns, dtype=self.state.dtype)
            self.lora_b = torch.zeros(self.output_size, columns, dtype=self.state.dtype)
            self.lora_b_t = self.lora_b.T

    def set_slot(self, slot: int, shard_index: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """``A [rank, vocab]`` and scaled ``B [hidden, rank]`` into ``slot`` (one shard)."""
        self._allocate()
        start = self._columns(slot, 0)
        rank = lora_a.shape[0]
        self.lora_a[:, start : start + self.state.max_rank].zero_()
        self.lora_b[:, start : start + self.state.max_rank].zero_()
        self.lora_a[:, start : start + rank].copy_(lora_a.T)
        self.lora_b[:, start : start + rank].copy_(lora_b)
        self._filled[slot] = True

    def clear_slot(self, slot: int) -> None:
        self._filled[slot] = False
        if self.lora_a is None:
            return
        start, end = self._columns(slot, 0), self._columns(slot + 1, 0)
        self.lora_a[:, start:end].zero_()
        self.lora_b[:, start:end].zero_()

    def add_delta(self, input_ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        if not self.applies():
            return output
        mask = self.state.mask(1)
        flat_ids = input_ids.reshape(-1)
        self._check_rows(flat_ids.shape[0], mask.shape[0])
        width = mask.shape[1]
        looked_up = F.embedding(flat_ids, self.lora_a[:, :width])
        delta = F.linear(looked_up * mask, self.lora_b[:, :width])
        return output + delta.reshape(output.shape).to(output.dtype)


# lora_bgmv_ for every token count, though it re-reads a slot's A and B per token (at 32 tokens
# it measured 2x slower than torch's batched matmuls): one operator for every batch keeps each
# token's result independent of the batch (a mixed batch gives each request what it gets alone)
# the activation (and LoRA weight) dtypes lora_bgmv_ computes
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _native_bgmv(x: torch.Tensor, output: torch.Tensor) -> Any:
    """tokenloom's CPU BGMV operator when it runs on these tensors, else None (the torch path)."""
    from tokenloom.kernels import cpu_native

    if x.dtype not in _NATIVE_DTYPES or x.dtype != output.dtype or not output.is_contiguous():
        return None
    ops = cpu_native.ops_for(x)
    if ops is None or x.device.type != "cpu":
        return None
    return getattr(ops, "lora_bgmv_", None)


def lora_of(module: Any) -> _SlotStacks | None:
    return getattr(module, "lora", None)
