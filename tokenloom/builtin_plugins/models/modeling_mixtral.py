"""Mixtral: the Mistral layer with a mixture of experts in place of the dense MLP: softmax over
``num_local_experts`` experts, the ``num_experts_per_tok`` best renormalised
(:class:`~tokenloom.layers.fused_moe.FusedMoE`). From a Hugging Face checkpoint
(``block_sparse_moe.experts.{e}.w1/w3/w2``, gate/up/down) or llama.cpp's GGUF (architecture
``llama`` with ``ffn_*_exps`` tensors stacking the experts)."""

from __future__ import annotations

from torch import nn

from tokenloom.builtin_plugins.models.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenloom.model_api import DECODER_STACKED_PARAMS, FusedMoE, expert_stacked_params

# the Hugging Face names of each expert's projections
EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, ctx):
        super().__init__(ctx)
        experts = self.config.num_local_experts
        self.stacked_params = expert_stacked_params("mlp", experts, EXPERT_NAMES) + DECODER_STACKED_PARAMS

    def checkpoint_name(self, name: str) -> str | None:
        # the layer's experts sit under ``mlp`` as in every other model
        return name.replace(".block_sparse_moe.", ".mlp.", 1)

    def make_layer(self, layer_index: int) -> nn.Module:
        config = self.config
        mlp = FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            renormalize=True,
            **self.linear_options(),
        )
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaDecoderLayer(self, layer_index, qkv_bias=attention_bias, output_bias=attention_bias, mlp=mlp)
