"""Rotary embeddings against transformers: inverse frequencies of every scaling variant from
``transformers.modeling_rope_utils``, and rotated queries/keys from its rotary module."""

from __future__ import annotations

import math
import types

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tokenloom.errors import ConfigError
from tokenloom.layers.rotary import compute_inv_freq, get_rope, rope_parameters_from_config

HEAD_SIZE = 32
MAX_POSITIONS = 512

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
    },
}


def llama_config(rope_parameters):
    return LlamaConfig(
        hidden_size=HEAD_SIZE * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=dict(rope_parameters),
    )


def transformers_inv_freq(config):
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    seq_len = None
    if rope_type == "dynamic":
        # tokenloom fixes the table at the longest scaled length transformers would rescale to
        seq_len = MAX_POSITIONS * config.rope_parameters["factor"]
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


@pytest.mark.parametrize("variant", VARIANTS)
def test_inv_freq_matches_transformers(variant):
    config = llama_config(VARIANTS[variant])
    expected_inv_freq, expected_scaling = transformers_inv_freq(config)
    inv_freq, scaling, table_len = compute_inv_freq(rope_parameters_from_config(config), HEAD_SIZE, MAX_POSITIONS)
    torch.testing.assert_close(inv_freq, expected_inv_freq, atol=0, rtol=1e-6)
    assert scaling == pytest.approx(expected_scaling)
    assert table_len >= MAX_POSITIONS


@pytest.mark.parametrize("variant", ["default", "linear", "llama3", "yarn", "yarn-mscale"])
def test_rotation_matches_transformers(variant):
    config = llama_config(VARIANTS[variant])
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 3])
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(len(positions), 4 * HEAD_SIZE, generator=generator)
    key = torch.randn(len(positions), 2 * HEAD_SIZE, generator=generator)
    cos, sin = LlamaRotaryEmbedding(config)(query, positions.unsqueeze(0))
    expected_query, expected_key = apply_rotary_pos_emb(
        query.view(1, -1, 4, HEAD_SIZE).transpose(1, 2), key.view(1, -1, 2, HEAD_SIZE).transpose(1, 2), cos, sin
    )
    rope = get_rope(HEAD_SIZE, rope_parameters_from_config(config), MAX_POSITIONS, dtype=torch.float32)
    rotated_query, rotated_key = rope(positions, query, key)
    torch.testing.assert_close(rotated_query, expected_query.transpose(1, 2).reshape(len(positions), -1))
    torch.testing.assert_close(rotated_key, expected_key.transpose(1, 2).reshape(len(positions), -1))


def test_partial_rotary_rotates_only_the_leading_features():
    parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    partial = get_rope(HEAD_SIZE, parameters, 64, dtype=torch.float32)
    full_on_rotary_part = get_rope(
        HEAD_SIZE // 2, {"rope_type": "default", "rope_theta": 10000.0}, 64, dtype=torch.float32
    )
    positions = torch.tensor([3, 9])
    x = torch.randn(2, 2, HEAD_SIZE)
    rotated, _ = partial(positions, x.clone(), x.clone())
    expected_rotary, _ = full_on_rotary_part(positions, x[..., :16].contiguous(), x[..., :16].contiguous())
    torch.testing.assert_close(rotated[..., :16], expected_rotary)
    torch.testing.assert_close(rotated[..., 16:], x[..., 16:])


def test_legacy_rope_scaling_and_theta_are_read():
    legacy = types.SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5000.0)
    assert rope_parameters_from_config(legacy) == {
        "rope_type": "linear",
        "factor": 2.0,
        "rope_theta": 5000.0,
        "partial_rotary_factor": 1.0,
    }
    bare = types.SimpleNamespace()
    assert rope_parameters_from_config(bare)["rope_theta"] == 10000.0


def test_nested_rope_parameters_by_layer_type():
    config = types.SimpleNamespace(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        }
    )
    assert rope_parameters_from_config(config, "sliding_attention")["rope_theta"] == 10.0
    assert rope_parameters_from_config(config, "full_attention")["rope_type"] == "linear"


