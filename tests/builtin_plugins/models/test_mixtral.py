"""MixtralForCausalLM against transformers on tiny random models: from safetensors
(``block_sparse_moe.experts.{e}.w1/w3/w2`` stacked at load) and from GGUF (llama.cpp's ``llama``
with ``expert_count`` and stacked ``ffn_*_exps``, float32 and Q8_0 experts, the Q/K rows
unpermuted); every position's logits through the paged cache, greedy ids through the engine."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers.gguf_files import write_model_gguf
from helpers.model_parity import (
    assert_matches_transformers,
    assert_served_greedy_agrees,
    build_model,
    load_checkpoint,
    randomize_parameters,
)
from transformers import MixtralConfig
from transformers import MixtralForCausalLM as HFMixtralForCausalLM

from tokenloom.builtin_plugins.loaders.gguf_config import gguf_to_hf_config
from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_mixtral import MixtralForCausalLM
from tokenloom.core.config import LoadConfig, ModelConfig

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=64,
    num_local_experts=6,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-5,
)


def hf_mixtral(seed: int = 0, **overrides) -> HFMixtralForCausalLM:
    torch.manual_seed(seed)
    return randomize_parameters(HFMixtralForCausalLM(MixtralConfig(**{**TINY, **overrides})).eval(), seed)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
def test_mixtral_matches_transformers(load_format, tmp_path):
    hf_model = hf_mixtral(seed=3)
    if load_format == "safetensors":
        config, weights = load_checkpoint("safetensors", hf_model, tmp_path)
        assert any(".block_sparse_moe.experts.5.w2." in name for name, _ in weights)
    else:
        path = write_model_gguf(str(tmp_path / "model.gguf"), "llama", hf_model.config, hf_model.state_dict())
        config = gguf_to_hf_config(GGUFFile(path))
        assert config.architectures == ["MixtralForCausalLM"] and config.num_local_experts == 6
        weights = list(GGUFLoadFormat().iterate_weights(path, ModelConfig(), LoadConfig(use_tqdm_on_load=False)))
    model, _ = build_model(MixtralForCausalLM, config, weights)
    assert model.model.layers[1].mlp.renormalize
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


def test_mixtral_served_from_a_gguf_with_q8_0_experts_agrees_with_transformers(tmp_path):
    """Q8_0 experts (dequantized at load) through the engine, compared the vLLM way."""
    hf_model = hf_mixtral(seed=5)
    with torch.no_grad():  # transformers holds what the file holds
        for name, param in hf_model.named_parameters():
            if ".mlp.experts." in name:
                data = param.detach().numpy()
                round_trip = dequantize(quantize(data, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
                param.copy_(torch.from_numpy(round_trip.reshape(data.shape)))
    path = write_model_gguf(
        str(tmp_path / "model.gguf"),
        "llama",
        hf_model.config,
        hf_model.state_dict(),
        expert_quant_type=GGMLQuantizationType.Q8_0,
    )
    assert_served_greedy_agrees(hf_model, path, PROMPTS, distinct=False)


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {"MixtralForCausalLM": "tokenloom.builtin_plugins.models.modeling_mixtral:MixtralForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
