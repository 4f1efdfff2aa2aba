"""LlamaForCausalLM and MistralForCausalLM against transformers on tiny random models:
every position's logits and greedy tokens through the paged cache, tied and untied
embeddings, biases, scaled RoPE (Llama 3's also from a GGUF file, where llama.cpp stores it as
per-frequency factors), a sliding window, packed (dequantize-on-load) weights, and the refusal of
a mixture-of-experts config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.model_parity import (
    assert_close_to_float32,
    assert_matches_transformers,
    build_model,
    load_checkpoint,
    perturb_parameters,
    randomize_parameters,
)
from transformers import LlamaConfig, MistralConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers import MistralForCausalLM as HFMistralForCausalLM

from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_llama import LlamaForCausalLM, MistralForCausalLM
from tokenloom.errors import ModelLoadError

PROMPTS = [[5, 17, 99, 3, 42, 7, 8], [120, 4], [33, 61, 2, 90, 11, 150, 23, 8, 77, 5, 64]]

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)


def hf_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    return perturb_parameters(HFLlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval(), seed)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": False},
        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
        {"num_key_value_heads": 4, "head_dim": 8},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ],
    ids=["untied", "tied-bias", "mha-head-dim", "llama3-rope"],
)
def test_llama_matches_transformers(overrides):
    hf_model = hf_llama(**overrides)
    model, loaded = build_model(LlamaForCausalLM, hf_model.config, hf_model.state_dict().items())
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded
    assert ("lm_head.weight" in loaded) != hf_model.config.tie_word_embeddings
    assert_matches_transformers(model, hf_model, PROMPTS)


# Llama 3.1's scaling with an original context of 8 positions: every prompt here outgrows it
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def hf_greedy(hf_model, prompts, num_new_tokens):
    with torch.no_grad():
        return [
            hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=num_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            for prompt in prompts
        ]


@pytest.mark.parametrize("load_format", ["safetensors", "gguf"])
def test_llama3_rope_scaling_matches_transformers_from_safetensors_and_gguf(load_format, tmp_path):
    hf_model = randomize_parameters(hf_llama(tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE)), seed=4)
    # the scaling decides greedy tokens here: the same weights without it generate others
    unscaled = hf_llama(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    unscaled.load_state_dict(hf_model.state_dict())
    assert hf_greedy(unscaled, PROMPTS, 8) != hf_greedy(hf_model, PROMPTS, 8)

    config, weights = load_checkpoint(load_format, hf_model, tmp_path)
    model, _ = build_model(LlamaForCausalLM, config, weights)
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)
    if load_format == "gguf":
        # llama.cpp's converter keeps the scaling only as per-frequency divisors (rope_freqs.weight)
        assert config.rope_parameters["rope_type"] == "default" and len(config.rope_parameters["freq_factors"]) == 8


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "attention_factor": 0.9,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        },
    ],
    ids=["linear", "yarn", "yarn-betas"],
)
def test_scaled_rope_from_gguf_metadata_matches_transformers(rope_parameters, tmp_path):
    hf_model = randomize_parameters(hf_llama(tie_word_embeddings=False, rope_parameters=dict(rope_parameters)), seed=5)
    config, weights = load_checkpoint("gguf", hf_model, tmp_path)
    model, _ = build_model(LlamaForCausalLM, config, weights)
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=5)
    assert config.rope_parameters["rope_type"] == rope_parameters["rope_type"]


def test_mistral_sliding_window_matches_transformers():
    torch.manual_seed(1)
    config = MistralConfig(**TINY, sliding_window=5, tie_word_embeddings=False)
    hf_model = perturb_parameters(HFMistralForCausalLM(config).eval(), 1)
    model, _ = build_model(MistralForCausalLM, config, hf_model.state_dict().items())
    assert model.kv_cache_spec.sliding_windows == [5, 5, 5]
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


def test_llama_in_bfloat16_stays_close_to_float32():
    hf_model = hf_llama(seed=3)
    model, _ = build_model(LlamaForCausalLM, hf_model.config, hf_model.state_dict().items(), dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert_close_to_float32(model, hf_model, PROMPTS)


class PackedTensor:
    """Stands in for a quantized checkpoint tensor: only ``dequantize()`` yields values."""

    def __init__(self, tensor):
        self._tensor = tensor

    def dequantize(self):
        return self._tensor.clone()


def test_packed_weights_are_dequantized_on_load():
    hf_model = hf_llama(seed=2)
    model, _ = build_model(
        LlamaForCausalLM,
        hf_model.config,
        ((name, PackedTensor(tensor)) for name, tensor in hf_model.state_dict().items()),
    )
    assert_matches_transformers(model, hf_model, PROMPTS[:2], num_new_tokens=3)


def test_missing_weight_is_named():
    hf_model = hf_llama()
    weights = [
        (name, tensor) for name, tensor in hf_model.state_dict().items() if "layers.1.self_attn.v_proj" not in name
    ]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight \(shard v\)"):
        build_model(LlamaForCausalLM, hf_model.config, weights)


def test_wrong_shape_names_the_checkpoint_tensor():
    hf_model = hf_llama()
    weights = dict(hf_model.state_dict())
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    with pytest.raises(ModelLoadError, match="up_proj"):
        build_model(LlamaForCausalLM, hf_model.config, weights.items())


def test_a_checkpoint_tensor_without_a_parameter_is_refused():
    """A Qwen3-style q/k norm given to Llama would be dropped and the model serve wrong text."""
    hf_model = hf_llama()
    weights = [*hf_model.state_dict().items(), ("model.layers.1.self_attn.q_norm.weight", torch.ones(16))]
    with pytest.raises(
        ModelLoadError, match=r"LlamaForCausalLM has no parameter for: model\.layers\.1\.self_attn\.q_norm\.weight"
    ):
        build_model(LlamaForCausalLM, hf_model.config, weights)
    # the rotary buffers some exporters save are no weights: ignored
    buffers = [(f"model.layers.{index}.self_attn.rotary_emb.inv_freq", torch.ones(8)) for index in range(3)]
    build_model(LlamaForCausalLM, hf_model.config, [*hf_model.state_dict().items(), *buffers])


def test_serving_a_checkpoint_with_a_tensor_the_model_lacks_fails_naming_it(tmp_path):
    """Through the offline API, as a user meets it: the engine does not start."""
    from safetensors.torch import load_file, save_file

    from tokenloom import LLM

    hf_model = hf_llama()
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.2.self_attn.k_norm.weight"] = torch.ones(16)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"no parameter for: model\.layers\.2\.self_attn\.k_norm\.weight"):
        LLM(
            model=str(tmp_path),
            dtype="float32",
            max_model_len=64,
            kv_cache_memory_bytes=2**20,
            skip_tokenizer_init=True,
        )


def test_a_gguf_tensor_without_a_counterpart_is_refused(tmp_path):
    from helpers.gguf_files import write_model_gguf

    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
    from tokenloom.core.config import LoadConfig, ModelConfig

    hf_model = hf_llama()
    path = write_model_gguf(
        str(tmp_path / "model.gguf"),
        "llama",
        hf_model.config,
        hf_model.state_dict(),
        extra_tensors={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)},
    )
    with pytest.raises(ModelLoadError, match=r"GGUF tensor blk\.0\.attn_q_norm\.weight .* no counterpart"):
        list(GGUFLoadFormat().iterate_weights(path, ModelConfig(), LoadConfig(use_tqdm_on_load=False)))


def test_kv_cache_spec_and_registration():
    hf_model = hf_llama()
    model, _ = build_model(LlamaForCausalLM, hf_model.config, hf_model.state_dict().items())
    spec = model.kv_cache_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.sliding_windows) == (3, 2, 16, [None] * 3)
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {
        "LlamaForCausalLM": "tokenloom.builtin_plugins.models.modeling_llama:LlamaForCausalLM",
        "MistralForCausalLM": "tokenloom.builtin_plugins.models.modeling_llama:MistralForCausalLM",
    }
    assert {name: registered[name] for name in expected} == expected
