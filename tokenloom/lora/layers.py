"""The LoRA path beside a linear layer, the token embedding and the LM head: each adaptable
layer gets a LoRA object holding every slot's ``A`` and ``B`` stacked, and adds each token's
own adapter's delta to the base output. The base computation is untouched (float,
oneDNN-packed or int4/int8 GGUF alike): the delta is a second, small product added to its output.

The torch form (vLLM's punica BGMV, by slot): the step's tokens are grouped by slot once, and
each used slot's tokens get ``x @ A_slot.T @ B_slot.T`` added to their rows; base-model tokens
are never touched. A token's result is computed from its own slot's weights only, never by
multiplying another slot's by zero: an adapter whose weights are (or whose products become)
inf or nan would turn ``0 * inf`` into nan in every row of the batch (issue 37). The cost
follows the adapters in the batch, not ``--max-loras``.

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
    model), grouped by slot once per step and shared."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.active = False  # some token of this step's forward runs an adapter
        self.num_used_slots = 0
        self.used_slots: frozenset[int] = frozenset()
        self._token_slots: torch.Tensor | None = None  # kept after the forward, for the logits rows
        self._groups: list[tuple[int, torch.Tensor | None]] | None = None
        self._row_slots: torch.Tensor | None = None

    def set_batch(self, token_slots: list[int]) -> None:
        """This step's slot per token, in batch order."""
        self._groups = None
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
        self._groups = None

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

    def slot_groups(self) -> list[tuple[int, torch.Tensor | None]]:
        """The step's tokens by slot: ``(slot, token indices)`` for each used slot, the indices
        None when the slot has every token of the step (no gather, no scatter)."""
        if self._groups is None:
            assert self._token_slots is not None  # only asked for while active
            self._groups = self.groups_for(self._token_slots)
        return self._groups

    @staticmethod
    def groups_for(slots: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in sorted({slot for slot in slots.tolist() if slot >= 0}):
            rows = (slots == slot).nonzero().squeeze(1)
            groups.append((slot, None if rows.shape[0] == slots.shape[0] else rows))
        return groups


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

    def _slot_columns(self, slot: int) -> slice:
        """The stacks' columns (A's rows) of ``slot``: all its shards, each ``max_rank`` wide."""
        return slice(self._columns(slot, 0), self._columns(slot + 1, 0))

    def _add_by_slot(
        self, output: torch.Tensor, groups: list[tuple[int, torch.Tensor | None]], delta_of
    ) -> torch.Tensor:
        """``output`` plus, for each slot this layer holds, ``delta_of(slot, rows)`` on its rows
        (a new tensor: the base output may be shared)."""
        added = False
        for slot, rows in groups:
            if not self._filled[slot]:
                continue
            delta = delta_of(slot, rows).to(output.dtype)
            if rows is None:
                output = output.add_(delta) if added else output + delta
            else:
                output = output.index_add_(0, rows, delta) if added else output.index_add(0, rows, delta)
            added = True
        return output

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
        return self.add_delta_torch(x, output)

    def add_delta_torch(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """The torch path of :meth:`add_delta` (a new tensor), slot by slot."""
        return self._add_by_slot(output, self.state.slot_groups(), lambda slot, rows: self._delta(x, slot, rows))

    def _delta(self, x: torch.Tensor, slot: int, rows: torch.Tensor | None) -> torch.Tensor:
        """``x[rows] @ A_slot.T @ B_slot.T``: the slot's own columns only."""
        columns = self._slot_columns(slot)
        x_rows = x if rows is None else x.index_select(0, rows)
        projected = F.linear(x_rows.to(self.state.dtype), self.lora_a[columns])
        return F.linear(projected, self.lora_b[:, columns])


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
        groups = self.state.groups_for(row_slots)
        return self._add_by_slot(output, groups, lambda slot, rows: self._delta(x, slot, rows))


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
        flat_ids = input_ids.reshape(-1)
        self._check_rows(flat_ids.shape[0], self.state.num_tokens)
        flat_output = output.reshape(flat_ids.shape[0], -1)

        def delta_of(slot: int, rows: torch.Tensor | None) -> torch.Tensor:
            columns = self._slot_columns(slot)
            ids = flat_ids if rows is None else flat_ids.index_select(0, rows)
            return F.linear(F.embedding(ids, self.lora_a[:, columns]), self.lora_b[:, columns])

        return self._add_by_slot(flat_output, self.state.slot_groups(), delta_of).reshape(output.shape)


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
