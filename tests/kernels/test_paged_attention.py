"""Paged attention: the reference against dense attention over whole sequences (no paging),
and the fast CPU backend against the reference, over mixed prefill / chunked-prefill /
decode batches with GQA, sliding windows, logit soft-capping and scattered blocks."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from unittest import mock

import pytest
import torch
from helpers.attention import allocate_kv_caches, build_attention_metadata
from helpers.isa_levels import at_the_host_level, once_and_per_level
from helpers.threads import torch_threads
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.errors import ConfigError
from tokenloom.kernels import paged_attention
from tokenloom.kernels.paged_attention import (
    NativeCpuPagedAttention,
    ReferencePagedAttention,
    TorchPagedAttention,
    attention_allowed,
    reference_paged_attention,
    write_kv_cache,
)

BLOCK_SIZE = 4

# on every CPU kernel level the host runs
pytestmark = pytest.mark.usefixtures("isa_level")

# every fast backend must equal the reference: the torch one and the native CPU kernels' one
# (built by `make install`; the test builds them when they are not cached)
FAST_BACKENDS = [pytest.param(TorchPagedAttention, id="torch"), pytest.param(NativeCpuPagedAttention, id="native")]
# the same where the torch backend's path holds no native operator (float32, or decodes): the torch
# one once (its code is the same at every level), the native one at every level
FAST_BACKENDS_ONCE_AND_PER_LEVEL = once_and_per_level(
    "backend_class", TorchPagedAttention, NativeCpuPagedAttention, ("torch", "native")
)


def dense_attention(query, keys, values, query_positions, *, scale, window, soft_cap, causal=True):
    """Textbook attention of ``query [Q, Hq, D]`` at ``query_positions`` over a whole
    sequence's ``keys/values [L, Hkv, D]``: nothing paged, explicit additive mask."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    bias = torch.zeros(len(query_positions), keys.shape[0])
    for row, position in enumerate(query_positions):
        for column in range(keys.shape[0]):
            visible = column <= position if causal else True
            if window is not None:
                visible = visible and abs(position - column) < window
            if not visible:
                bias[row, column] = float("-inf")
    return torch.einsum("hqk,khd->qhd", (scores + bias).softmax(-1), values)


def make_step(seq_specs, num_q_heads, num_kv_heads, head_size, dtype, seed, num_blocks=64):
    """``seq_specs``: per sequence (context_len, query_len). Returns the full per-sequence
    tensors, a cache holding every sequence's context, and the metadata of the step that
    computes the ``query_len`` new tokens."""
    generator = torch.Generator().manual_seed(seed)
    kv_cache = allocate_kv_caches(1, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype)[0]
    free_blocks = list(range(num_blocks))
    random.Random(seed).shuffle(free_blocks)
    sequences, tables = [], []
    for context_len, query_len in seq_specs:
        seq_len = context_len + query_len
        table = [free_blocks.pop() for _ in range(math.ceil(seq_len / BLOCK_SIZE))]
        keys = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(dtype)
        queries = torch.randn(seq_len, num_q_heads, head_size, generator=generator).to(dtype)
        if context_len:
            context = build_attention_metadata([context_len], [context_len], [table], BLOCK_SIZE, [kv_cache])
            write_kv_cache(keys[:context_len], values[:context_len], kv_cache, context.slot_mapping)
        sequences.append((context_len, query_len, queries, keys, values))
        tables.append(table)
    metadata = build_attention_metadata(
        [query_len for _, query_len in seq_specs],
        [context_len + query_len for context_len, query_len in seq_specs],
        tables,
        BLOCK_SIZE,
        [kv_cache],
    )
    query = torch.cat([queries[context_len:] for context_len, _, queries, _, _ in sequences])
    key = torch.cat([keys[context_len:] for context_len, _, _, keys, _ in sequences])
    value = torch.cat([values[context_len:] for context_len, _, _, _, values in sequences])
    return sequences, kv_cache, metadata, (query, key, value)


MIXED_BATCHES = [
    [(0, 7), (0, 1), (5, 1), (9, 1)],  # prefill without context next to decodes
    [(6, 5), (13, 1), (0, 9)],  # chunked prefill over a cached prefix
    [(3, 1), (10, 1), (17, 1), (0, 1)],  # decode only, ragged lengths
    [(12, 12)],  # one long chunk
]


@pytest.mark.parametrize("specs", MIXED_BATCHES)
@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)])
@at_the_host_level()
def test_reference_matches_dense_attention(specs, window, heads):
    num_q_heads, num_kv_heads = heads
    sequences, kv_cache, metadata, (query, key, value) = make_step(
        specs, num_q_heads, num_kv_heads, 8, torch.float32, 0
    )
    output = reference_paged_attention(query, key, value, kv_cache, metadata, scale=0.3, sliding_window=window)
    start = 0
    for context_len, query_len, queries, keys, values in sequences:
        expected = dense_attention(
            queries[context_len:],
            keys,
            values,
            list(range(context_len, context_len + query_len)),
            scale=0.3,
            window=window,
            soft_cap=None,
        )
        torch.testing.assert_close(output[start : start + query_len], expected, atol=1e-5, rtol=1e-5)
        start += query_len