def test_table_covers_scaled_context_or_the_model_length():
    assert get_rope(8, VARIANTS["linear"], 100).max_position == 400
    assert get_rope(8, VARIANTS["default"], 100, max_position=300).max_position == 300
    assert get_rope(8, VARIANTS["default"], 100, dtype=torch.bfloat16).cos_cache.dtype == torch.bfloat16


def test_unsupported_rope_type_is_a_config_error():
    with pytest.raises(ConfigError, match="'mrope'"):
        compute_inv_freq({"rope_type": "mrope", "rope_theta": 1.0}, 8, 16)
    with pytest.raises(ConfigError, match="even"):
        get_rope(6, {"rope_type": "default", "partial_rotary_factor": 0.5}, 16)


def test_freq_factors_divide_each_frequency_as_ggml_does():
    """llama.cpp's ``freq_factors`` (a Llama 3 GGUF's rope_freqs.weight): frequency i becomes
    inv_freq[i] / factor[i], on top of the scaling type's own."""
    factors = [1.0, 2.0, 4.0, 8.0]
    base, _, _ = compute_inv_freq(VARIANTS["linear"], 8, 16)
    divided, scaling, table_len = compute_inv_freq({**VARIANTS["linear"], "freq_factors": factors}, 8, 16)
    torch.testing.assert_close(divided, base / torch.tensor(factors), atol=0, rtol=0)
    assert (scaling, table_len) == (1.0, 64)
    with pytest.raises(ConfigError, match="4 positive numbers"):
        compute_inv_freq({"rope_type": "default", "freq_factors": factors[:3]}, 8, 16)
    with pytest.raises(ConfigError, match="4 positive numbers"):
        compute_inv_freq({"rope_type": "default", "freq_factors": [1.0, 0.0, 1.0, 1.0]}, 8, 16)


def test_llama3_freq_factors_reproduce_the_llama3_scaling():
    """The divisors llama.cpp's converter writes for ``rope_type: llama3`` give transformers' llama3
    frequencies: what serves a Llama 3.1 GGUF with the positions its safetensors get."""
    from helpers.gguf_files import llama3_rope_factors

    config = llama_config(VARIANTS["llama3"])
    expected, _ = transformers_inv_freq(config)
    factors = llama3_rope_factors(config).tolist()
    assert 1.0 in factors and 8.0 in factors and any(1.0 < factor < 8.0 for factor in factors)
    inv_freq, _, _ = compute_inv_freq(
        {"rope_type": "default", "rope_theta": 500000.0, "freq_factors": factors}, HEAD_SIZE, MAX_POSITIONS
    )
    torch.testing.assert_close(inv_freq, expected, atol=0, rtol=1e-6)


LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 64,
    "short_factor": [1.0, 1.5, 2.0, 4.0],
    "long_factor": [3.0, 5.0, 7.0, 9.0],
}


@pytest.mark.parametrize("attention_factor", [None, 1.3])
def test_longrope_within_the_original_context_matches_transformers(attention_factor):
    """transformers' short-factor frequencies and its attention factor from the context ratio."""
    from transformers import Phi3Config

    # a copy: transformers fills in the dict it is given
    parameters = dict(LONGROPE, attention_factor=attention_factor) if attention_factor else dict(LONGROPE)
    config = Phi3Config(
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters=parameters,
    )
    expected_inv_freq, expected_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=64)
    inv_freq, scaling, table_len = compute_inv_freq(rope_parameters_from_config(config), 8, 256)
    torch.testing.assert_close(inv_freq, expected_inv_freq, atol=0, rtol=1e-6)
    assert scaling == pytest.approx(expected_scaling) and table_len == 64
    assert scaling == pytest.approx(attention_factor or (1 + math.log(4) / math.log(64)) ** 0.5)


def test_longrope_past_the_original_context_is_refused_naming_the_flag():
    assert get_rope(8, LONGROPE, 256, max_position=64).max_position == 64
    for max_position in (65, None):  # None: the model's whole context, 256
        with pytest.raises(ConfigError, match=r"--max-model-len 64") as error:
            get_rope(8, LONGROPE, 256, max_position=max_position)
        assert error.value.param == "max-model-len"
