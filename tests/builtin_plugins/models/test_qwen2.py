"""Qwen2ForCausalLM against transformers on tiny random models: QKV biases, tied embeddings,
and sliding windows on the upper layers (``use_sliding_window`` + ``max_window_layers``)."""

from __future__ import annotations

import pytest
import torch
from helpers.model_parity import assert_matches_transformers, build_model, perturb_parameters
from transformers import Qwen2Config
from transformers import Qwen2ForCausalLM as HFQwen2ForCausalLM

from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_qwen2 import Qwen2ForCausalLM

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=1000000.0,
)


@pytest.mark.parametrize(
    "overrides, windows",
    [
        ({"tie_word_embeddings": True}, [None, None, None]),
        (
            {"tie_word_embeddings": False, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
            [None, 4, 4],
        ),
    ],
    ids=["tied", "sliding-window"],
)
def test_qwen2_matches_transformers(overrides, windows):
    torch.manual_seed(3)
    config = Qwen2Config(**TINY, **overrides)
    hf_model = perturb_parameters(HFQwen2ForCausalLM(config).eval())
    assert hf_model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    model, loaded = build_model(Qwen2ForCausalLM, config, hf_model.state_dict().items())
    assert "model.layers.2.self_attn.qkv_proj.bias" in loaded
    assert model.model.layers[0].self_attn.o_proj.bias is None
    assert model.kv_cache_spec.sliding_windows == windows
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=7)


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {"Qwen2ForCausalLM": "tokenloom.builtin_plugins.models.modeling_qwen2:Qwen2ForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
