"""Vocabulary-parallel embedding and LM head: lookup, logits, tying, the vocabulary split
of tensor parallelism (per-rank partial lookups sum to the full one)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.kernels.onednn_linear import packable
from tokenloom.layers import embedding as embedding_module
from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding, vocab_range


def table(rows=10, dim=4):
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))


def test_lookup_and_tied_logits():
    weights = table()
    embedding = VocabParallelEmbedding(10, 4)
    embedding.load_checkpoint_weight("weight", weights)
    ids = torch.tensor([3, 0, 9])
    torch.testing.assert_close(embedding(ids), weights[ids])
    head = ParallelLMHead(10, 4)
    head.tie_to(embedding)
    assert head.weight is embedding.weight
    hidden = torch.randn(2, 4)
    logits = head.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ weights.T)


def test_untied_head_with_bias_and_bfloat16_logits_are_float32():
    head = ParallelLMHead(10, 4, bias=True, params_dtype=torch.bfloat16)
    head.load_checkpoint_weight("weight", table())
    head.load_checkpoint_weight("bias", torch.arange(10.0))
    logits = head.compute_logits(torch.randn(3, 4, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32 and logits.shape == (3, 10)


def test_a_float32_head_answers_small_batches_from_its_float16_copy_after_loading():
    weights = table(rows=40, dim=8)
    embedding = VocabParallelEmbedding(40, 8)
    embedding.load_checkpoint_weight("weight", weights)
    head = ParallelLMHead(40, 8, small_batch_dtype=torch.float16)
    head.tie_to(embedding)
    few = torch.randn(embedding_module.SMALL_BATCH_ROWS, 8)
    assert torch.equal(head.compute_logits(few), torch.nn.functional.linear(few, weights))  # no copy yet
    head.process_weights_after_loading()
    assert head.small_batch_weight.dtype == torch.float16 and torch.equal(head.small_batch_weight, weights.half())
    logits = head.compute_logits(few)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(few.half(), weights.half()).float())
    torch.testing.assert_close(logits, few @ weights.T, atol=0.02, rtol=0.01)
    many = torch.randn(embedding_module.SMALL_BATCH_ROWS + 1, 8)
    # the float32 head itself (oneDNN-packed: float32 up to summation order)
    torch.testing.assert_close(
        head.compute_logits(many), torch.nn.functional.linear(many, weights), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize(
    "onednn_bfloat16",
    [
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not packable(torch.zeros(2, 2, dtype=torch.bfloat16)),
                reason="oneDNN has no bfloat16 matmul on this CPU (no AVX512-BF16/AMX)",
            ),
        ),
        False,
    ],
)
def test_a_head_multiplies_its_packed_copy_and_keeps_the_embedding_dense(onednn_bfloat16, monkeypatch):
    """Where oneDNN multiplies bfloat16 (AVX512-BF16 / AMX) the head keeps a packed copy; on other
    CPUs (an AVX2 one, emulated here) it multiplies the dense table, with the same logits."""
    if not onednn_bfloat16:
        monkeypatch.setattr(embedding_module, "packable", lambda weight: False)
    weights = table(rows=40, dim=8).bfloat16()
    embedding = VocabParallelEmbedding(40, 8, params_dtype=torch.bfloat16)
    embedding.load_checkpoint_weight("weight", weights)
    head = ParallelLMHead(40, 8, params_dtype=torch.bfloat16)
    head.tie_to(embedding)
    head.process_weights_after_loading()
    if onednn_bfloat16:
        assert head.packed_weight.is_mkldnn and torch.equal(head.packed_weight.to_dense(), weights)
    else:
        assert head.packed_weight is None and head.weight is embedding.weight
    assert not embedding.weight.is_mkldnn  # the lookup still reads the dense table
    for rows in (1, 5):
        hidden = torch.randn(rows, 8).bfloat16()
        torch.testing.assert_close(
            head.compute_logits(hidden), torch.nn.functional.linear(hidden, weights).float(), atol=0, rtol=0
        )


def test_hidden_states_beyond_float16_range_take_the_wide_path():
    weights = table(rows=40, dim=8)
    head = ParallelLMHead(40, 8, small_batch_dtype=torch.float16)
    head.load_checkpoint_weight("weight", weights)
    head.process_weights_after_loading()
    huge = torch.full((1, 8), 1e5)
    logits = head.compute_logits(huge)
    assert torch.isfinite(logits).all()  # the float16 copy would overflow to inf
    # float32 up to summation order: the packed oneDNN matmul and F.linear add the eight products
    # of about 1e5 in their own orders (1.4e-6 apart with oneDNN held to AVX2)
    torch.testing.assert_close(logits, torch.nn.functional.linear(huge, weights), atol=0, rtol=1e-5)


def test_heads_keep_no_copy_by_default_or_in_their_own_dtype():
    for head in (ParallelLMHead(10, 4), ParallelLMHead(10, 4, small_batch_dtype=torch.float32)):
        head.load_checkpoint_weight("weight", table())
        head.process_weights_after_loading()
        assert head.small_batch_weight is None


def test_the_padded_tail_of_a_split_vocabulary_starts_at_zero():
    # 10 tokens over 3 ranks: 4 rows each, the last rank holds 2 tokens and 2 zero rows
    assert torch.equal(VocabParallelEmbedding(10, 4, tp_rank=2, tp_size=3).weight[2:], torch.zeros(2, 4))


def test_vocab_ranges_cover_the_vocabulary_once():
    assert [vocab_range(10, rank, 3) for rank in range(3)] == [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(ConfigError):
        vocab_range(10, 3, 3)


def test_tensor_parallel_partial_lookups_sum_to_the_full_lookup(monkeypatch):
    monkeypatch.setattr(embedding_module, "tensor_parallel_all_reduce", lambda tensor, tp_group, tp_size: tensor)
    weights = table(10)
    ids = torch.tensor([0, 3, 4, 9, 7])
    total = torch.zeros(5, 4)
    for rank in range(3):
        shard = VocabParallelEmbedding(10, 4, tp_rank=rank, tp_size=3)
        assert shard.weight.shape == (4, 4)
        shard.load_checkpoint_weight("weight", weights)
        total += shard(ids)
    torch.testing.assert_close(total, weights[ids])


def test_load_errors():
    with pytest.raises(ModelLoadError, match="does not fit"):
        VocabParallelEmbedding(10, 4).load_checkpoint_weight("weight", torch.zeros(10, 5))
    with pytest.raises(ConfigError, match="tie"):
        ParallelLMHead(10, 4).tie_to(VocabParallelEmbedding(12, 4))
    with pytest.raises(TypeError, match="compute_logits"):
        ParallelLMHead(10, 4)(torch.tensor([1]))
