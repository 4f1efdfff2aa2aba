"""The batched LoRA delta of one linear layer, exactly: tokens of different slots (and of the
base model) in one flat batch each get their own adapter's ``x @ A.T @ B.T`` added to the base
output, on the fused QKV shards as on a plain projection; nothing changes while no token has one.
The same for the token embedding (``B @ A[:, token]``) and the LM head (one row per selected
token), with a tied head and embedding each keeping its own adapter."""

from __future__ import annotations

import pytest
import torch

from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenloom.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenloom.lora.layers import EmbeddingLoRA, LinearLoRA, LogitsLoRA, LoRABatchState


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
    lora.set_slot(0, 0, torch.ones(1, 4), torch.ones(4, 1))
    state.set_batch([0, 0])
    with pytest.raises(RuntimeError, match="for a batch of 2 tokens"):
        lora.add_delta(torch.zeros(3, 4), torch.zeros(3, 4))


def test_a_layer_no_adapter_of_the_step_targets_adds_nothing():
    state = LoRABatchState(max_loras=2, max_rank=2, dtype=torch.float64)
    lora = LinearLoRA(4, 4, [(0, 4)], state)
    lora.set_slot(1, 0, randn(2, 4, seed=1), randn(4, 2, seed=2))
    output = randn(2, 4, seed=3)
    state.set_batch([0, -1])  # slot 0's adapter leaves this layer alone
    assert not lora.applies() and lora.add_delta(randn(2, 4, seed=4), output) is output
    state.set_batch([0, 1])
    assert lora.applies()
    state.end_forward()
    assert not lora.applies()


def tied_embedding_and_head(vocab=10, dim=6, max_loras=3, max_rank=4):
    embedding = VocabParallelEmbedding(vocab, dim, params_dtype=torch.float64)
    embedding.weight.data.copy_(randn(vocab, dim, seed=0))
    head = ParallelLMHead(vocab, dim, params_dtype=torch.float64)
    head.tie_to(embedding)
    state = LoRABatchState(max_loras=max_loras, max_rank=max_rank, dtype=torch.float64)
    embedding.lora = EmbeddingLoRA(vocab, dim, [(0, 0)], state)
    head.lora = LogitsLoRA(dim, vocab, [(0, vocab)], state)
    return embedding, head, state


def test_embedding_rows_get_their_own_slots_delta():
    embedding, head, state = tied_embedding_and_head()
    assert embedding.lora.lora_a is None  # nothing held until an adapter targets the embedding
    adapters = {
        slot: (randn(rank, 10, seed=10 + slot), randn(6, rank, seed=20 + slot)) for slot, rank in [(0, 3), (2, 4)]
    }
    for slot, (lora_a, lora_b) in adapters.items():
        embedding.lora.set_slot(slot, 0, lora_a, lora_b)
    input_ids = torch.tensor([3, 7, 3, 0, 9])
    token_slots = [0, -1, 2, 2, 0]
    base = embedding.weight[input_ids]
    state.set_batch(token_slots)
    expected = base.clone()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            lora_a, lora_b = adapters[slot]
            expected[row] += lora_b @ lora_a[:, input_ids[row]]
    torch.testing.assert_close(embedding(input_ids), expected, rtol=1e-12, atol=1e-12)
    # the tied head multiplies the base weight, untouched by the embedding's adapter
    hidden = randn(2, 6, seed=5)
    state.select_rows(torch.tensor([0, 2]))
    assert torch.equal(head.compute_logits(hidden), (hidden @ embedding.weight.T).float())


def test_lm_head_rows_get_the_slot_of_the_token_they_come_from():
    embedding, head, state = tied_embedding_and_head()
    adapters = {
        slot: (randn(rank, 6, seed=30 + slot), randn(10, rank, seed=40 + slot)) for slot, rank in [(1, 2), (2, 4)]
    }
    for slot, (lora_a, lora_b) in adapters.items():
        head.lora.set_slot(slot, 0, lora_a, lora_b)
    state.set_batch([1, 1, 1, -1, 2, 2])  # three requests' tokens: 3 of slot 1, 1 base, 2 of slot 2
    input_ids = torch.tensor([1, 2, 3, 4, 5, 6])
    assert torch.equal(embedding(input_ids), embedding.weight[input_ids])  # the head's adapter only
    state.end_forward()
    hidden = randn(3, 6, seed=6)
    rows = torch.tensor([2, 3, 5])  # each request's last token
    state.select_rows(rows)
    logits = head.compute_logits(hidden)
    expected = hidden @ embedding.weight.T
    for row, slot in enumerate([1, -1, 2]):
        if slot >= 0:
            lora_a, lora_b = adapters[slot]
            expected[row] += lora_b @ lora_a @ hidden[row]
    torch.testing.assert_close(logits, expected.float())
    # the selection is used once: a later call (a drafter's) gets the base head
    assert torch.equal(head.compute_logits(hidden), (hidden @ embedding.weight.T).float())
    state.select_rows(rows[:2])
    with pytest.raises(RuntimeError, match="got 3 rows for a batch of 2 tokens"):
        head.compute_logits(hidden)
