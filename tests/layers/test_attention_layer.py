"""The Attention module: what it hands the backend (heads, this layer's cache, options, an fp8
cache's scales, which --calculate-kv-scales sets from the first step) and its errors for bad
head groupings or a missing backend."""

from __future__ import annotations

import pytest
import torch
from helpers.attention import allocate_kv_caches, build_attention_metadata

from tokenloom.core.batch import KVCacheScales
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


def fp8_metadata(backend, pending=False, num_layers=2):
    caches = [torch.zeros(2, 4, 4, 2, 8, dtype=torch.float8_e4m3fn) for _ in range(num_layers)]
    metadata = build_attention_metadata([3], [3], [[1]], 4, caches, backend)
    metadata.kv_scales = [KVCacheScales(pending=pending) for _ in range(num_layers)]
    return metadata


def test_an_fp8_cache_gets_its_layers_scales_and_a_16_bit_one_none():
    backend = RecordingBackend()
    metadata = fp8_metadata(backend)
    metadata.kv_scales[1] = KVCacheScales(k_scale=0.25, v_scale=0.125)
    Attention(4, 8, 0.5, num_kv_heads=2, layer_index=1)(
        torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16), metadata
    )
    assert backend.calls[0][4] == {
        "scale": 0.5,
        "sliding_window": None,
        "logits_soft_cap": None,
        "k_scale": 0.25,
        "v_scale": 0.125,
    }


def test_calculate_kv_scales_sets_each_layers_scales_from_its_first_step_only():
    backend = RecordingBackend()
    metadata = fp8_metadata(backend, pending=True)
    key, value = torch.randn(3, 16), torch.randn(3, 16)
    key[1, 5], value[2, 3] = -40.0, 7.0  # the largest magnitudes
    layer = Attention(4, 8, 0.5, num_kv_heads=2, layer_index=0)
    layer(torch.randn(3, 32), key, value, metadata)
    scales = metadata.kv_scales[0]
    # vLLM's rule: max |k| / K_SCALE_CONSTANT (200), max |v| / V_SCALE_CONSTANT (100)
    assert (scales.k_scale, scales.v_scale, scales.pending) == (pytest.approx(0.2), pytest.approx(0.07), False)
    assert metadata.kv_scales[1].pending  # the other layer has not run yet
    assert backend.calls[0][4]["k_scale"] == scales.k_scale
    layer(torch.randn(3, 32), key * 100, value * 100, metadata)  # later steps keep them
    assert (scales.k_scale, scales.v_scale) == (pytest.approx(0.2), pytest.approx(0.07))


def test_calculated_scales_stay_usable_when_a_step_is_all_zeros():
    metadata = fp8_metadata(RecordingBackend(), pending=True)
    Attention(4, 8, 0.5, num_kv_heads=2)(torch.randn(3, 32), torch.zeros(3, 16), torch.randn(3, 16), metadata)
    assert metadata.kv_scales[0].k_scale == 1.0 and metadata.kv_scales[0].v_scale > 0


def test_fp8_output_through_the_fast_backend_equals_the_reference():
    caches = [torch.zeros(2, 8, 4, 2, 8, dtype=torch.float8_e5m2)]
    metadata = build_attention_metadata([5, 1], [5, 1], [[3, 6], [0]], 4, caches, TorchPagedAttention())
    metadata.kv_scales = [KVCacheScales(pending=True)]
    query, key, value = torch.randn(6, 32), torch.randn(6, 16), torch.randn(6, 16)
    output = Attention(4, 8, 0.35, num_kv_heads=2)(query, key, value, metadata)
    scales = metadata.kv_scales[0]
    expected = reference_paged_attention(
        query.view(6, 4, 8),
        key.view(6, 2, 8),
        value.view(6, 2, 8),
        torch.zeros_like(caches[0]),
        metadata,
        scale=0.35,
        k_scale=scales.k_scale,
        v_scale=scales.v_scale,
    )
    torch.testing.assert_close(output, expected.view(6, 32), atol=2e-6, rtol=2e-5)