@at_the_host_level()
def test_reference_soft_cap_matches_dense_attention():
    sequences, kv_cache, metadata, (query, key, value) = make_step([(5, 3), (0, 4)], 4, 2, 8, torch.float32, 1)
    output = reference_paged_attention(query, key, value, kv_cache, metadata, scale=2.0, logits_soft_cap=1.5)
    context_len, query_len, queries, keys, values = sequences[0]
    expected = dense_attention(queries[5:], keys, values, [5, 6, 7], scale=2.0, window=None, soft_cap=1.5)
    torch.testing.assert_close(output[:3], expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _forget_memoised_references():
    """The memoised references below live while this module runs (every level), not the session."""
    yield
    for memoised in (
        _mixed_batch_reference,
        _float32_decode_reference,
        _windowed_decode_reference,
        _fp8_decode_reference,
    ):
        memoised.cache_clear()


@functools.cache
def _mixed_batch_reference(specs, window, heads, soft_cap):
    """One mixed step and the reference's output and cache for it, computed once per shape and
    shared by every backend and CPU kernel level that is checked against them (the step and the
    reference are torch code, the same at every level)."""
    num_q_heads, num_kv_heads = heads
    _, kv_cache, metadata, (query, key, value) = make_step(list(specs), num_q_heads, num_kv_heads, 16, torch.float32, 2)
    reference_cache = kv_cache.clone()
    expected = reference_paged_attention(
        query, key, value, reference_cache, metadata, scale=0.25, sliding_window=window, logits_soft_cap=soft_cap
    )
    return _Reference(query, key, value, kv_cache, metadata, expected, reference_cache)


@dataclasses.dataclass(frozen=True, eq=False)
class _Reference:
    """A memoised step and the reference's result for it."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: object
    expected: torch.Tensor
    reference_cache: torch.Tensor

    def for_one_test(self):
        """The step with its own copy of the KV cache (the backend under test writes into it), so
        the memoised inputs and results stay as the reference left them."""
        kv_cache = self.kv_cache.clone()
        metadata = dataclasses.replace(self.metadata, kv_caches=[kv_cache])
        return self.query, self.key, self.value, kv_cache, metadata, self.expected, self.reference_cache


@pytest.mark.parametrize("specs", MIXED_BATCHES)
@pytest.mark.parametrize("window", [None, 2, 5, 64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@FAST_BACKENDS_ONCE_AND_PER_LEVEL
def test_fast_backend_matches_reference(specs, window, heads, soft_cap, backend_class):
    query, key, value, kv_cache, metadata, expected, reference_cache = _mixed_batch_reference(
        tuple(specs), window, heads, soft_cap
    ).for_one_test()
    output = backend_class().forward(
        query, key, value, kv_cache, metadata, scale=0.25, sliding_window=window, logits_soft_cap=soft_cap
    )
    torch.testing.assert_close(output, expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(kv_cache, reference_cache, atol=0, rtol=0)


@pytest.mark.parametrize("window", [5, None])
# the decode batch, and a causal prompt long enough for the batched-matmul path next to decodes
@pytest.mark.parametrize("specs", [MIXED_BATCHES[0], MIXED_BATCHES[2], [(0, 70), (8, 1), (3, 1)]])
@pytest.mark.parametrize("backend_class", FAST_BACKENDS)
def test_fast_backend_bfloat16_close_to_reference(specs, window, backend_class):
    _, kv_cache, metadata, (query, key, value) = make_step(specs, 8, 2, 16, torch.bfloat16, 3)
    expected = reference_paged_attention(
        query, key, value, kv_cache.clone(), metadata, scale=0.25, sliding_window=window
    )
    output = backend_class().forward(query, key, value, kv_cache, metadata, scale=0.25, sliding_window=window)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend_class", FAST_BACKENDS)
def test_causal_prompts_share_one_scores_buffer_with_the_bits_of_a_fresh_one(backend_class):
    # prompts on the two-matmul path (64-384 tokens), the longest first and a shorter after it:
    # the second reuses the first's buffer, and a later step finds the same buffer again
    specs = [(0, 100), (0, 70), (3, 1)]
    _, kv_cache, metadata, (query, key, value) = make_step(specs, 8, 2, 16, torch.bfloat16, 5, num_blocks=64)
    backend = backend_class()
    output = backend.forward(query, key, value, kv_cache, metadata, scale=0.25)
    buffer = backend._scores
    assert buffer is not None and buffer.numel() == 8 * 100 * 100 and buffer.dtype == torch.bfloat16
    start = 0
    for _, query_len in specs[:2]:
        tokens = slice(start, start + query_len)
        alone = paged_attention._causal_attention_bmm(query[tokens], key[tokens], value[tokens], 0.25)
        assert torch.equal(output[tokens], alone)
        start += query_len
    again = backend.forward(query, key, value, kv_cache, metadata, scale=0.25)
    assert backend._scores is buffer and torch.equal(again, output)


@at_the_host_level()
def test_plan_is_reused_per_step_and_per_window():
    _, kv_cache, metadata, (query, key, value) = make_step(MIXED_BATCHES[0], 4, 2, 8, torch.float32, 4)
    backend = TorchPagedAttention()
    expected_full = reference_paged_attention(query, key, value, kv_cache.clone(), metadata, scale=0.5)
    expected_window = reference_paged_attention(
        query, key, value, kv_cache.clone(), metadata, scale=0.5, sliding_window=2
    )
    # alternate windows like Gemma's local/global layers within one step
    for _ in range(2):
        full = backend.forward(query, key, value, kv_cache, metadata, scale=0.5)
        windowed = backend.forward(query, key, value, kv_cache, metadata, scale=0.5, sliding_window=2)
        torch.testing.assert_close(full, expected_full, atol=2e-6, rtol=2e-5)
        torch.testing.assert_close(windowed, expected_window, atol=2e-6, rtol=2e-5)
    assert set(backend._plans) == {None, 2}


@pytest.mark.parametrize("window", [None, 3])
def test_bidirectional_attends_both_ways_and_skips_the_cache(window):
    generator = torch.Generator().manual_seed(5)
    query_lens = [5, 3]
    query = torch.randn(8, 4, 8, generator=generator)
    key = torch.randn(8, 2, 8, generator=generator)
    value = torch.randn(8, 2, 8, generator=generator)
    kv_cache = allocate_kv_caches(1, 8, BLOCK_SIZE, 2, 8)[0]
    untouched = kv_cache.clone()
    metadata = build_attention_metadata(
        query_lens, query_lens, [[0, 1], [2]], BLOCK_SIZE, [kv_cache], bidirectional=True
    )
    for attention in (reference_paged_attention, TorchPagedAttention().forward, NativeCpuPagedAttention().forward):
        output = attention(query, key, value, kv_cache, metadata, scale=0.4, sliding_window=window)
        start = 0
        for query_len in query_lens:
            tokens = slice(start, start + query_len)
            expected = dense_attention(
                query[tokens],
                key[tokens],
                value[tokens],
                list(range(query_len)),
                scale=0.4,
                window=window,
                soft_cap=None,
                causal=False,
            )
            torch.testing.assert_close(output[tokens], expected, atol=1e-5, rtol=1e-5)
            start += query_len
    torch.testing.assert_close(kv_cache, untouched, atol=0, rtol=0)


def test_reference_backend_object_runs_a_model_like_the_fast_one():
    from helpers.model_parity import build_model, run_paged_greedy
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from tokenloom.builtin_plugins.models.modeling_llama import LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model, _ = build_model(LlamaForCausalLM, config, HFLlama(config).state_dict().items())
    prompts = [[1, 5, 9, 3, 7], [2, 8]]
    fast = run_paged_greedy(model, prompts, 4)
    reference = run_paged_greedy(model, prompts, 4, backend=ReferencePagedAttention())
    for (fast_tokens, fast_logits), (reference_tokens, reference_logits) in zip(fast, reference):
        assert fast_tokens == reference_tokens
        torch.testing.assert_close(fast_logits, reference_logits, atol=1e-5, rtol=1e-5)


def test_attention_allowed_window_keeps_the_last_positions():
    allowed = attention_allowed(torch.tensor([5]), torch.arange(8), causal=True, sliding_window=3)
    assert allowed[0].tolist() == [False, False, False, True, True, True, False, False]


def test_write_kv_cache_rejects_a_non_contiguous_cache():
    cache = torch.zeros(4, 2, 4, 2, 8).transpose(0, 1)
    with pytest.raises(ConfigError, match="contiguous"):
        write_kv_cache(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), cache, torch.tensor([0]))


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(0, 14), st.integers(1, 9)), min_size=1, max_size=5),
    window=st.one_of(st.none(), st.integers(1, 12)),
    group_size=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
    group_overhead=st.sampled_from([0, 1 << 17]),
    backend_class=st.sampled_from([TorchPagedAttention, NativeCpuPagedAttention]),
)
def test_fast_backend_matches_reference_on_random_batches(
    specs, window, group_size, seed, group_overhead, backend_class
):
    _, kv_cache, metadata, (query, key, value) = make_step(
        specs, 2 * group_size, 2, 8, torch.float32, seed, num_blocks=40
    )
    reference_cache = kv_cache.clone()
    expected = reference_paged_attention(query, key, value, reference_cache, metadata, scale=0.3, sliding_window=window)
    with mock.patch.object(paged_attention, "_GROUP_OVERHEAD_ELEMENTS", group_overhead):
        output = backend_class().forward(query, key, value, kv_cache, metadata, scale=0.3, sliding_window=window)
    torch.testing.assert_close(output, expected, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(kv_cache, reference_cache, atol=0, rtol=0)


def test_group_by_length_keeps_similar_lengths_together():
    blocks = {"a": 1, "b": 2, "c": 3, "d": 8, "e": 9, "f": 40}
    assert paged_attention._group_by_length(list(blocks), blocks, elements_per_block=10**9) == [
        ["a", "b"],
        ["c"],
        ["d", "e"],
        ["f"],
    ]
    # when padding is cheaper than another call, the groups fold into the longer ones
    assert paged_attention._group_by_length(list(blocks), blocks, elements_per_block=1) == [list(blocks)]


@pytest.mark.parametrize("window", [None, 6])
@at_the_host_level()
def test_ragged_decode_groups_match_reference(monkeypatch, window):
    monkeypatch.setattr(paged_attention, "_GROUP_OVERHEAD_ELEMENTS", 0)
    specs = [(30, 1), (2, 1), (0, 5), (13, 1), (3, 1), (29, 1)]
    _, kv_cache, metadata, (query, key, value) = make_step(specs, 8, 2, 8, torch.float32, 7, num_blocks=48)
    expected = reference_paged_attention(
        query, key, value, kv_cache.clone(), metadata, scale=0.3, sliding_window=window
    )
    backend = TorchPagedAttention()
    output = backend.forward(query, key, value, kv_cache, metadata, scale=0.3, sliding_window=window)
    torch.testing.assert_close(output, expected, atol=2e-6, rtol=2e-5)
    # a window bounds every sequence's blocks, so windowed layers need fewer groups
    # blocks per decode sequence: 8, 1, 4, 1, 8 -> groups {1, 1} and {4, 8, 8}
    assert len(backend._plans[window].decode_groups) == (2 if window is None else 1)


def with_drafts(metadata, num_draft_tokens):
    metadata.num_draft_tokens_cpu = list(num_draft_tokens)
    return metadata


# (context_len, query_len) and the drafts at the end of each query: verifying sequences (the
# pending token and k drafts) alone, ragged, next to decodes, and next to a prefill chunk that the
# torch path keeps; a query longer than 1 + drafts is not a verification and stays a prefill
VERIFY_BATCHES = [
    ([(20, 5)], [4]),
    ([(7, 9), (0, 1), (33, 3)], [8, 0, 2]),
    ([(6, 5), (13, 4), (0, 9)], [4, 3, 0]),
    ([(5, 6), (16, 2)], [3, 1]),
]


@pytest.mark.parametrize("specs, drafts", VERIFY_BATCHES)
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("heads", [(8, 2), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_verification_rows_are_decodes_matching_reference(specs, drafts, window, heads, dtype):
    """A verifying sequence's k + 1 query rows run in the decode kernel, each seeing the cache up
    to its own position (causal among the new rows): the reference's result, and in bfloat16
    each row bit for bit what a one-row decode step at its position gives."""
    num_q_heads, num_kv_heads = heads
    _, kv_cache, metadata, (query, key, value) = make_step(specs, num_q_heads, num_kv_heads, 64, dtype, 11)
    metadata = with_drafts(metadata, drafts)
    reference_cache = kv_cache.clone()
    expected = reference_paged_attention(
        query, key, value, reference_cache, metadata, scale=0.125, sliding_window=window
    )
    backend = NativeCpuPagedAttention()
    output = backend.forward(query, key, value, kv_cache, metadata, scale=0.125, sliding_window=window)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.float(), expected.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(kv_cache, reference_cache, atol=0, rtol=0)
    plan = backend._decode_plan(metadata)
    verifying = [(index, query_len) for index, (_, query_len) in enumerate(specs) if query_len == 1 + drafts[index]]
    assert plan.seq_lens.numel() == sum(query_len for _, query_len in verifying)
    # each verification row equals the decode of that row alone, the cache as it stands now
    starts = [0]
    for _, query_len in specs:
        starts.append(starts[-1] + query_len)
    for index, query_len in verifying:
        context_len = specs[index][0]
        table = metadata.block_tables[index : index + 1].to(torch.long)
        for row in range(query_len):
            token = starts[index] + row
            alone = torch.empty_like(query[token : token + 1])
            backend._ops.paged_decode_attention(
                alone,
                query[token : token + 1],
                kv_cache,
                table,
                torch.tensor([context_len + row + 1]),
                0.125,
                window or 0,
                0.0,
                1.0,
                1.0,
            )
            assert torch.equal(output[token : token + 1], alone)


def test_native_plan_keeps_prefills_and_unverified_queries_on_the_torch_path():
    _, kv_cache, metadata, _ = make_step([(6, 5), (13, 1), (0, 9), (4, 3)], 4, 2, 16, torch.float32, 12)
    metadata = with_drafts(metadata, [4, 0, 0, 1])  # the last query holds more than 1 + its drafts
    backend = NativeCpuPagedAttention()
    plan = backend._decode_plan(metadata)
    assert plan.token_indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.seq_lens.tolist() == [7, 8, 9, 10, 11, 14]
    assert plan.block_tables.tolist() == [metadata.block_tables[0].tolist()] * 5 + [metadata.block_tables[1].tolist()]
    assert backend._make_plan(metadata, None, 1).prefill_seq_indices == [2, 3]
    assert backend.whole_decode_plan(metadata) is None
    only_verifying = with_drafts(make_step([(6, 5), (1, 1)], 4, 2, 16, torch.float32, 13)[2], [4, 0])
    whole = backend.whole_decode_plan(only_verifying)
    assert whole is not None and whole.token_indices is None and whole.seq_lens.tolist() == [7, 8, 9, 10, 11, 2]


def test_native_decode_reads_strided_queries_and_writes_strided_keys():
    """The layers hand the backend views into one fused qkv tensor: rows are strided."""
    specs = [(9, 1), (17, 1), (4, 1)]
    _, kv_cache, metadata, (query, key, value) = make_step(specs, 6, 2, 16, torch.bfloat16, 8)
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    strided_query = fused[:, :96].view(3, 6, 16)
    strided_key = fused[:, 96:128].view(3, 2, 16)
    strided_value = fused[:, 128:].view(3, 2, 16)
    assert not strided_query.is_contiguous()
    reference_cache = kv_cache.clone()
    expected = reference_paged_attention(query, key, value, reference_cache, metadata, scale=0.25)
    output = NativeCpuPagedAttention().forward(
        strided_query, strided_key, strided_value, kv_cache, metadata, scale=0.25
    )
    torch.testing.assert_close(output.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kv_cache, reference_cache, atol=0, rtol=0)


def test_native_write_rejects_a_slot_outside_the_cache():
    ops = NativeCpuPagedAttention()._ops
    cache = torch.zeros(2, 4, BLOCK_SIZE, 2, 8)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        ops.write_kv_cache(torch.ones(1, 2, 8), torch.ones(1, 2, 8), cache, torch.tensor([4 * BLOCK_SIZE]))
    assert cache.abs().sum() == 0


def test_native_decode_rejects_mismatched_dtypes():
    ops = NativeCpuPagedAttention()._ops
    cache = torch.zeros(2, 4, BLOCK_SIZE, 2, 8)
    query = torch.ones(1, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_decode_attention(
            torch.empty_like(query), query, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), 0.5, 0, 0.0
        )


@pytest.mark.parametrize("head_size", [64, 128, 256, 48])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (5, 5), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_decode_head_sizes_groups_and_dtypes(head_size, heads, dtype):
    """Head sizes of 64/128/256 take the kernel's vectorised path (its register tiles of query
    rows leave remainders for groups of 1, 5 and 8), others the generic one; runs of keys are cut
    at 16 positions and at block ends, whatever the sequence length."""
    num_q_heads, num_kv_heads = heads
    specs = [(40, 1), (0, 1), (15, 1), (16, 1), (33, 1)]
    _, kv_cache, metadata, (query, key, value) = make_step(
        specs, num_q_heads, num_kv_heads, head_size, dtype, 9, num_blocks=48
    )
    reference_cache = kv_cache.clone()
    expected = reference_paged_attention(
        query, key, value, reference_cache, metadata, scale=head_size**-0.5, sliding_window=None, logits_soft_cap=None
    )
    output = NativeCpuPagedAttention().forward(query, key, value, kv_cache, metadata, scale=head_size**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.float(), expected.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(kv_cache, reference_cache, atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("window", [None, 1, 17])
@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_native_decode_block_sizes_windows_and_soft_cap(block_size, window, soft_cap):
    from helpers.attention import allocate_kv_caches, build_attention_metadata

    generator = torch.Generator().manual_seed(11)
    seq_lens = [1, 17, 50, 64]
    num_blocks = sum(-(-seq_len // block_size) for seq_len in seq_lens) + 3
    kv_cache = allocate_kv_caches(1, num_blocks, block_size, 2, 64, torch.bfloat16)[0]
    free_blocks = list(range(num_blocks))
    random.Random(3).shuffle(free_blocks)
    tables = [[free_blocks.pop() for _ in range(-(-seq_len // block_size))] for seq_len in seq_lens]
    context = build_attention_metadata(
        [seq_len - 1 for seq_len in seq_lens if seq_len > 1],
        [seq_len - 1 for seq_len in seq_lens if seq_len > 1],
        [table for table, seq_len in zip(tables, seq_lens) if seq_len > 1],
        block_size,
        [kv_cache],
    )
    num_context = sum(seq_len - 1 for seq_len in seq_lens)
    write_kv_cache(
        torch.randn(num_context, 2, 64, generator=generator).bfloat16(),
        torch.randn(num_context, 2, 64, generator=generator).bfloat16(),
        kv_cache,
        context.slot_mapping,
    )
    metadata = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size, [kv_cache])
    query = torch.randn(len(seq_lens), 6, 64, generator=generator).bfloat16()
    key = torch.randn(len(seq_lens), 2, 64, generator=generator).bfloat16()
    value = torch.randn(len(seq_lens), 2, 64, generator=generator).bfloat16()
    expected = reference_paged_attention(
        query, key, value, kv_cache.clone(), metadata, scale=0.125, sliding_window=window, logits_soft_cap=soft_cap
    )
    output = NativeCpuPagedAttention().forward(
        query, key, value, kv_cache, metadata, scale=0.125, sliding_window=window, logits_soft_cap=soft_cap
    )
    torch.testing.assert_close(output.float(), expected.float(), atol=2e-2, rtol=2e-2)


def _native_decode_step(seq_lens, num_q_heads, num_kv_heads, head_size, block_size, dtype, seed):
    """A decode step (one new token per sequence) over `seq_lens` tokens each, the context in
    shuffled blocks of `block_size`: (query, key, value, kv_cache, metadata)."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-seq_len // block_size) for seq_len in seq_lens) + 2
    kv_cache = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_size, dtype)[0]
    free_blocks = list(range(num_blocks))
    random.Random(seed).shuffle(free_blocks)
    tables = [[free_blocks.pop() for _ in range(-(-seq_len // block_size))] for seq_len in seq_lens]
    with_context = [(seq_len, table) for seq_len, table in zip(seq_lens, tables) if seq_len > 1]
    if with_context:
        context = build_attention_metadata(
            [seq_len - 1 for seq_len, _ in with_context],
            [seq_len - 1 for seq_len, _ in with_context],
            [table for _, table in with_context],
            block_size,
            [kv_cache],
        )
        num_context = sum(seq_len - 1 for seq_len in seq_lens)
        write_kv_cache(
            torch.randn(num_context, num_kv_heads, head_size, generator=generator).to(dtype),
            torch.randn(num_context, num_kv_heads, head_size, generator=generator).to(dtype),
            kv_cache,
            context.slot_mapping,
        )
    metadata = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size, [kv_cache])
    query = torch.randn(len(seq_lens), num_q_heads, head_size, generator=generator).to(dtype)
    key = torch.randn(len(seq_lens), num_kv_heads, head_size, generator=generator).to(dtype)
    value = torch.randn(len(seq_lens), num_kv_heads, head_size, generator=generator).to(dtype)
    return query, key, value, kv_cache, metadata


@functools.cache
def _float32_decode_reference(head_size, heads, block_size, seq_lens):
    """The float32 decode step and the reference's result for it, once per shape for every level."""
    num_q_heads, num_kv_heads = heads
    query, key, value, kv_cache, metadata = _native_decode_step(
        list(seq_lens), num_q_heads, num_kv_heads, head_size, block_size, torch.float32, 12
    )
    reference_cache = kv_cache.clone()
    expected = reference_paged_attention(query, key, value, reference_cache, metadata, scale=head_size**-0.5)
    return _Reference(query, key, value, kv_cache, metadata, expected, reference_cache)


@pytest.mark.parametrize("head_size", [64, 128, 256])
# query rows per KV head 7, 2, 3, 5, 1: the kernels tile 1-4 rows at a time and leave remainders
@pytest.mark.parametrize("heads", [(7, 1), (4, 2), (9, 3), (10, 2), (3, 3)])
@pytest.mark.parametrize("block_size", [5, 16])
# 40 sequences of 1..40 tokens (each KV head of a sequence is one work item), and 2 sequences
# (their heads shared out over the threads)
@pytest.mark.parametrize("seq_lens", [list(range(1, 41)), [23, 37]], ids=["1-40", "two"])
def test_native_decode_float32_every_run_length_and_tile(head_size, heads, block_size, seq_lens):
    """float32 decode against the reference for every key count from 1 to 40: the vector paths
    read keys in runs cut at 16 positions and at block ends, and take them 8 (AVX2) or 16
    (AVX-512) at a time, so each count leaves a different tail."""
    query, key, value, kv_cache, metadata, expected, reference_cache = _float32_decode_reference(
        head_size, heads, block_size, tuple(seq_lens)
    ).for_one_test()
    output = NativeCpuPagedAttention().forward(query, key, value, kv_cache, metadata, scale=head_size**-0.5)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_cache, reference_cache, atol=0, rtol=0)


@functools.cache
def _windowed_decode_reference(dtype, window, soft_cap):
    """The windowed, soft-capped decode step and the reference's result, once for every level."""
    seq_lens = [1, 9, 16, 17, 31, 48, 50]
    query, key, value, kv_cache, metadata = _native_decode_step(seq_lens, 9, 3, 64, 16, dtype, 13)
    query = query * 4
    reference_cache = kv_cache.clone()
    expected = reference_paged_attention(
        query, key, value, reference_cache, metadata, scale=0.125, sliding_window=window, logits_soft_cap=soft_cap
    )
    return _Reference(query, key, value, kv_cache, metadata, expected, reference_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 1, 7, 16, 33])
@pytest.mark.parametrize("soft_cap", [None, 5.0])
def test_native_decode_windows_and_soft_cap_per_dtype(dtype, window, soft_cap):
    """Sliding windows that start mid-block (the first run of keys is short) and the soft cap,
    on the vectorised head size in each cache dtype; scores are scaled up so the cap bites."""
    query, key, value, kv_cache, metadata, expected, _ = _windowed_decode_reference(
        dtype, window, soft_cap
    ).for_one_test()
    output = NativeCpuPagedAttention().forward(
        query, key, value, kv_cache, metadata, scale=0.125, sliding_window=window, logits_soft_cap=soft_cap
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.float(), expected.float(), atol=tolerance, rtol=tolerance)


# -- fp8 KV caches (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2) --------------------------------

FP8_FORMATS = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]


