"""OLMoE: pre-norm decoder layers whose attention normalises the whole query and the whole key
projection (OLMo 2's :class:`~tokenloom.builtin_plugins.models.modeling_olmo2.Olmo2Attention`),
the normalised queries and keys and the values clipped to ``clip_qkv`` when set (as transformers
clips them), and a mixture of experts on every layer:
softmax routing to ``num_experts_per_tok`` of ``num_experts`` experts of ``intermediate_size``,
renormalised when ``norm_topk_prob``, no shared expert
(:class:`~tokenloom.layers.fused_moe.FusedMoE`). From a Hugging Face checkpoint
(``mlp.experts.{e}.gate_proj`` ...) or llama.cpp's ``olmoe`` GGUF (``ffn_*_exps``)."""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.builtin_plugins.models.modeling_olmo2 import Olmo2Attention
from tokenloom.model_api import DECODER_STACKED_PARAMS, DecoderForCausalLM, FusedMoE, expert_stacked_params


class OlmoeAttention(Olmo2Attention):
    def __init__(self, model: DecoderForCausalLM, layer_index: int):
        super().__init__(model, layer_index)
        self.clip_qkv = getattr(model.config, "clip_qkv", None)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        num_tokens = qkv.shape[0]
        query = self.q_norm(qkv[:, :q_size])
        key = self.k_norm(qkv[:, q_size : q_size + kv_size])
        value = qkv[:, q_size + kv_size :]
        if self.clip_qkv is not None:
            query, key, value = (part.clamp(-self.clip_qkv, self.clip_qkv) for part in (query, key, value))
        query, key = self.rotary_emb(
            positions,
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
        )
        return self.o_proj(self.attn(query, key, value, attn_metadata))


class OlmoeDecoderLayer(nn.Module):
    def __init__(self, model: DecoderForCausalLM, layer_index: int):
        super().__init__()
        config, dtype = model.config, model.dtype
        self.input_layernorm = model.norm_class(config.hidden_size, config.rms_norm_eps, params_dtype=dtype)
        self.self_attn = OlmoeAttention(model, layer_index)
        self.post_attention_layernorm = model.norm_class(config.hidden_size, config.rms_norm_eps, params_dtype=dtype)
        self.mlp = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            renormalize=bool(config.norm_topk_prob),
            **model.linear_options(),
        )

    def forward(self, positions, hidden_states, residual, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class OlmoeForCausalLM(DecoderForCausalLM):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.stacked_params = expert_stacked_params("mlp", self.config.num_experts) + DECODER_STACKED_PARAMS

    def make_layer(self, layer_index: int) -> nn.Module:
        return OlmoeDecoderLayer(self, layer_index)
