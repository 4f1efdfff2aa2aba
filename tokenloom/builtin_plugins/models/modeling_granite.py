"""IBM Granite (3.x dense): the Llama network with four multipliers from its config:
``embedding_multiplier`` on the token embeddings, ``residual_multiplier`` on each attention and
MLP output before its residual add, ``attention_multiplier`` as the softmax scale, and the
logits divided by ``logits_scaling``. Registered by :mod:`~tokenloom.builtin_plugins.models.granite`."""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.builtin_plugins.models.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, model: LlamaForCausalLM, layer_index: int):
        config = model.config
        attention_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(
            model,
            layer_index,
            qkv_bias=attention_bias,
            output_bias=attention_bias,
            attention_scale=float(config.attention_multiplier),
        )
        self.residual_multiplier = float(config.residual_multiplier)
        # the fused CPU decode operator adds each output to the residual unscaled
        self.fused_decode = None

    def forward(self, positions, hidden_states, residual, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata) * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer_index: int) -> nn.Module:
        return GraniteDecoderLayer(self, layer_index)

    def embedding_multiplier(self) -> torch.Tensor:
        # float32 whatever the model dtype, like transformers' Python float: a 0-dim tensor
        # does not promote the embeddings it multiplies
        return torch.tensor(float(self.config.embedding_multiplier), dtype=torch.float32)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.config.logits_scaling
