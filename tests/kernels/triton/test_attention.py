"""The Triton paged-attention backend under the interpreter against the torch reference
(:func:`reference_paged_attention`): mixed prefill / chunked prefill over a cached prefix /
decode batches, head sizes 64/128/256, GQA ratios, sliding windows, soft-capping, sequences of
one token, steps with no tokens, keys across block boundaries, and split-K decode over
contexts of several partitions."""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the `gpu` extra)")

from helpers.attention import allocate_kv_caches, build_attention_metadata  # noqa: E402

from tokenloom.errors import ConfigError  # noqa: E402
from tokenloom.kernels.paged_attention import reference_paged_attention, write_kv_cache  # noqa: E402
from tokenloom.kernels.triton.attention import TritonPagedAttention  # noqa: E402

BLOCK_SIZE = 16


def make_step(seq_specs, num_q_heads, num_kv_heads, head_size, dtype, seed, block_size=BLOCK_SIZE):
    """``seq_specs``: per sequence ``(context_len, query_len)``. Two identical caches holding
    every context (scattered blocks, garbage elsewhere) and the step's q/k/v and metadata."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((c + q) / block_size) for c, q in seq_specs) + 4
    cache = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_size, dtype)[0]
    free_blocks = list(range(num_blocks))
    random.Random(seed).shuffle(free_blocks)
    tables, queries, keys, values = [], [], [], []
    for context_len, query_len in seq_specs:
        seq_len = context_len + query_len
        table = [free_blocks.pop() for _ in range(max(1, math.ceil(seq_len / block_size)))]
        seq_keys = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(dtype)
        seq_values = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(dtype)
        if context_len:
            context = build_attention_metadata([context_len], [context_len], [table], block_size, [cache])
            write_kv_cache(seq_keys[:context_len], seq_values[:context_len], cache, context.slot_mapping)
        queries.append(torch.randn(query_len, num_q_heads, head_size, generator=generator).to(dtype))
        keys.append(seq_keys[context_len:])
        values.append(seq_values[context_len:])
        tables.append(table)
    metadata = build_attention_metadata(
        [q for _, q in seq_specs], [c + q for c, q in seq_specs], tables, block_size, [cache]
    )
    return torch.cat(queries), torch.cat(keys), torch.cat(values), cache, metadata


def run_both(
    seq_specs,
    num_q_heads,
    num_kv_heads,
    head_size,
    dtype=torch.float32,
    seed=0,
    window=None,
    soft_cap=None,
    backend=None,
    block_size=BLOCK_SIZE,
):
    query, key, value, cache, metadata = make_step(
        seq_specs, num_q_heads, num_kv_heads, head_size, dtype, seed, block_size
    )
    reference_cache = cache.clone()
    scale = head_size**-0.5
    expected = reference_paged_attention(
        query, key, value, reference_cache, metadata, scale=scale, sliding_window=window, logits_soft_cap=soft_cap
    )
    backend = backend or TritonPagedAttention(
        partition_size=32, prefill_block_m=16, prefill_block_n=16, decode_block_n=16
    )
    actual = backend.forward(
        query, key, value, cache, metadata, scale=scale, sliding_window=window, logits_soft_cap=soft_cap
    )
    # the cache holds exactly what the reference wrote (garbage elsewhere untouched)
    assert torch.equal(cache, reference_cache)
    return actual, expected


# (context_len, query_len): a fresh prompt across block boundaries, a chunk over a cached
# prefix ending mid-block, a one-token prompt, decodes at block edges and over several partitions
MIXED = [(0, 37), (21, 11), (0, 1), (15, 1), (16, 1), (70, 1)]


@pytest.mark.parametrize(
    "head_size, num_q_heads, num_kv_heads",
    [(64, 2, 2), (64, 8, 2), (128, 4, 1), (256, 2, 2), (32, 6, 2)],
    ids=["d64-mha", "d64-gqa4", "d128-mqa", "d256", "d32-gqa3"],
)
def test_mixed_batch_matches_the_reference(head_size, num_q_heads, num_kv_heads):
    actual, expected = run_both(MIXED, num_q_heads, num_kv_heads, head_size)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window(window):
    actual, expected = run_both(MIXED, 4, 2, 64, window=window, seed=window)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_soft_cap_with_window_and_gqa():
    actual, expected = run_both(MIXED, 4, 2, 64, window=9, soft_cap=2.0, seed=3)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    # the cap really bites: without it the result differs
    uncapped, _ = run_both(MIXED, 4, 2, 64, window=9, soft_cap=None, seed=3)
    assert not torch.allclose(uncapped, actual, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_activations_and_cache(dtype):
    actual, expected = run_both(MIXED, 4, 2, 64, dtype=dtype, seed=5, window=24)
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "seq_specs",
    [[(0, 1)], [(99, 1), (3, 1), (0, 1)], [(40, 24)], [(0, 16), (0, 17)]],
    ids=["one-token-prompt", "decodes-only", "chunk-over-prefix", "prompts-at-block-edges"],
)
def test_single_kind_steps(seq_specs):
    actual, expected = run_both(seq_specs, 4, 2, 64, seed=len(seq_specs))
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_split_k_over_many_partitions_equals_one_partition():
    # a 200-token context in 13 partitions of 16 keys versus one partition of 256
    specs = [(200, 1), (31, 1), (0, 1)]
    many, expected = run_both(specs, 4, 1, 64, seed=11, backend=TritonPagedAttention(16, 16, 16, 16))
    one, _ = run_both(specs, 4, 1, 64, seed=11, backend=TritonPagedAttention(256, 16, 16, 16))
    torch.testing.assert_close(many, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(many, one, atol=2e-5, rtol=1e-4)


def test_other_kv_block_sizes():
    actual, expected = run_both([(5, 9), (13, 1)], 4, 2, 64, block_size=4, seed=2)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_a_step_with_no_tokens_and_padding_slots():
    backend = TritonPagedAttention(32, 16, 16, 16)
    query, key, value, cache, metadata = make_step([(5, 3)], 4, 2, 64, torch.float32, seed=4)
    empty = torch.empty(0, 4, 64)
    metadata_empty = build_attention_metadata([0], [5], [metadata.block_tables[0].tolist()], BLOCK_SIZE, [cache])
    before = cache.clone()
    output = backend.forward(empty, empty[:, :2], empty[:, :2], cache, metadata_empty, scale=0.125)
    assert output.shape == (0, 4, 64) and torch.equal(cache, before)
    # a negative slot (a padding token) writes nothing
    metadata.slot_mapping[1] = -1
    backend.write_kv_cache(key, value, cache, metadata.slot_mapping)
    written = [int(slot) for slot in metadata.slot_mapping if slot >= 0]
    flat = cache[0].view(-1, 2, 64)
    torch.testing.assert_close(flat[written], key[[0, 2]])
    untouched = sorted(set(range(flat.shape[0])) - set(written))
    assert torch.equal(flat[untouched], before[0].view(-1, 2, 64)[untouched])


def test_strided_query_and_key_views_of_a_fused_projection():
    query, key, value, cache, metadata = make_step(MIXED, 4, 2, 64, torch.float32, seed=8)
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)  # [T, (4+2+2)*64]
    q_view = fused[:, : 4 * 64].view(-1, 4, 64)
    k_view = fused[:, 4 * 64 : 6 * 64].view(-1, 2, 64)
    v_view = fused[:, 6 * 64 :].view(-1, 2, 64)
    reference_cache = cache.clone()
    expected = reference_paged_attention(query, key, value, reference_cache, metadata, scale=0.125)
    actual = TritonPagedAttention(32, 16, 16, 16).forward(q_view, k_view, v_view, cache, metadata, scale=0.125)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_bidirectional_batches_go_to_the_torch_backend():
    query, key, value, cache, metadata = make_step([(0, 7), (0, 3)], 4, 2, 64, torch.float32, seed=9)
    metadata.bidirectional = True
    expected = reference_paged_attention(query, key, value, cache, metadata, scale=0.125)
    actual = TritonPagedAttention().forward(query, key, value, cache, metadata, scale=0.125)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_on_the_cpu_without_the_interpreter_it_refuses_with_what_to_set(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        TritonPagedAttention()


def test_bad_block_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="at least 16"):
        TritonPagedAttention(prefill_block_m=8)
    with pytest.raises(ConfigError, match="multiple"):
        TritonPagedAttention(partition_size=40, decode_block_n=16)


@pytest.mark.parametrize("poison", [float("nan"), 3e38], ids=["nan", "3e38"])
def test_stale_non_finite_slots_never_reach_the_output(poison):
    """Slots past a sequence's end (freed blocks' leftovers: nan from a request whose activations
    overflowed, issue 37) are never loaded: masked loads give 0, masked scores -inf by selection."""
    query, key, value, cache, metadata = make_step(MIXED, 8, 2, 64, torch.float32, seed=11)
    used = torch.zeros(cache.shape[1] * BLOCK_SIZE, dtype=torch.bool)
    for row, seq_len in enumerate(metadata.seq_lens_cpu):
        table = metadata.block_tables[row].tolist()
        for position in range(seq_len):
            used[table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~used] = poison
    expected = reference_paged_attention(query, key, value, cache.clone(), metadata, scale=0.125)
    backend = TritonPagedAttention(partition_size=32, prefill_block_m=16, prefill_block_n=16, decode_block_n=16)
    actual = backend.forward(query, key, value, cache, metadata, scale=0.125)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