def finite_fp8_codes(cache_dtype) -> torch.Tensor:
    """Every bit pattern of the format that is a finite number (the kernels never write the others)."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[torch.isfinite(codes.view(cache_dtype).float())]


@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.037, 0.0051)])
def test_fp8_write_is_the_same_bytes_in_the_native_kernel_and_torch(cache_dtype, dtype, scales):
    """The cache write quantizes x * (1 / scale), saturating (values far past the format's range
    included) and rounding subnormals, identically in both paths."""
    generator = torch.Generator().manual_seed(21)
    num_tokens, num_kv_heads, head_size = 23, 3, 72  # 72: vector chunks and a tail
    magnitudes = torch.logspace(-9, 6, num_tokens).view(-1, 1, 1)  # subnormal .. far past 57344
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=generator) * magnitudes).to(dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_size, generator=generator) * magnitudes).to(dtype)
    slot_mapping = torch.randperm(8 * BLOCK_SIZE, generator=generator)[:num_tokens]
    torch_cache = torch.zeros(2, 8, BLOCK_SIZE, num_kv_heads, head_size, dtype=cache_dtype)
    native_cache = torch_cache.clone()
    write_kv_cache(key, value, torch_cache, slot_mapping, *scales)
    NativeCpuPagedAttention()._ops.write_kv_cache(key, value, native_cache, slot_mapping, *scales)
    assert torch.equal(torch_cache.view(torch.uint8), native_cache.view(torch.uint8))
    stored = torch_cache.float()
    assert torch.isfinite(stored).all()  # saturated, never inf or NaN
    limit = paged_attention.FP8_KV_CACHE_LIMITS[cache_dtype]
    assert stored.abs().max() == limit
    # what a slot holds stands for the written value, to the format's precision
    expected = (key.float() / scales[0]).clamp(-limit, limit)
    written = stored[0].view(-1, num_kv_heads, head_size)[slot_mapping]
    relative_step = 2.0**-3 if cache_dtype == torch.float8_e4m3fn else 2.0**-2
    normal = expected.abs() >= (2.0**-6 if cache_dtype == torch.float8_e4m3fn else 2.0**-14)
    assert ((written - expected).abs() <= relative_step / 2 * expected.abs() + 1e-30)[normal].all()


@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize("head_size", [64, 48])  # the vector widening and the table
def test_native_decode_reads_every_fp8_code_exactly(cache_dtype, head_size):
    """A sequence of one key attends to it with weight 1: the output is the cached value times
    v_scale, so every finite code the kernel widens (register bit tricks, or the table) must
    come out as torch's own conversion of it."""
    codes = finite_fp8_codes(cache_dtype)
    num_seqs = -(-len(codes) // head_size)
    rows = torch.zeros(num_seqs * head_size, dtype=torch.uint8)
    rows[: len(codes)] = codes
    kv_cache = torch.zeros(2, num_seqs, BLOCK_SIZE, 1, head_size, dtype=cache_dtype)
    kv_cache.view(torch.uint8)[1, :, 0, 0] = rows.view(num_seqs, head_size)
    metadata = build_attention_metadata(
        [1] * num_seqs, [1] * num_seqs, [[index] for index in range(num_seqs)], BLOCK_SIZE, [kv_cache]
    )
    query = torch.randn(num_seqs, 2, head_size)
    output = torch.empty_like(query)
    v_scale = 0.5  # a power of two: the products are exact
    NativeCpuPagedAttention()._ops.paged_decode_attention(
        output,
        query,
        kv_cache,
        metadata.block_tables.long(),
        metadata.seq_lens.long(),
        0.125,
        0,
        0.0,
        1.0,
        v_scale,
    )
    expected = rows.view(cache_dtype).float().view(num_seqs, 1, head_size) * v_scale
    torch.testing.assert_close(output, expected.expand(-1, 2, -1), atol=0, rtol=0)


def _fp8_decode_step(seq_lens, heads, head_size, block_size, cache_dtype, dtype, scales, seed):
    """A decode step over an fp8 cache whose context was written with ``scales``."""
    num_q_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-seq_len // block_size) for seq_len in seq_lens) + 2
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dtype)
    free_blocks = list(range(num_blocks))
    random.Random(seed).shuffle(free_blocks)
    tables = [[free_blocks.pop() for _ in range(-(-seq_len // block_size))] for seq_len in seq_lens]
    with_context = [(seq_len, table) for seq_len, table in zip(seq_lens, tables) if seq_len > 1]
    context = build_attention_metadata(
        [seq_len - 1 for seq_len, _ in with_context],
        [seq_len - 1 for seq_len, _ in with_context],
        [table for _, table in with_context],
        block_size,
        [kv_cache],
    )
    num_context = sum(seq_len - 1 for seq_len in seq_lens)
    # keys and values of a real model's range: a few units, an outlier now and then
    context_keys = torch.randn(num_context, num_kv_heads, head_size, generator=generator) * 2
    context_values = torch.randn(num_context, num_kv_heads, head_size, generator=generator)
    write_kv_cache(context_keys.to(dtype), context_values.to(dtype), kv_cache, context.slot_mapping, *scales)
    metadata = build_attention_metadata([1] * len(seq_lens), seq_lens, tables, block_size, [kv_cache])
    query = torch.randn(len(seq_lens), num_q_heads, head_size, generator=generator).to(dtype)
    key = (torch.randn(len(seq_lens), num_kv_heads, head_size, generator=generator) * 2).to(dtype)
    value = torch.randn(len(seq_lens), num_kv_heads, head_size, generator=generator).to(dtype)
    return query, key, value, kv_cache, metadata


# scales that are not powers of two
FP8_SCALES = (0.0123, 0.0071)


@functools.cache
def _fp8_decode_reference(heads, head_size, block_size, cache_dtype, dtype):
    """A decode step of sequences of 1..40 tokens over an fp8 cache, and the reference's output
    and cache for it: computed once per shape and shared by both backends at every level."""
    query, key, value, kv_cache, metadata = _fp8_decode_step(
        list(range(1, 41)), heads, head_size, block_size, cache_dtype, dtype, FP8_SCALES, 31
    )
    reference_cache = kv_cache.clone()
    expected = reference_paged_attention(
        query,
        key,
        value,
        reference_cache,
        metadata,
        scale=head_size**-0.5,
        k_scale=FP8_SCALES[0],
        v_scale=FP8_SCALES[1],
    )
    return _Reference(query, key, value, kv_cache, metadata, expected, reference_cache)


@FAST_BACKENDS_ONCE_AND_PER_LEVEL
@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128, 40])
@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4)])  # GQA groups of 3 and 8, and MHA
@pytest.mark.parametrize("block_size", [5, 16])
def test_fp8_decode_matches_reference(backend_class, cache_dtype, dtype, head_size, heads, block_size):
    """Decode over an fp8 cache, keys in runs cut at block ends: 1..40 tokens per sequence, so
    every sequence length crosses (or stops at) a block boundary somewhere, with scales that
    are not powers of two."""
    query, key, value, kv_cache, metadata, expected, reference_cache = _fp8_decode_reference(
        heads, head_size, block_size, cache_dtype, dtype
    ).for_one_test()
    output = backend_class().forward(
        query, key, value, kv_cache, metadata, scale=head_size**-0.5, k_scale=FP8_SCALES[0], v_scale=FP8_SCALES[1]
    )
    # the fp8 rounding is the same on both sides (the same bytes in the cache); what differs is
    # float32 summation order, the output's rounding to bfloat16 and, on the torch path, its
    # bfloat16 matmuls (the bound of the 16-bit cache's bfloat16 test above)
    if dtype == torch.float32:
        tolerance = 1e-5
    else:
        tolerance = 1e-2 if backend_class is NativeCpuPagedAttention else 3e-2
    torch.testing.assert_close(output.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(kv_cache.view(torch.uint8), reference_cache.view(torch.uint8))


@FAST_BACKENDS_ONCE_AND_PER_LEVEL
@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize("specs", MIXED_BATCHES)
@pytest.mark.parametrize("window", [None, 3])
def test_fp8_mixed_batches_match_reference(backend_class, cache_dtype, specs, window):
    """Prefills (with and without a cached prefix) next to decodes: a prompt's tokens attend to
    their own keys and values as the cache holds them, exactly as the reference reads them."""
    _, kv_cache, metadata, (query, key, value) = make_step(specs, 6, 2, 16, torch.float32, 17)
    kv_cache = kv_cache.clamp(-400, 400).to(cache_dtype)  # the context, as an fp8 cache holds it
    metadata.kv_caches = [kv_cache]
    scales = dict(k_scale=0.25, v_scale=0.0625)
    expected = reference_paged_attention(
        query, key, value, kv_cache.clone(), metadata, scale=0.3, sliding_window=window, **scales
    )
    output = backend_class().forward(query, key, value, kv_cache, metadata, scale=0.3, sliding_window=window, **scales)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=2e-5)


