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


def tied_embedding_and_head(vocab=10, dim=6, max_loras=3, max_rank=4, dtype=torch.float64):
    embedding = VocabParallelEmbedding(vocab, dim, params_dtype=dtype)
    embedding.weight.data.copy_(randn(vocab, dim, seed=0))
    head = ParallelLMHead(vocab, dim, params_dtype=dtype)
    head.tie_to(embedding)
    state = LoRABatchState(max_loras=max_loras, max_rank=max_rank, dtype=dtype)
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


# -- a broken adapter stays in its own rows (issue 37, item 3) ------------------------------------
# 3e38 is finite in float32 and bfloat16, but its products overflow: the other rows must be
# computed without ever meeting the bad slot's values (0 * inf and 0 * nan are nan)
BAD_VALUES = [float("nan"), 3e38]


def _without_slot(lora, slot, run):
    """``run()`` with ``slot`` emptied, then the slot's contents put back."""
    saved_a, saved_b = lora.lora_a.clone(), lora.lora_b.clone()
    lora.clear_slot(slot)
    try:
        return run()
    finally:
        lora.lora_a.copy_(saved_a)
        lora.lora_b.copy_(saved_b)
        lora._filled[slot] = True


@pytest.mark.parametrize("bad_value", BAD_VALUES)
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_a_non_finite_slot_leaves_the_other_rows_of_a_linear_layer_alone(bad_value, native, monkeypatch):
    from tokenloom.lora import layers

    if not native:
        monkeypatch.setattr(layers, "_native_bgmv", lambda x, output: None)
    elif layers._native_bgmv(torch.zeros(1, 8), torch.zeros(1, 6)) is None:
        pytest.skip("tokenloom's CPU kernels are not built")
    state = LoRABatchState(max_loras=3, max_rank=4, dtype=torch.float32)
    lora = LinearLoRA(8, 6, [(0, 6)], state)
    lora.set_slot(0, 0, randn(2, 8, seed=1).float(), randn(6, 2, seed=2).float())
    lora.set_slot(1, 0, torch.full((4, 8), bad_value), torch.full((6, 4), bad_value))
    x, base = randn(5, 8, seed=3).float(), randn(5, 6, seed=4).float()
    token_slots = [0, -1, 1, 0, -1]
    state.set_batch(token_slots)
    output = lora.add_delta(x, base.clone())
    clean = _without_slot(lora, 1, lambda: lora.add_delta(x, base.clone()))
    others = [row for row, slot in enumerate(token_slots) if slot != 1]
    assert torch.isfinite(output[others]).all()
    assert torch.equal(output[others], clean[others])
    assert torch.equal(output[[1, 4]], base[[1, 4]])  # base-model rows: nothing added


@pytest.mark.parametrize("bad_value", BAD_VALUES)
def test_a_non_finite_slot_leaves_the_other_rows_of_the_embedding_and_head_alone(bad_value):
    embedding, head, state = tied_embedding_and_head(dtype=torch.float32)
    for lora in (embedding.lora, head.lora):
        rows, columns = (10, 6) if lora is embedding.lora else (6, 10)
        lora.set_slot(0, 0, randn(3, rows, seed=50).float(), randn(columns, 3, seed=51).float())
        lora.set_slot(2, 0, torch.full((4, rows), bad_value), torch.full((columns, 4), bad_value))
    input_ids = torch.tensor([3, 7, 3, 0, 9])
    token_slots = [0, -1, 2, 2, 0]
    others = [0, 1, 4]
    state.set_batch(token_slots)
    looked_up = embedding(input_ids)
    clean = _without_slot(embedding.lora, 2, lambda: embedding(input_ids))
    assert torch.isfinite(looked_up[others]).all() and torch.equal(looked_up[others], clean[others])
    state.end_forward()
    hidden = randn(3, 6, seed=6).float()
    rows = torch.tensor([0, 1, 3])  # slots 0, -1, 2

    def logits():
        state.select_rows(rows)
        return head.compute_logits(hidden)

    adapted, clean_logits = logits(), _without_slot(head.lora, 2, logits)
    assert torch.isfinite(adapted[:2]).all() and torch.equal(adapted[:2], clean_logits[:2])
