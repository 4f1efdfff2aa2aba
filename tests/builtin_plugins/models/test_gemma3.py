"""Gemma3ForCausalLM (and the text part of Gemma3ForConditionalGeneration, whose images
tests/builtin_plugins/models/test_gemma3_vision.py covers) against transformers on tiny random models whose sliding window (4 tokens) is shorter than the
prompts, so local and global layers, their two RoPE bases and the window all matter."""

from __future__ import annotations

import pytest
import torch
from helpers.model_parity import assert_close_to_float32, assert_matches_transformers, build_model, perturb_parameters
from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
from transformers import Gemma3ForConditionalGeneration as HFGemma3ForConditionalGeneration

from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from tokenloom.errors import ConfigError, ModelLoadError

PROMPTS = [[2, 17, 99, 3, 42, 7, 8, 140, 66], [2, 120, 4], [2, 33, 61, 5, 90, 11, 150, 23, 8, 77, 5, 64, 31]]


def tiny_text_config(**overrides):
    settings = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )
    settings.update(overrides)
    return Gemma3TextConfig(**settings)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"final_logit_softcapping": 3.0, "tie_word_embeddings": False}],
    ids=["plain", "final-soft-cap-untied"],
)
def test_gemma3_matches_transformers(overrides):
    torch.manual_seed(4)
    config = tiny_text_config(**overrides)
    hf_model = perturb_parameters(HFGemma3ForCausalLM(config).eval(), seed=4)
    model, loaded = build_model(Gemma3ForCausalLM, config, hf_model.state_dict().items())
    assert "model.layers.0.self_attn.q_norm.weight" in loaded
    assert model.kv_cache_spec.sliding_windows == [4, None, 4, None]
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


def test_gemma3_in_bfloat16_stays_close_to_float32():
    torch.manual_seed(4)
    config = tiny_text_config()
    hf_model = perturb_parameters(HFGemma3ForCausalLM(config).eval(), seed=4)
    model, _ = build_model(Gemma3ForCausalLM, config, hf_model.state_dict().items(), dtype=torch.bfloat16)
    assert model.model.embedding_multiplier.dtype == torch.bfloat16
    assert_close_to_float32(model, hf_model, PROMPTS)


def test_gemma3_local_layers_use_their_own_rope_base():
    model, _ = build_model_without_weights(tiny_text_config())
    local_rope = model.model.layers[0].self_attn.rotary_emb
    global_rope = model.model.layers[1].self_attn.rotary_emb
    assert local_rope is model.model.layers[2].self_attn.rotary_emb
    assert not torch.allclose(local_rope.cos_cache[5], global_rope.cos_cache[5])


def test_gemma3_attention_soft_cap_reaches_every_attention_layer():
    # transformers' Gemma3 ignores attn_logit_softcapping (released configs leave it null);
    # tokenloom applies it when set, so the kernel tests cover the math
    model, _ = build_model_without_weights(tiny_text_config(attn_logit_softcapping=2.0))
    assert {layer.self_attn.attn.logits_soft_cap for layer in model.model.layers} == {2.0}


def build_model_without_weights(config):
    return build_model_without_weights_of(Gemma3ForCausalLM, config), None


def build_model_without_weights_of(model_class, config):
    from tokenloom.core.model_interface import ModelContext

    return model_class(ModelContext(hf_config=config, dtype=torch.float32, device=torch.device("cpu")))


def test_gemma3_legacy_config_fields_select_the_local_rope_base():
    config = tiny_text_config()
    # a transformers-4.x style config: no nested rope_parameters, a separate local base
    config.rope_parameters = None
    config.rope_theta = 1000000.0
    config.rope_local_base_freq = 10.0
    model, _ = build_model_without_weights(config)
    inv_freq_local = model.model.layers[0].self_attn.rotary_emb
    expected = torch.cos(torch.tensor(3.0) * (1.0 / 10.0 ** (2 / 16)))
    torch.testing.assert_close(inv_freq_local.cos_cache[3, 1], expected)


def tiny_multimodal_config() -> Gemma3Config:
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    return Gemma3Config(
        text_config=tiny_text_config().to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=150,
    )


def test_gemma3_conditional_generation_text_part_matches_transformers():
    torch.manual_seed(5)
    config = tiny_multimodal_config()
    hf_model = perturb_parameters(HFGemma3ForConditionalGeneration(config).eval(), seed=5)
    weights = hf_model.state_dict()
    model, loaded = build_model(Gemma3ForConditionalGeneration, config, weights.items())
    assert "vision_tower.encoder.layers.0.self_attn.qkv_proj.weight" in loaded
    assert "multi_modal_projector.mm_input_projection_weight" in loaded
    prompts = [[2, 17, 99, 3, 42, 7, 8, 140, 66], [2, 120, 4, 9, 10]]
    assert_matches_transformers(model, hf_model, prompts, num_new_tokens=5)


def test_gemma3_conditional_generation_accepts_legacy_checkpoint_names():
    config = tiny_multimodal_config()
    hf_model = perturb_parameters(HFGemma3ForConditionalGeneration(config).eval(), seed=6)
    # the layout transformers < 4.52 saved: language_model.model.*, vision_tower.vision_model.*, ...
    renames = (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    legacy = {}
    for name, tensor in hf_model.state_dict().items():
        for prefix, replacement in renames:
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
                break
        legacy[name] = tensor
    model, _ = build_model(Gemma3ForConditionalGeneration, config, legacy.items())
    expected, _ = build_model(Gemma3ForConditionalGeneration, config, hf_model.state_dict().items())
    torch.testing.assert_close(model.state_dict(), expected.state_dict())


def test_gemma3_conditional_generation_refuses_what_is_neither_text_nor_vision():
    config = tiny_multimodal_config()
    hf_model = perturb_parameters(HFGemma3ForConditionalGeneration(config).eval(), seed=6)
    weights = [*hf_model.state_dict().items(), ("model.audio_tower.proj.weight", torch.zeros(3))]
    with pytest.raises(ModelLoadError, match=r"has no parameter for: model\.audio_tower\.proj\.weight"):
        build_model(Gemma3ForConditionalGeneration, config, weights)


def test_gemma3_conditional_generation_needs_its_vision_config():
    with pytest.raises(ConfigError, match="needs its text_config and its vision_config"):
        build_model_without_weights_of(Gemma3ForConditionalGeneration, tiny_text_config())


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {
        "Gemma3ForCausalLM": "tokenloom.builtin_plugins.models.modeling_gemma3:Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration": "tokenloom.builtin_plugins.models.modeling_gemma3:Gemma3ForConditionalGeneration",
    }
    assert {name: registered[name] for name in expected} == expected