@at_the_host_level()
def test_fp8_caches_stay_close_to_the_16_bit_cache():
    """Attention over an fp8 cache approximates the full-precision result: e4m3 keeps 3 mantissa
    bits and e5m2 2, so e4m3 is the closer of the two (on values of a unit's size, where
    neither format saturates)."""
    seq_lens = [33, 64, 7]
    query, key, value, _, metadata = _fp8_decode_step(
        seq_lens, (8, 2), 64, 16, torch.float32, torch.float32, (1.0, 1.0), 41
    )
    exact = reference_paged_attention(query, key, value, metadata.kv_caches[0].clone(), metadata, scale=0.125)
    errors = {}
    for cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fp8_cache = metadata.kv_caches[0].to(cache_dtype)
        approximate = reference_paged_attention(query, key, value, fp8_cache, metadata, scale=0.125)
        errors[cache_dtype] = (approximate - exact).abs().mean().item() / exact.abs().mean().item()
    assert 0 < errors[torch.float8_e4m3fn] < errors[torch.float8_e5m2] < 0.1


def test_native_kernels_refuse_bad_fp8_scales_and_scales_on_a_16_bit_cache():
    ops = NativeCpuPagedAttention()._ops
    key = torch.ones(1, 2, 8)
    slot = torch.tensor([0])
    fp8_cache = torch.zeros(2, 4, BLOCK_SIZE, 2, 8, dtype=torch.float8_e4m3fn)
    for bad_scale in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(RuntimeError, match="positive and finite"):
            ops.write_kv_cache(key, key, fp8_cache, slot, bad_scale, 1.0)
    with pytest.raises(RuntimeError, match="fp8 kv_cache only"):
        ops.write_kv_cache(key, key, torch.zeros(2, 4, BLOCK_SIZE, 2, 8), slot, 0.5, 1.0)
    assert fp8_cache.view(torch.uint8).sum() == 0


