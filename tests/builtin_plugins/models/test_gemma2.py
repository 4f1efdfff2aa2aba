"""Gemma2ForCausalLM against transformers on tiny random models, from safetensors and from GGUF
(llama.cpp's ``gemma2`` architecture): attention and final logit soft-capping small enough to
bite, a 4-token sliding window on alternate layers (shorter than the prompts), the norms after
attention and around the MLP, ``query_pre_attn_scalar`` and the scaled embedding; every
position's logits through the paged cache, greedy ids through the engine; and a checkpoint
tensor the model has no parameter for refused by name."""

from __future__ import annotations

import numpy as np
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
from transformers import Gemma2Config
from transformers import Gemma2ForCausalLM as HFGemma2ForCausalLM

from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_gemma2 import Gemma2ForCausalLM
from tokenloom.errors import ModelLoadError

PROMPTS = [[2, 17, 99, 3, 42, 7, 8, 140, 66], [2, 120, 4], [2, 33, 61, 5, 90, 11, 150, 23, 8, 77, 5, 64, 31]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,  # not head_dim: the scale must come from the config
    sliding_window=4,
    max_position_embeddings=128,
    rope_theta=10000.0,
    attn_logit_softcapping=6.0,
    final_logit_softcapping=5.0,
)


def hf_gemma2(seed: int = 0, **overrides) -> HFGemma2ForCausalLM:
    torch.manual_seed(seed)
    hf_model = randomize_parameters(HFGemma2ForCausalLM(Gemma2Config(**{**TINY, **overrides})).eval(), seed)
    with torch.no_grad():
        # undo the sqrt(hidden_size) embedding scale in size: a tied head would otherwise see
        # mostly the current token's embedding and repeat it forever
        hf_model.model.embed_tokens.weight.mul_(TINY["hidden_size"] ** -0.5)
    return hf_model


@pytest.mark.parametrize(
    ("load_format", "tie_word_embeddings"),
    [("safetensors", True), ("safetensors", False), ("gguf", True)],
    ids=["safetensors-tied", "safetensors-untied", "gguf"],  # llama.cpp's Gemma 2 is always tied
)
def test_gemma2_matches_transformers(load_format, tie_word_embeddings, tmp_path):
    hf_model = hf_gemma2(seed=3, tie_word_embeddings=tie_word_embeddings)
    config, weights = load_checkpoint(load_format, hf_model, tmp_path)
    if load_format == "gguf":
        # llama.cpp states 1/sqrt(head_dim) for every Gemma 2 but the 27B: the file cannot carry 24
        config.query_pre_attn_scalar = TINY["query_pre_attn_scalar"]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (6.0, 5.0)
    model, loaded = build_model(Gemma2ForCausalLM, config, weights)
    assert {
        "model.layers.3.post_attention_layernorm.weight",
        "model.layers.3.post_feedforward_layernorm.weight",
    } <= loaded
    assert model.kv_cache_spec.sliding_windows == [4, None, 4, None]
    attention = model.model.layers[0].self_attn
    assert attention.q_norm is None and attention.attn.logits_soft_cap == 6.0
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
def test_gemma2_served_greedy_matches_transformers(load_format, tmp_path):
    """Through the engine (scheduler, paged cache, sampler) as a server runs it."""
    hf_model = hf_gemma2(seed=5, query_pre_attn_scalar=TINY["head_dim"])
    assert_served_greedy_agrees(hf_model, saved_checkpoint(load_format, hf_model, tmp_path), PROMPTS)


def test_a_checkpoint_tensor_without_a_parameter_is_refused():
    """A Gemma 3 style q/k norm in a Gemma 2 checkpoint would be dropped; it is named instead."""
    hf_model = hf_gemma2()
    weights = [*hf_model.state_dict().items(), ("model.layers.1.self_attn.q_norm.weight", torch.ones(32))]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.q_norm\.weight"):
        build_model(Gemma2ForCausalLM, hf_model.config, weights)


def test_a_gguf_tensor_without_a_parameter_is_refused(tmp_path):
    from helpers.gguf_files import write_model_gguf

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
    from tokenloom.core.config import LoadConfig, ModelConfig

    hf_model = hf_gemma2()
    path = write_model_gguf(
        str(tmp_path / "model.gguf"),
        "gemma2",
        hf_model.config,
        hf_model.state_dict(),
        extra_tensors={"blk.0.attn_q_norm.weight": np.ones(32, np.float32)},
    )
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q_norm\.weight"):
        list(GGUFLoadFormat().iterate_weights(path, ModelConfig(), LoadConfig(use_tqdm_on_load=False)))


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {"Gemma2ForCausalLM": "tokenloom.builtin_plugins.models.modeling_gemma2:Gemma2ForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
