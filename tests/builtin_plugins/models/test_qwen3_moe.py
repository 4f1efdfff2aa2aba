"""Qwen3MoeForCausalLM against transformers on tiny random models: from safetensors (per-expert
tensors stacked at load; routing renormalised or not, a dense layer among the sparse ones) and
from GGUF (llama.cpp's ``qwen3moe``, stacked ``ffn_*_exps``, float32 and Q4_0 experts); every
position's logits through the paged cache, and greedy ids through the engine, where 4-bit experts
run on the int4 operator."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from helpers.gguf_files import write_model_gguf
from helpers.model_parity import (
    assert_greedy_agrees,
    assert_matches_transformers,
    assert_served_greedy_agrees,
    build_model,
    hf_greedy_top_k,
    load_checkpoint,
    randomize_parameters,
    run_paged_greedy,
)
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from tokenloom.builtin_plugins.loaders.gguf_config import gguf_to_hf_config
from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_qwen3_moe import Qwen3MoeForCausalLM
from tokenloom.builtin_plugins.quantization.gguf import GGUFQuantizationMethod
from tokenloom.core.config import LoadConfig, ModelConfig
from tokenloom.core.model_interface import ModelContext
from tokenloom.kernels import cpu_native
from tokenloom.layers.decoder import GatedMLP
from tokenloom.layers.fused_moe import FusedMoE

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


def hf_qwen3_moe(seed: int = 0, **overrides) -> HFQwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return randomize_parameters(HFQwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY, **overrides})).eval(), seed)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "raw"])
def test_qwen3_moe_from_safetensors_matches_transformers(norm_topk_prob, tmp_path):
    hf_model = hf_qwen3_moe(seed=3, norm_topk_prob=norm_topk_prob, mlp_only_layers=[1])
    config, weights = load_checkpoint("safetensors", hf_model, tmp_path)
    assert any(".mlp.experts.7.down_proj." in name for name, _ in weights)
    model, _ = build_model(Qwen3MoeForCausalLM, config, weights)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [FusedMoE, GatedMLP, FusedMoE]
    assert layers[0].mlp.renormalize == norm_topk_prob
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


def test_qwen3_moe_from_a_float32_gguf_matches_transformers(tmp_path):
    hf_model = hf_qwen3_moe(seed=4, norm_topk_prob=True)  # llama.cpp renormalises every qwen3moe
    path = write_model_gguf(str(tmp_path / "model.gguf"), "qwen3moe", hf_model.config, hf_model.state_dict())
    config = gguf_to_hf_config(GGUFFile(path))
    weights = list(GGUFLoadFormat().iterate_weights(path, ModelConfig(), LoadConfig(use_tqdm_on_load=False)))
    assert any(name == "model.layers.2.mlp.experts.down_exps.weight" for name, _ in weights)
    model, _ = build_model(Qwen3MoeForCausalLM, config, weights)
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


def with_experts_through(hf_model, quant_type: GGMLQuantizationType):
    """``hf_model`` with every expert weight replaced by its value after a round trip through
    ``quant_type`` (what a GGUF of those blocks holds)."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if ".mlp.experts." in name:
                data = param.detach().numpy()
                param.copy_(torch.from_numpy(dequantize(quantize(data, quant_type), quant_type).reshape(data.shape)))
    return hf_model


def q4_0_model_and_file(tmp_path, seed: int):
    hf_model = with_experts_through(hf_qwen3_moe(seed=seed, norm_topk_prob=True), GGMLQuantizationType.Q4_0)
    path = write_model_gguf(
        str(tmp_path / "model.gguf"),
        "qwen3moe",
        hf_model.config,
        hf_model.state_dict(),
        expert_quant_type=GGMLQuantizationType.Q4_0,
    )
    return hf_model, path


def test_q4_0_experts_stay_4_bit_and_agree_with_transformers(tmp_path):
    """Where the platform chose float32 the gguf method keeps 4-bit blocks 4-bit: so do the experts
    (the moe_experts operator's int4 path, 8-bit activations); greedy ids compared the vLLM way with
    transformers holding the same dequantized experts, every logit within the 8-bit rounding."""
    hf_model, path = q4_0_model_and_file(tmp_path, seed=6)
    method = GGUFQuantizationMethod()
    method.exact_dtype = False
    weights = list(GGUFLoadFormat().iterate_weights(path, ModelConfig(), LoadConfig(use_tqdm_on_load=False)))
    model = Qwen3MoeForCausalLM(
        ModelContext(
            hf_config=gguf_to_hf_config(GGUFFile(path)),
            dtype=torch.float32,
            device=torch.device("cpu"),
            quantization=method,
        )
    )
    model.load_weights(weights)
    experts = model.model.layers[0].mlp.experts
    if cpu_native.load() is not None:
        assert experts.w13_packed is not None and experts.w13_packed.dtype == torch.uint8
        assert experts.w13_weight.is_meta
    ours = run_paged_greedy(model.eval(), PROMPTS, 8)
    theirs = [hf_greedy_top_k(hf_model, prompt, 8) for prompt in PROMPTS]
    top = [
        [set(step.topk(5).indices.tolist()) for step in logits[len(prompt) - 1 :]]
        for prompt, (_, logits) in zip(PROMPTS, ours)
    ]
    assert_greedy_agrees([(tokens, steps) for (tokens, _), steps in zip(ours, top)], theirs)


def test_qwen3_moe_served_from_a_q4_0_gguf_agrees_with_transformers(tmp_path):
    """Through the engine (scheduler, paged cache, sampler), the platform's dtype."""
    hf_model, path = q4_0_model_and_file(tmp_path, seed=5)
    assert_served_greedy_agrees(hf_model, path, PROMPTS, distinct=False, dtype="auto")


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    expected = {"Qwen3MoeForCausalLM": "tokenloom.builtin_plugins.models.modeling_qwen3_moe:Qwen3MoeForCausalLM"}
    assert {name: registered[name] for name in expected} == expected