# -- runs: verify rows of one sequence read its keys once -------------------------------------


def _verify_like_batch(block_size, lone_run, seed):
    """Decode rows as a verifying step lays them out, with ``(seq_lens, block_tables, num_blocks)``:
    runs of 1..10 rows continuing one sequence (one block table, lengths L, L + 1, ...), between
    unrelated rows and rows that look like a run but are not one (the same lengths over a table
    that differs in the first or in the last block the shorter row reads; lengths that fall).
    ``lone_run``: only one run of that many rows (its rows shared out over the threads)."""
    rng = random.Random(seed)
    lengths, tables = [], []

    def add_sequence(context_len, num_rows, differ_at=None):
        table = [rng.randrange(1 << 20) for _ in range(-(-(context_len + num_rows) // block_size))]
        for row in range(num_rows):
            row_table = list(table)
            if differ_at is not None and row % 2 == 1:
                # a look-alike: this row's table differs in a block the row before it reads
                shorter_blocks = -(-(context_len + row) // block_size)
                row_table[0 if differ_at == "first" else shorter_blocks - 1] += 1 << 20
            lengths.append(context_len + row + 1)
            tables.append(row_table)

    if lone_run:
        add_sequence(rng.randint(40, 90), lone_run)
    else:
        run_sizes = list(range(1, 11))
        rng.shuffle(run_sizes)
        for run_size in run_sizes:
            add_sequence(rng.randint(0, 70), run_size)
            if rng.random() < 0.5:
                add_sequence(rng.randint(0, 70), 1)  # an unrelated decode
        add_sequence(rng.randint(1, 40), 3, differ_at="first")
        add_sequence(rng.randint(1, 40), 4, differ_at="last")
        context_len = rng.randint(10, 40)  # falling lengths over one table
        table = [rng.randrange(1 << 20) for _ in range(-(-context_len // block_size))]
        for row in range(3):
            lengths.append(context_len - row)
            tables.append(table)
    # block ids as drawn stand for distinct blocks: map them onto the cache's, shuffled
    distinct = sorted({block for table in tables for block in table})
    order = list(range(len(distinct)))
    rng.shuffle(order)
    to_cache = dict(zip(distinct, order))
    width = max(len(table) for table in tables)
    block_tables = torch.tensor([[to_cache[block] for block in table] + [0] * (width - len(table)) for table in tables])
    return torch.tensor(lengths), block_tables, len(distinct)


# (activations, cache, k_scale, v_scale)
RUN_CACHES = [
    pytest.param(torch.bfloat16, torch.bfloat16, 1.0, 1.0, id="bf16"),
    pytest.param(torch.float32, torch.float32, 1.0, 1.0, id="f32"),
    pytest.param(torch.bfloat16, torch.float8_e4m3fn, 0.05, 0.02, id="bf16-fp8"),
]


@pytest.mark.parametrize("block_size", [16, 5, 1])
# GQA groups of 3 and 1, each at one head size: how a run's rows share keys does not depend on
# the head size, whose vector loops every other decode test here covers
@pytest.mark.parametrize("head_size, heads", [(64, (9, 3)), (128, (4, 4))])
@pytest.mark.parametrize("dtype, cache_dtype, k_scale, v_scale", RUN_CACHES)
# runs merge only where every row reads from key 0: no window, or one longer than the rows (which
# also takes the soft cap); a window of 7 keeps every longer row alone
@pytest.mark.parametrize("window, soft_cap", [(0, 0.0), (1000, 5.0), (7, 0.0)])
def test_native_decode_rows_of_a_run_equal_each_row_alone(
    block_size, head_size, heads, dtype, cache_dtype, k_scale, v_scale, soft_cap, window
):
    """Rows that continue one sequence are one work item reading each key once for all of them;
    every row's output must be bit for bit what the kernel gives that row alone, at any number
    of threads (which splits a lone run's rows between them), and rows that only look like a
    run must read their own tables."""
    num_q_heads, num_kv_heads = heads
    ops = NativeCpuPagedAttention()._ops
    scale = head_size**-0.5
    for lone_run in (0, 9, 4):
        seq_lens, block_tables, num_blocks = _verify_like_batch(block_size, lone_run, seed=block_size + lone_run)
        generator = torch.Generator().manual_seed(lone_run)
        kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=generator)
        kv_cache = kv_cache.to(cache_dtype)
        query = torch.randn(len(seq_lens), num_q_heads, head_size, generator=generator).to(dtype)
        alone = torch.full_like(query, float("nan"))
        for row in range(len(seq_lens)):
            ops.paged_decode_attention(
                alone[row : row + 1],
                query[row : row + 1],
                kv_cache,
                block_tables[row : row + 1],
                seq_lens[row : row + 1],
                scale,
                window,
                soft_cap,
                k_scale,
                v_scale,
            )
        assert not alone.isnan().any()
        for num_threads in (1, 2, 3):
            batched = torch.full_like(query, float("nan"))
            with torch_threads(num_threads):
                ops.paged_decode_attention(
                    batched, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap, k_scale, v_scale
                )
            assert torch.equal(batched, alone), f"{num_threads} threads, lone run {lone_run}"
    # and the rows are attention over their own keys: the last run against the reference
    keys = kv_cache[0][block_tables[-1]].flatten(0, 1).float() * k_scale
    values = kv_cache[1][block_tables[-1]].flatten(0, 1).float() * v_scale
    for row in range(len(seq_lens)):
        length = int(seq_lens[row])
        first = max(0, length - window) if window else 0
        row_keys = keys[first:length].repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        row_values = values[first:length].repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", query[row].float(), row_keys) * scale
        if soft_cap:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        expected = torch.einsum("ht,thd->hd", scores.softmax(-1), row_values)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(alone[row].float(), expected, atol=tolerance, rtol=tolerance)


def test_native_decode_rejects_lengths_past_the_block_table():
    ops = NativeCpuPagedAttention()._ops
    cache = torch.zeros(2, 4, BLOCK_SIZE, 2, 8)
    query = torch.ones(2, 4, 8)
    tables = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="exceeds the 8 keys its block table holds"):
        ops.paged_decode_attention(torch.empty_like(query), query, cache, tables, torch.tensor([8, 9]), 0.5, 0, 0.0)


def _poison_unused_slots(kv_cache, metadata, value):
    """Every cache slot that holds none of the step's sequences' positions set to ``value``:
    what freed blocks hold after a request whose activations overflowed (issue 37, item 3)."""
    block_size = metadata.block_size
    used = torch.zeros(kv_cache.shape[1] * block_size, dtype=torch.bool)
    for row, seq_len in enumerate(metadata.seq_lens_cpu):
        table = metadata.block_tables[row].tolist()
        for position in range(seq_len):
            used[table[position // block_size] * block_size + position % block_size] = True
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[:, ~used] = value


@pytest.mark.parametrize("specs", MIXED_BATCHES)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("poison", [float("nan"), 3e38], ids=["nan", "3e38"])
@pytest.mark.parametrize("backend_class", FAST_BACKENDS)
@at_the_host_level()
def test_stale_non_finite_slots_never_reach_the_output(specs, window, poison, backend_class):
    """Padded reads (a block's tail past the sequence's end, padding blocks of a shorter
    sequence, which read block 0) are masked by selection: a masked score or value that is nan,
    or whose product overflows, must not turn the output into nan through 0 * nan."""
    _, kv_cache, metadata, (query, key, value) = make_step(specs, 8, 2, 16, torch.float32, 5)
    _poison_unused_slots(kv_cache, metadata, poison)
    expected = reference_paged_attention(
        query, key, value, kv_cache.clone(), metadata, scale=0.25, sliding_window=window
    )
    assert torch.isfinite(expected).all()
    output = backend_class().forward(query, key, value, kv_cache, metadata, scale=0.25, sliding_window=window)
    torch.testing.assert_close(output, expected, atol=2e-6, rtol=2e-5)
