"""Qwen3 (dense): the Llama layer with an RMSNorm over each query and key head before RoPE,
a head size of its own (``head_dim``), and no projection biases unless ``attention_bias``
says so (registered by :mod:`~tokenloom.builtin_plugins.models.qwen3`)."""

from __future__ import annotations

from torch import nn

from tokenloom.builtin_plugins.models.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenloom.model_api import RMSNorm


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer_index: int) -> nn.Module:
        attention_bias = bool(getattr(self.config, "attention_bias", False))
        return LlamaDecoderLayer(
            self, layer_index, qkv_bias=attention_bias, output_bias=attention_bias, qk_norm=RMSNorm
        )
