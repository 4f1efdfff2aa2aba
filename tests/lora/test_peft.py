"""PEFT adapter files read exactly: scaling (alpha / r, rsLoRA's alpha / sqrt(r)) folded into B,
both weight files, canonical names whatever the checkpoint's prefix, and each refusal naming
what to change."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from tokenloom.lora.peft import LoRAAdapterError, load_peft_adapter, module_shapes_from_config

SHAPES = {"layers.0.self_attn.q_proj": (8, 8), "layers.0.mlp.down_proj": (16, 8)}


def write_adapter(directory, tensors, *, safetensors=True, **config):
    directory.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"], "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps({**base, **config}))
    if safetensors:
        save_file(tensors, str(directory / "adapter_model.safetensors"))
    else:
        torch.save(tensors, str(directory / "adapter_model.bin"))
    return str(directory)


def tensors(prefix="base_model.model.model.", rank=2):
    generator = torch.Generator().manual_seed(0)
    return {
        f"{prefix}layers.0.self_attn.q_proj.lora_A.weight": torch.randn(rank, 8, generator=generator),
        f"{prefix}layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, rank, generator=generator),
        f"{prefix}layers.0.mlp.down_proj.lora_A.weight": torch.randn(rank, 16, generator=generator),
        f"{prefix}layers.0.mlp.down_proj.lora_B.weight": torch.randn(8, rank, generator=generator),
    }


@pytest.mark.parametrize("safetensors", [True, False])
@pytest.mark.parametrize("rslora", [False, True])
def test_scaling_is_folded_into_b(tmp_path, safetensors, rslora):
    source = tensors()
    path = write_adapter(tmp_path / "a", source, safetensors=safetensors, use_rslora=rslora)
    adapter = load_peft_adapter(path, max_lora_rank=4, module_shapes=SHAPES)
    scaling = 4 / math.sqrt(2) if rslora else 4 / 2
    assert adapter.scaling == pytest.approx(scaling) and adapter.rank == 2
    lora_a, lora_b = adapter.weights["layers.0.self_attn.q_proj"]
    assert torch.equal(lora_a, source["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(lora_b, source["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] * scaling)
    assert adapter.target_modules == ["down_proj", "q_proj"]


def test_multimodal_prefixes_map_to_the_same_names(tmp_path):
    path = write_adapter(tmp_path / "a", tensors(prefix="base_model.model.model.language_model."))
    adapter = load_peft_adapter(path, max_lora_rank=4, module_shapes=SHAPES)
    assert set(adapter.weights) == set(SHAPES)


@pytest.mark.parametrize(
    ("config", "rank", "shapes", "message"),
    [
        ({}, 2, {**SHAPES, "layers.0.self_attn.q_proj": (4, 8)}, r"q_proj maps 8 -> 8 features, but .* maps 4 -> 8"),
        ({"r": 8}, 8, SHAPES, r"rank 8, more than --max-lora-rank 4"),
        ({}, 2, {"layers.0.self_attn.q_proj": (8, 8)}, r"targets layers\.0\.mlp\.down_proj, which .* does not have"),
        ({"use_dora": True}, 2, SHAPES, "DoRA"),
        ({"peft_type": "IA3"}, 2, SHAPES, "IA3 adapter"),
        ({"target_modules": ["q_proj", "wte"]}, 2, SHAPES, "targets wte"),
        ({"rank_pattern": {"q_proj": 4}}, 2, SHAPES, "rank_pattern"),
    ],
)
def test_refusals_name_what_does_not_fit(tmp_path, config, rank, shapes, message):
    path = write_adapter(tmp_path / "a", tensors(rank=rank), **{"r": rank, **config})
    with pytest.raises(LoRAAdapterError, match=message):
        load_peft_adapter(path, max_lora_rank=4, module_shapes=shapes)


def test_missing_half_and_unknown_tensors_are_refused(tmp_path):
    half = tensors()
    del half["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    with pytest.raises(LoRAAdapterError, match="no lora_B weight for layers.0.mlp.down_proj"):
        load_peft_adapter(write_adapter(tmp_path / "half", half), max_lora_rank=4, module_shapes=SHAPES)
    odd = {**tensors(), "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.zeros(2, 8)}
    with pytest.raises(LoRAAdapterError, match="targets self_attn.rotary; supported targets are self_attn.q_proj"):
        load_peft_adapter(write_adapter(tmp_path / "odd", odd), max_lora_rank=4, module_shapes=SHAPES)
    stray = {**tensors(), "base_model.model.model.norm.weight": torch.zeros(8)}
    with pytest.raises(LoRAAdapterError, match="does not know how to apply: base_model.model.model.norm.weight"):
        load_peft_adapter(write_adapter(tmp_path / "stray", stray), max_lora_rank=4, module_shapes=SHAPES)
    with pytest.raises(LoRAAdapterError, match="has no adapter_config.json"):
        load_peft_adapter(str(tmp_path), max_lora_rank=4, module_shapes=SHAPES)


def test_module_shapes_from_a_gqa_config():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    shapes = module_shapes_from_config(config)
    assert len(shapes) == 16
    assert shapes["embed_tokens"] == (config.vocab_size, 64) and shapes["lm_head"] == (64, config.vocab_size)
    assert shapes["layers.1.self_attn.k_proj"] == (64, 32)
    assert shapes["layers.1.self_attn.o_proj"] == (64, 64)
    assert shapes["layers.0.mlp.down_proj"] == (96, 64)


# ---- embed_tokens and lm_head ----------------------------------------------------------------

VOCAB = 12
EMBEDDING_SHAPES = {**SHAPES, "embed_tokens": (VOCAB, 8), "lm_head": (8, VOCAB)}


def embedding_tensors(rank=2, vocab=VOCAB, base_rows=VOCAB):
    """As PEFT saves an adapter on embed_tokens and lm_head: the LoRA weights, and the base
    weights beside them (save_embedding_layers)."""
    generator = torch.Generator().manual_seed(1)
    prefix = "base_model.model."
    return {
        **tensors(rank=rank),
        f"{prefix}model.embed_tokens.lora_embedding_A": torch.randn(rank, vocab, generator=generator),
        f"{prefix}model.embed_tokens.lora_embedding_B": torch.randn(8, rank, generator=generator),
        f"{prefix}model.embed_tokens.base_layer.weight": torch.randn(base_rows, 8, generator=generator),
        f"{prefix}lm_head.lora_A.weight": torch.randn(rank, 8, generator=generator),
        f"{prefix}lm_head.lora_B.weight": torch.randn(vocab, rank, generator=generator),
        f"{prefix}lm_head.base_layer.weight": torch.randn(base_rows, 8, generator=generator),
    }


def test_embedding_and_lm_head_weights_are_read_with_scaling(tmp_path):
    source = embedding_tensors()
    path = write_adapter(tmp_path / "a", source, target_modules=["q_proj", "down_proj", "embed_tokens", "lm_head"])
    adapter = load_peft_adapter(path, max_lora_rank=4, module_shapes=EMBEDDING_SHAPES)
    assert set(adapter.weights) == set(EMBEDDING_SHAPES)  # the saved base weights are not adapter weights
    embed_a, embed_b = adapter.weights["embed_tokens"]
    assert torch.equal(embed_a, source["base_model.model.model.embed_tokens.lora_embedding_A"])
    assert torch.equal(embed_b, source["base_model.model.model.embed_tokens.lora_embedding_B"] * 2)
    head_a, head_b = adapter.weights["lm_head"]
    assert torch.equal(head_a, source["base_model.model.lm_head.lora_A.weight"])
    assert torch.equal(head_b, source["base_model.model.lm_head.lora_B.weight"] * 2)
    assert adapter.target_modules == ["down_proj", "embed_tokens", "lm_head", "q_proj"]


@pytest.mark.parametrize(
    ("source", "config", "message"),
    [
        (embedding_tensors(vocab=VOCAB + 3, base_rows=VOCAB + 3), {}, r"trained over 15 tokens .*3 more than .* 12"),
        (embedding_tensors(base_rows=VOCAB + 1), {}, r"13 tokens \(embed_tokens\.base_layer\.weight\).*adds tokens"),
        (tensors(), {"modules_to_save": ["embed_tokens", "lm_head"]}, r"saves whole embed_tokens, lm_head"),
        (tensors(), {"trainable_token_indices": [3, 4]}, "trainable_token_indices"),
        (
            {**tensors(), "base_model.model.model.embed_tokens.weight": torch.zeros(VOCAB + 2, 8)},
            {},
            r"not a LoRA of embed_tokens or lm_head \(base_model\.model\.model\.embed_tokens\.weight\)",
        ),
        (
            {**tensors(), "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(2, VOCAB)},
            {},
            "embed_tokens as PEFT's embedding LoRA",
        ),
    ],
    ids=["resized-lora", "resized-base", "modules-to-save", "trainable-tokens", "whole-embedding", "linear-embedding"],
)
def test_adapters_that_add_tokens_are_refused_saying_why(tmp_path, source, config, message):
    path = write_adapter(tmp_path / "a", source, **config)
    with pytest.raises(LoRAAdapterError, match=message) as refused:
        load_peft_adapter(path, max_lora_rank=4, module_shapes=EMBEDDING_SHAPES)
    if "embedding LoRA" not in message:  # each refusal of a new vocabulary says why
        assert "no per-adapter vocabulary" in refused.value.message


# -- broken weights (issue 37, items 3 and 11) -----------------------------------------------------

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (Q_A, float("nan"), "q_proj's lora_A holds nan or inf"),
        (Q_B, float("inf"), "q_proj's lora_B times the scaling 2 holds nan or inf"),
        # finite in float32, but times alpha / r = 2 it is not
        (Q_B, 3e38, "q_proj's lora_B times the scaling 2 holds nan or inf"),
    ],
)
def test_non_finite_weights_are_refused_at_load(tmp_path, key, value, message):
    source = tensors()
    source[key] = torch.full_like(source[key], value)
    with pytest.raises(LoRAAdapterError, match=message):
        load_peft_adapter(write_adapter(tmp_path / "a", source), max_lora_rank=4, module_shapes=SHAPES)


def test_weights_beyond_the_lora_dtype_are_refused_and_finite_extremes_are_not(tmp_path):
    source = tensors()
    source[Q_A] = torch.full_like(source[Q_A], 3e38)  # finite in float32 and bfloat16
    path = write_adapter(tmp_path / "a", source)
    for dtype in (None, torch.float32, torch.bfloat16):
        load_peft_adapter(path, max_lora_rank=4, module_shapes=SHAPES, dtype=dtype)
    with pytest.raises(LoRAAdapterError, match=r"lora_A holds values beyond float16's range \(±6.55e\+04"):
        load_peft_adapter(path, max_lora_rank=4, module_shapes=SHAPES, dtype=torch.float16)


@pytest.mark.parametrize("safetensors", [True, False])
@pytest.mark.parametrize("shape", [(), (2,), (2, 8, 1)], ids=["0-dim", "1-dim", "3-dim"])
def test_lora_a_that_is_not_a_matrix_is_refused(tmp_path, safetensors, shape):
    source = tensors()
    source[Q_A] = torch.ones(shape)
    path = write_adapter(tmp_path / "a", source, safetensors=safetensors)
    with pytest.raises(LoRAAdapterError, match="each must be a matrix"):
        load_peft_adapter(path, max_lora_rank=4, module_shapes=SHAPES)


def test_a_bin_file_that_is_not_a_mapping_of_tensors_is_refused(tmp_path):
    path = tmp_path / "a"
    write_adapter(path, tensors(), safetensors=False)
    torch.save([torch.ones(2)], str(path / "adapter_model.bin"))
    with pytest.raises(LoRAAdapterError, match="not a mapping of names to tensors"):
        load_peft_adapter(str(path), max_lora_rank=4, module_shapes=SHAPES)
    torch.save({"a": 1}, str(path / "adapter_model.bin"))
    with pytest.raises(LoRAAdapterError, match="not a mapping of names to tensors"):
        load_peft_adapter(str(path), max_lora_rank=4, module_shapes=SHAPES)
