"""GraniteForCausalLM against transformers on tiny random models, from safetensors and from GGUF
(llama.cpp's ``granite`` architecture, Q/K rows permuted as for Llama): each of the four
multipliers far from 1 so a forgotten one shows (embedding, residual, attention scale, logits
divisor), tied and untied; every position's logits through the paged cache, greedy ids through
the engine; GGUF files that leave multipliers out read as llama.cpp reads them; and a checkpoint
tensor the model has no parameter for refused by name."""

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
from transformers import GraniteConfig
from transformers import GraniteForCausalLM as HFGraniteForCausalLM

from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_granite import GraniteForCausalLM
from tokenloom.errors import ModelLoadError

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    embedding_multiplier=6.0,
    residual_multiplier=0.4,
    attention_multiplier=0.25,  # head size 16: not 1/sqrt(16) either
    logits_scaling=3.0,
)


def hf_granite(seed: int = 0, **overrides) -> HFGraniteForCausalLM:
    torch.manual_seed(seed)
    return randomize_parameters(HFGraniteForCausalLM(GraniteConfig(**{**TINY, **overrides})).eval(), seed)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
@pytest.mark.parametrize("tie_word_embeddings", [False, True], ids=["untied", "tied"])
def test_granite_matches_transformers(load_format, tie_word_embeddings, tmp_path):
    hf_model = hf_granite(seed=3, tie_word_embeddings=tie_word_embeddings)
    config, weights = load_checkpoint(load_format, hf_model, tmp_path)
    assert (
        config.embedding_multiplier,
        config.residual_multiplier,
        config.attention_multiplier,
        config.logits_scaling,
        config.tie_word_embeddings,
    ) == pytest.approx((6.0, 0.4, 0.25, 3.0, tie_word_embeddings))
    model, _ = build_model(GraniteForCausalLM, config, weights)
    assert model.model.layers[0].self_attn.attn.scale == pytest.approx(0.25)
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
def test_granite_served_greedy_matches_transformers(load_format, tmp_path):
    """Through the engine (scheduler, paged cache, sampler) as a server runs it."""
    hf_model = hf_granite(seed=5)
    assert_served_greedy_agrees(hf_model, saved_checkpoint(load_format, hf_model, tmp_path), PROMPTS)


def test_a_gguf_without_multipliers_reads_as_llama_cpp_does(tmp_path):
    """llama.cpp: no embedding / residual scale means none, no attention scale 1/sqrt(head size);
    the logit scale is required."""
    from helpers.gguf_files import write_metadata_only_gguf

    from tokenloom.builtin_plugins.loaders.gguf_config import gguf_to_hf_config
    from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile

    path = write_metadata_only_gguf(str(tmp_path / "m.gguf"), "granite", extra={"granite.logit_scale": 8.0})
    config = gguf_to_hf_config(GGUFFile(path))
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (1.0, 1.0, 8.0)
    assert config.attention_multiplier == pytest.approx(16**-0.5)  # 32 features over 2 heads
    path = write_metadata_only_gguf(str(tmp_path / "incomplete.gguf"), "granite")
    with pytest.raises(ModelLoadError, match=r"granite\.logit_scale"):
        gguf_to_hf_config(GGUFFile(path))


def test_a_checkpoint_tensor_without_a_parameter_is_refused():
    hf_model = hf_granite()
    weights = [*hf_model.state_dict().items(), ("model.layers.2.self_attn.q_norm.weight", torch.ones(16))]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.self_attn\.q_norm\.weight"):
        build_model(GraniteForCausalLM, hf_model.config, weights)


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {"GraniteForCausalLM": "tokenloom.builtin_plugins.models.modeling_granite:GraniteForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
