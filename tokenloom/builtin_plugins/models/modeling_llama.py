"""Llama (and Mistral, the same network with a sliding window): pre-norm decoder layers of
RMSNorm, rotary self-attention and a SwiGLU MLP (registered by
:mod:`~tokenloom.builtin_plugins.models.llama`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.model_api import DecoderForCausalLM, FusedDecodeLayer, GatedMLP, SelfAttention, mixture_of_experts_error


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and a dense SwiGLU MLP; ``qk_norm`` (a norm class) normalises each
    query and key head before RoPE (Qwen3); ``attention_scale`` replaces ``head_size ** -0.5``
    as the softmax scale (Granite); ``mlp`` replaces the dense MLP (a mixture of experts)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        layer_index: int,
        *,
        qkv_bias: bool,
        output_bias: bool,
        qk_norm: type[nn.Module] | None = None,
        attention_scale: float | None = None,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        config = model.config
        moe_error = mixture_of_experts_error(config, type(model).__name__) if mlp is None else None
        if moe_error is not None:
            raise moe_error  # a dense MLP would leave every expert weight unread
        norm_class, dtype = model.norm_class, model.dtype
        attention_options: dict[str, Any] = {"qk_norm": qk_norm, "norm_eps": config.rms_norm_eps} if qk_norm else {}
        self.input_layernorm = norm_class(config.hidden_size, config.rms_norm_eps, params_dtype=dtype)
        self.self_attn = SelfAttention(
            config.hidden_size,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            model.head_size,
            layer_index=layer_index,
            rotary_emb=model.rope(),
            scale=attention_scale,
            qkv_bias=qkv_bias,
            output_bias=output_bias,
            sliding_window=model.sliding_windows[layer_index],
            **attention_options,
            **model.linear_options(),
        )
        self.post_attention_layernorm = norm_class(config.hidden_size, config.rms_norm_eps, params_dtype=dtype)
        self.mlp = mlp or GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
            **model.linear_options(),
        )
        # the whole layer as one CPU operator for decode steps it can take (a dense MLP's only)
        self.fused_decode = (
            FusedDecodeLayer(self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)
            if mlp is None
            else None
        )

    def stacked_decode(self):
        """The layer's fused decode for a step that runs every layer in one call
        (``FusedDecodeStack``): only while ``forward`` is this class's (a subclass that changes
        it decides its steps itself)."""
        return self.fused_decode if type(self).forward is LlamaDecoderLayer.forward else None

    def forward(self, positions, hidden_states, residual, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_decode is not None:
            fused = self.fused_decode(positions, hidden_states, residual, attn_metadata)
            if fused is not None:
                return fused
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaForCausalLM(DecoderForCausalLM):
    def make_layer(self, layer_index: int) -> nn.Module:
        attention_bias = bool(getattr(self.config, "attention_bias", False))
        return LlamaDecoderLayer(self, layer_index, qkv_bias=attention_bias, output_bias=attention_bias)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with every layer attending over ``config.sliding_window`` (when set)."""
