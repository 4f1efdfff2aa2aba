"""Phi3ForCausalLM against transformers on tiny random models, from safetensors and from GGUF
(llama.cpp's ``phi3`` architecture): the fused ``qkv_proj`` and ``gate_up_proj`` of the
checkpoint split at load; a sliding window; LongRoPE with a partial rotary dimension, exact
within its original context and refused past it; every position's logits through the paged
cache, greedy ids through the engine; fused tensors of the wrong shape refused by name."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers.model_parity import (
    assert_greedy_agrees,
    assert_matches_transformers,
    assert_served_greedy_agrees,
    build_model,
    load_checkpoint,
    randomize_parameters,
    saved_checkpoint,
    served_greedy_top_k,
)
from transformers import Phi3Config
from transformers import Phi3ForCausalLM as HFPhi3ForCausalLM

from tokenloom import LLM
from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_phi3 import Phi3ForCausalLM
from tokenloom.errors import ConfigError, ModelLoadError

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Phi-3-mini-128k's shape of scaling: a context 4x the original one, a rotary dimension of 12 of 16
LONGROPE = dict(
    max_position_embeddings=256,
    original_max_position_embeddings=64,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
    },
)
WITHIN_ORIGINAL = SimpleNamespace(max_model_len=64, disable_sliding_window=False)


def hf_phi3(seed: int = 0, **overrides) -> HFPhi3ForCausalLM:
    torch.manual_seed(seed)
    # a copy: transformers fills in the RoPE dict it is given
    config = Phi3Config(**copy.deepcopy({**TINY, **overrides}))
    return randomize_parameters(HFPhi3ForCausalLM(config).eval(), seed)


@pytest.mark.parametrize(
    ("load_format", "overrides"),
    [
        ("safetensors", {}),
        ("safetensors", {"sliding_window": 5}),
        ("safetensors", {**LONGROPE, "tie_word_embeddings": True}),
        ("gguf", {}),
        ("gguf", LONGROPE),
    ],
    ids=["safetensors", "safetensors-sliding", "safetensors-longrope-tied", "gguf", "gguf-longrope"],
)
def test_phi3_matches_transformers(load_format, overrides, tmp_path):
    hf_model = hf_phi3(seed=3, **overrides)
    config, weights = load_checkpoint(load_format, hf_model, tmp_path)
    model, loaded = build_model(Phi3ForCausalLM, config, weights, model_config=WITHIN_ORIGINAL)
    assert {"model.layers.2.self_attn.qkv_proj.weight", "model.layers.2.mlp.gate_up_proj.weight"} <= loaded
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert rotary.rotary_dim == (12 if "rope_parameters" in overrides else 16)
    assert model.kv_cache_spec.sliding_windows == [overrides.get("sliding_window")] * 3
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
def test_phi3_served_greedy_matches_transformers(load_format, tmp_path):
    """Through the engine (scheduler, paged cache, sampler) as a server runs it, LongRoPE included."""
    hf_model = hf_phi3(seed=5, **LONGROPE)
    assert_served_greedy_agrees(hf_model, saved_checkpoint(load_format, hf_model, tmp_path), PROMPTS)


def test_a_quantized_gguf_with_two_tensor_parallel_ranks_agrees_with_one(tmp_path):
    """-tp 2 on a Q8_0 file: the packed fused tensors are cut into q/k/v and gate/up, then into
    each rank's rows, without unpacking."""
    from gguf import GGMLQuantizationType
    from helpers.gguf_files import write_model_gguf

    hf_model = hf_phi3(seed=5, intermediate_size=128, **LONGROPE)  # each rank's down_proj: whole blocks
    path = write_model_gguf(
        str(tmp_path / "model.gguf"),
        "phi3",
        hf_model.config,
        hf_model.state_dict(),
        quant_type=GGMLQuantizationType.Q8_0,
    )
    options = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=2**20, skip_tokenizer_init=True)
    expected = served_greedy_top_k(LLM(model=path, **options), PROMPTS, 10)
    assert all(len(set(tokens)) > 3 for tokens, _ in expected), "greedy decoding is degenerate"
    llm = LLM(model=path, tensor_parallel_size=2, **options)
    try:
        assert_greedy_agrees(served_greedy_top_k(llm, PROMPTS, 10), expected)
    finally:
        llm.engine.shutdown()


def test_longrope_past_the_original_context_is_refused_saying_what_to_pass():
    """Past its original context transformers switches the whole sequence to the long factors
    and recomputes its cache; a paged cache cannot, so the longer context is refused."""
    hf_model = hf_phi3(**LONGROPE)
    for model_config in (None, SimpleNamespace(max_model_len=65, disable_sliding_window=False)):
        with pytest.raises(ConfigError, match=r"longrope.*--max-model-len 64"):
            build_model(Phi3ForCausalLM, hf_model.config, hf_model.state_dict().items(), model_config=model_config)


def test_a_fused_tensor_of_the_wrong_shape_is_refused_by_name():
    hf_model = hf_phi3()
    weights = dict(hf_model.state_dict())
    weights["model.layers.1.self_attn.qkv_proj.weight"] = weights["model.layers.1.self_attn.qkv_proj.weight"][:-16]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        build_model(Phi3ForCausalLM, hf_model.config, weights.items())


def test_a_checkpoint_tensor_without_a_parameter_is_refused():
    hf_model = hf_phi3()
    weights = [*hf_model.state_dict().items(), ("model.layers.0.self_attn.qkv_proj.bias", torch.ones(128))]
    with pytest.raises(ModelLoadError, match=r"qkv_proj\.bias"):
        build_model(Phi3ForCausalLM, hf_model.config, weights)


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {"Phi3ForCausalLM": "tokenloom.builtin_plugins.models.modeling_phi3:Phi3ForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
