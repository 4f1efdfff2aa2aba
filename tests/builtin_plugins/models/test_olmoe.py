"""OlmoeForCausalLM against transformers on tiny random models: from safetensors (per-expert
tensors stacked at load; whole-projection q/k norms with grouped KV heads; routing renormalised or
not; queries, keys and values clipped) and from GGUF (llama.cpp's ``olmoe``, stacked
``ffn_*_exps``, float32 and Q8_0); every position's logits through the paged cache, and greedy ids
through the engine."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers.gguf_files import write_model_gguf
from helpers.model_parity import (
    assert_matches_transformers,
    assert_served_greedy_agrees,
    build_model,
    load_checkpoint,
    randomize_parameters,
)
from helpers.moe_checkpoints import through_quant_type
from transformers import OlmoeConfig
from transformers import OlmoeForCausalLM as HFOlmoeForCausalLM

from tokenloom.builtin_plugins.loaders.gguf_config import gguf_to_hf_config
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_olmoe import OlmoeForCausalLM
from tokenloom.layers.fused_moe import FusedMoE

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    pad_token_id=1,
    eos_token_id=2,
)


def hf_olmoe(seed: int = 0, **overrides) -> HFOlmoeForCausalLM:
    torch.manual_seed(seed)
    return randomize_parameters(HFOlmoeForCausalLM(OlmoeConfig(**{**TINY, **overrides})).eval(), seed)


@pytest.mark.parametrize(
    "overrides",
    [dict(norm_topk_prob=False), dict(norm_topk_prob=True, clip_qkv=0.8)],
    ids=["raw", "renormalised-clipped"],
)
def test_olmoe_from_safetensors_matches_transformers(overrides, tmp_path):
    hf_model = hf_olmoe(seed=3, **overrides)
    config, weights = load_checkpoint("safetensors", hf_model, tmp_path)
    assert any(".mlp.experts.7.down_proj." in name for name, _ in weights)
    model, _ = build_model(OlmoeForCausalLM, config, weights)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, FusedMoE) and layer.mlp.shared_expert is None
    assert layer.mlp.renormalize == overrides["norm_topk_prob"]
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


@pytest.mark.parametrize("quant_type", [None, GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_olmoe_from_gguf_matches_transformers(quant_type, tmp_path):
    """llama.cpp never renormalises an olmoe file's routing weights: neither does the config."""
    hf_model = hf_olmoe(seed=4, num_key_value_heads=4)  # llama.cpp's olmoe norms keys over n_embd
    if quant_type is not None:
        hf_model = through_quant_type(hf_model, quant_type)
    path = write_model_gguf(
        str(tmp_path / "model.gguf"),
        "olmoe",
        hf_model.config,
        hf_model.state_dict(),
        quant_type=quant_type,
        expert_quant_type=quant_type,
    )
    config = gguf_to_hf_config(GGUFFile(path))
    assert (config.architectures, config.norm_topk_prob, config.intermediate_size) == (["OlmoeForCausalLM"], False, 32)
    assert_served_greedy_agrees(hf_model, path, PROMPTS, distinct=False)


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    assert registered["OlmoeForCausalLM"] == "tokenloom.builtin_plugins.models.modeling_olmoe:OlmoeForCausalLM"
