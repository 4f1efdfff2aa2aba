"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 layer (biased query/key/value projections)
with a mixture of experts in place of the dense MLP on every ``decoder_sparse_step``-th layer not
listed in ``mlp_only_layers``: softmax routing to ``num_experts_per_tok`` of ``num_experts``
experts of ``moe_intermediate_size``, renormalised when ``norm_topk_prob``, plus a shared expert
of ``shared_expert_intermediate_size`` every token passes through, scaled by
``sigmoid(shared_expert_gate(x))`` (:class:`~tokenloom.layers.fused_moe.FusedMoE`). From a
Hugging Face checkpoint or llama.cpp's ``qwen2moe`` GGUF (``ffn_*_exps``, ``ffn_*_shexp``,
``ffn_gate_inp_shexp``)."""

from __future__ import annotations

from torch import nn

from tokenloom.builtin_plugins.models.modeling_llama import LlamaDecoderLayer
from tokenloom.builtin_plugins.models.modeling_qwen3_moe import Qwen3MoeForCausalLM
from tokenloom.model_api import FusedMoE, GatedMLP


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
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
                shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                shared_expert_gate=True,
                **self.linear_options(),
            )
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, **self.linear_options())
        return LlamaDecoderLayer(self, layer_index, qkv_bias=True, output_bias=False, mlp=mlp)
