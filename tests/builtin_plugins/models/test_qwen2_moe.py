"""Qwen2MoeForCausalLM against transformers on tiny random models: from safetensors (routed
experts stacked at load, the sigmoid-gated shared expert, dense layers by ``mlp_only_layers`` and
``decoder_sparse_step``) and from GGUF (llama.cpp's ``qwen2moe``: ``ffn_*_exps``, ``ffn_*_shexp``,
``ffn_gate_inp_shexp``; float32, Q8_0, and Q4_K_M written by llama.cpp's ``llama-quantize``);
every position's logits through the paged cache, and greedy ids through the engine."""

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
from helpers.moe_checkpoints import llama_quantize, quantize_with_llama_cpp, through_quant_type, with_gguf_values
from transformers import Qwen2MoeConfig
from transformers import Qwen2MoeForCausalLM as HFQwen2MoeForCausalLM

from tokenloom.builtin_plugins.loaders.gguf_config import gguf_to_hf_config
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.builtin_plugins.models import register_models
from tokenloom.builtin_plugins.models.modeling_qwen2_moe import Qwen2MoeForCausalLM
from tokenloom.kernels import cpu_native
from tokenloom.layers.decoder import GatedMLP
from tokenloom.layers.fused_moe import FusedMoE

PROMPTS = [[9, 14, 130, 3, 57, 71], [100, 6, 28], [45, 2, 19, 88, 110, 7, 36, 52, 9, 140]]
TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def hf_qwen2_moe(seed: int = 0, **overrides) -> HFQwen2MoeForCausalLM:
    torch.manual_seed(seed)
    return randomize_parameters(HFQwen2MoeForCausalLM(Qwen2MoeConfig(**{**TINY, **overrides})).eval(), seed)


@pytest.mark.parametrize(
    "overrides, kinds",
    [
        (dict(norm_topk_prob=False, mlp_only_layers=[1]), [FusedMoE, GatedMLP, FusedMoE]),
        (dict(norm_topk_prob=True, decoder_sparse_step=2), [GatedMLP, FusedMoE, GatedMLP]),
    ],
    ids=["raw-mlp-only-layer", "renormalised-sparse-step-2"],
)
def test_qwen2_moe_from_safetensors_matches_transformers(overrides, kinds, tmp_path):
    hf_model = hf_qwen2_moe(seed=3, **overrides)
    config, weights = load_checkpoint("safetensors", hf_model, tmp_path)
    assert any(".mlp.shared_expert_gate." in name for name, _ in weights)
    model, _ = build_model(Qwen2MoeForCausalLM, config, weights)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == kinds
    moe = next(layer.mlp for layer in layers if isinstance(layer.mlp, FusedMoE))
    assert isinstance(moe.shared_expert, GatedMLP) and moe.shared_expert_gate is not None
    assert moe.renormalize == overrides["norm_topk_prob"]
    assert_matches_transformers(model, hf_model, PROMPTS, num_new_tokens=8)


def write_qwen2moe_gguf(hf_model, path, quant_type=None) -> str:
    return write_model_gguf(
        str(path),
        "qwen2moe",
        hf_model.config,
        hf_model.state_dict(),
        quant_type=quant_type,
        expert_quant_type=quant_type,
    )


@pytest.mark.parametrize("quant_type", [None, GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_qwen2_moe_from_gguf_matches_transformers(quant_type, tmp_path):
    """llama.cpp never renormalises a qwen2moe file's routing weights: neither does the config."""
    hf_model = hf_qwen2_moe(seed=4, norm_topk_prob=False)
    if quant_type is not None:
        hf_model = through_quant_type(hf_model, quant_type)
    path = write_qwen2moe_gguf(hf_model, tmp_path / "model.gguf", quant_type)
    config = gguf_to_hf_config(GGUFFile(path))
    sizes = (config.moe_intermediate_size, config.shared_expert_intermediate_size, config.norm_topk_prob)
    assert (config.architectures, sizes) == (["Qwen2MoeForCausalLM"], (32, 48, False))
    assert_served_greedy_agrees(hf_model, path, PROMPTS, distinct=False)


@pytest.mark.skipif(llama_quantize() is None, reason="llama.cpp's llama-quantize is not built here (Q4_K_M files)")
def test_qwen2_moe_served_from_a_llama_quantize_q4_k_m_file_agrees_with_transformers(tmp_path):
    """Shapes whose rows fit Q4_K's 256-wide blocks, quantized by llama.cpp itself; transformers
    holds the file's dequantized values. Served in the platform's dtype, 4-bit experts on the
    int4 operator where it runs."""
    shapes = dict(
        hidden_size=256, intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256
    )
    hf_model = hf_qwen2_moe(seed=5, vocab_size=256, num_experts=4, num_hidden_layers=2, head_dim=64, **shapes)
    source = write_qwen2moe_gguf(hf_model, tmp_path / "model-f32.gguf")
    path = quantize_with_llama_cpp(source, str(tmp_path / "model-q4_k_m.gguf"), "Q4_K_M")
    types = {info.name: info.ggml_type for info in GGUFFile(path).tensors.values()}
    assert types["blk.0.ffn_up_exps.weight"] == GGMLQuantizationType.Q4_K
    hf_model = with_gguf_values(hf_model, "qwen2moe", path)
    llm = assert_served_greedy_agrees(hf_model, path, PROMPTS, distinct=False, dtype="auto")
    if cpu_native.load() is not None:  # every expert in its file's codes, each projection in its own kind
        layers = llm.engine.executor.worker.runner.model.model.layers
        kinds = [(layer.mlp.experts.w13_kind, layer.mlp.experts.w2_kind) for layer in layers]
        down_bits = [
            6 if types[f"blk.{index}.ffn_down_exps.weight"] == GGMLQuantizationType.Q6_K else 4 for index in (0, 1)
        ]
        assert kinds == [((4, 8), (bits, 8)) for bits in down_bits] and 6 in down_bits
        assert all(layer.mlp.experts.w13_weight.is_meta and layer.mlp.experts.w2_weight.is_meta for layer in layers)


def test_registration():
    registered = {}
    register_models(lambda name, target, **options: registered.setdefault(name, target))
    assert (
        registered["Qwen2MoeForCausalLM"] == "tokenloom.builtin_plugins.models.modeling_qwen2_moe:Qwen2MoeForCausalLM"
    )
