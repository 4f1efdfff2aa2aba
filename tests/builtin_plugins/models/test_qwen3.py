"""Qwen3ForCausalLM (dense) against transformers on tiny random models, from safetensors and from
GGUF (llama.cpp's ``qwen3`` architecture): per-head q/k RMSNorm before RoPE, a ``head_dim`` that
is not hidden_size / heads, tied and untied embeddings; every position's logits through the paged
cache, greedy ids through the engine; and a checkpoint without its q/k norms refused."""

from __future__ import annotations

import pytest
import torch
from helpers.model_parity import (
    assert_matches_transformers,
    assert_served_greedy_agrees,
    build_model,
    load_checkpoint,
    randomize_parameters,
    saved_checkpoint,
)
from transformers import Qwen3Config
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_qwen3 import Qwen3ForCausalLM
from tokenloom.errors import ModelLoadError

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # Qwen3's own head size: 4 heads x 32 = 128 query features from a 64-wide model
    max_position_embeddings=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


def hf_qwen3(seed: int = 0, **overrides) -> HFQwen3ForCausalLM:
    torch.manual_seed(seed)
    return randomize_parameters(HFQwen3ForCausalLM(Qwen3Config(**{**TINY, **overrides})).eval(), seed)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
@pytest.mark.parametrize("tie_word_embeddings", [False, True], ids=["untied", "tied"])
def test_qwen3_matches_transformers(load_format, tie_word_embeddings, tmp_path):
    hf_model = hf_qwen3(seed=3, tie_word_embeddings=tie_word_embeddings)
    config, weights = load_checkpoint(load_format, hf_model, tmp_path)
    assert config.head_dim == 32 and config.tie_word_embeddings == tie_word_embeddings
    model, loaded = build_model(Qwen3ForCausalLM, config, weights)
    assert {"model.layers.2.self_attn.q_norm.weight", "model.layers.2.self_attn.k_norm.weight"} <= loaded
    assert model.model.layers[0].self_attn.qkv_proj.bias is None
    assert model.kv_cache_spec.head_size == 32
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
def test_qwen3_served_greedy_matches_transformers(load_format, tmp_path):
    """Through the engine (scheduler, paged cache, sampler) as a server runs it."""
    hf_model = hf_qwen3(seed=5)
    assert_served_greedy_agrees(hf_model, saved_checkpoint(load_format, hf_model, tmp_path), PROMPTS)


def test_a_checkpoint_without_q_k_norms_is_refused():
    hf_model = hf_qwen3()
    weights = [(name, tensor) for name, tensor in hf_model.state_dict().items() if "_norm" not in name.split(".")[-2]]
    assert len(weights) == len(hf_model.state_dict()) - 2 * TINY["num_hidden_layers"]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight"):
        build_model(Qwen3ForCausalLM, hf_model.config, weights)


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {"Qwen3ForCausalLM": "tokenloom.builtin_plugins.models.modeling_qwen3:Qwen3ForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
