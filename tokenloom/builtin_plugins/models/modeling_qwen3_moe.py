"""Qwen3-MoE: the Qwen3 layer (per-head q/k RMSNorm) with a mixture of experts in place of the
dense MLP on every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``: softmax
routing to ``num_experts_per_tok`` of ``num_experts`` experts of ``moe_intermediate_size``,
renormalised when ``norm_topk_prob`` (:class:`~tokenloom.layers.fused_moe.FusedMoE`). From a
Hugging Face checkpoint (``mlp.experts.{e}.gate_proj`` ...) or llama.cpp's ``qwen3moe`` GGUF
(``ffn_*_exps`` stacking the experts)."""

from __future__ import annotations

from torch import nn

from tokenloom.builtin_plugins.models.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenloom.model_api import DECODER_STACKED_PARAMS, FusedMoE, GatedMLP, RMSNorm, expert_stacked_params


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.stacked_params = expert_stacked_params("mlp", self.config.num_experts) + DECODER_STACKED_PARAMS

    def is_sparse_layer(self, layer_index: int) -> bool:
        config = self.config
        return (
            layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_index + 1) % getattr(config, "decoder_sparse_step", 1) == 0
        )

    def make_layer(self, layer_index: int) -> nn.Module:
        config = self.config
        mlp: nn.Module
        if self.is_sparse_layer(layer_index):
            mlp = FusedMoE(
                config.num_experts,
                config.num_experts_per_tok,
                config.hidden_size,
                config.moe_intermediate_size,
                config.hidden_act,
                renormalize=bool(config.norm_topk_prob),
                **self.linear_options(),
            )
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, **self.linear_options())
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaDecoderLayer(
            self, layer_index, qkv_bias=attention_bias, output_bias=attention_bias, qk_norm=RMSNorm, mlp=mlp
        )
