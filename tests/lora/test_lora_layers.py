"""The batched LoRA delta of one linear layer, exactly: tokens of different slots (and of the
base model) in one flat batch each get their own adapter's ``x @ A.T @ B.T`` added to the base
output, on the fused QKV shards as on a plain projection; nothing changes while no token has one."""

from __future__ import annotations

import pytest
import torch

from tokenloom.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenloom.lora.layers import LinearLoRA, LoRABatchState


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_mixed_slots_get_their_own_delta_on_a_plain_projection():
    layer = RowParallelLinear(8, 6, params_dtype=torch.float64)
    layer.weight.data.copy_(randn(6, 8, seed=0))
    state = LoRABatchState(max_loras=3, max_rank=4, dtype=torch.float64)
    layer.lora = LinearLoRA(8, 6, [(0, 6)], state)
    adapters = {
        slot: (randn(rank, 8, seed=10 + slot), randn(6, rank, seed=20 + slot)) for slot, rank in [(0, 2), (2, 4)]
    }
    for slot, (lora_a, lora_b) in adapters.items():
        layer.lora.set_slot(slot, 0, lora_a, lora_b)
    x = randn(5, 8, seed=1)
    token_slots = [0, -1, 2, 2, 0]
    base = x @ layer.weight.T
    state.set_batch([-1] * 5)
    assert torch.equal(layer(x), base)
    state.set_batch(token_slots)
    expected = base.clone()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            lora_a, lora_b = adapters[slot]
            expected[row] += x[row] @ lora_a.T @ lora_b.T
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    layer.lora.clear_slot(2)
    assert torch.allclose(layer(x)[2], base[2])


def test_qkv_shards_each_get_their_projection():
    layer = QKVParallelLinear(8, 2, 4, 2, params_dtype=torch.float64)  # q 8 rows, k 4, v 4
    layer.weight.data.zero_()
    state = LoRABatchState(max_loras=2, max_rank=2, dtype=torch.float64)
    shards = [layer.shard_rows(shard)[:2] for shard in layer.shard_ids]
    assert shards == [(0, 8), (8, 4), (12, 4)]
    layer.lora = LinearLoRA(8, 16, shards, state)
    lora_q = (randn(2, 8, seed=1), randn(8, 2, seed=2))
    lora_v = (randn(1, 8, seed=3), randn(4, 1, seed=4))
    layer.lora.set_slot(1, 0, *lora_q)
    layer.lora.set_slot(1, 2, *lora_v)
    x = randn(3, 8, seed=5)
    state.set_batch([1, -1, 1])
    out = layer(x)
    for row in (0, 2):
        torch.testing.assert_close(out[row, :8], x[row] @ lora_q[0].T @ lora_q[1].T)
        assert torch.equal(out[row, 8:12], torch.zeros(4, dtype=torch.float64))  # k is not adapted
        torch.testing.assert_close(out[row, 12:], x[row] @ lora_v[0].T @ lora_v[1].T)
    assert torch.equal(out[1], torch.zeros(16, dtype=torch.float64))


def test_a_batch_that_does_not_match_the_step_is_an_error():
    state = LoRABatchState(max_loras=1, max_rank=2, dtype=torch.float32)
    lora = LinearLoRA(4, 4, [(0, 4)], state)
    state.set_batch([0, 0])
    with pytest.raises(RuntimeError, match="for a batch of 2 tokens"):
        lora.add_delta(torch.zeros(3, 4), torch.zeros(3, 4))
