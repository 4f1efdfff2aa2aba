"""The Attention module: what it hands the backend (heads, this layer's cache, options) and
its errors for bad head groupings or a missing backend."""

from __future__ import annotations

import pytest
import torch
from helpers.attention import allocate_kv_caches, build_attention_metadata

from tokenloom.errors import ConfigError
from tokenloom.kernels.paged_attention import TorchPagedAttention, reference_paged_attention
from tokenloom.layers.attention import Attention


class RecordingBackend:
    def __init__(self):
        self.calls = []

    def forward(self, query, key, value, kv_cache, attn_metadata, **options):
        self.calls.append((query.shape, key.shape, value.shape, kv_cache, options))
        return torch.zeros_like(query)


def test_backend_receives_heads_cache_and_options():
    caches = allocate_kv_caches(2, 4, 4, 2, 8)
    backend = RecordingBackend()
    metadata = build_attention_metadata([3], [3], [[1]], 4, caches, backend)
    attention = Attention(4, 8, 0.5, num_kv_heads=2, layer_index=1, sliding_window=16, logits_soft_cap=30.0)
    output = attention(torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16), metadata)
    assert output.shape == (3, 32)
    query_shape, key_shape, value_shape, cache, options = backend.calls[0]
    assert (query_shape, key_shape, value_shape) == ((3, 4, 8), (3, 2, 8), (3, 2, 8))
    assert cache is caches[1]
    assert options == {"scale": 0.5, "sliding_window": 16, "logits_soft_cap": 30.0}


def test_output_equals_the_reference_through_the_fast_backend():
    caches = allocate_kv_caches(1, 8, 4, 2, 8)
    metadata = build_attention_metadata([5, 1], [5, 1], [[3, 6], [0]], 4, caches, TorchPagedAttention())
    query, key, value = torch.randn(6, 32), torch.randn(6, 16), torch.randn(6, 16)
    output = Attention(4, 8, 0.35, num_kv_heads=2)(query, key, value, metadata)
    expected = reference_paged_attention(
        query.view(6, 4, 8), key.view(6, 2, 8), value.view(6, 2, 8), caches[0].clone(), metadata, scale=0.35
    )
    torch.testing.assert_close(output, expected.view(6, 32), atol=2e-6, rtol=2e-5)


def test_configuration_errors():
    with pytest.raises(ConfigError, match="grouped"):
        Attention(6, 8, 1.0, num_kv_heads=4)
    with pytest.raises(ConfigError, match="sliding window"):
        Attention(4, 8, 1.0, sliding_window=0)
    metadata = build_attention_metadata([1], [1], [[0]], 4, allocate_kv_caches(1, 2, 4, 4, 8))
    with pytest.raises(ConfigError, match="backend"):
        Attention(4, 8, 1.0)(torch.randn(1, 32), torch.randn(1, 32), torch.randn(1, 32), metadata)
