"""Qwen2: the Llama layer with biases on the query/key/value projections (none on the
output projection), and sliding-window attention on the layers ``layer_types`` marks when
``use_sliding_window`` is set (registered by :mod:`~tokenloom.builtin_plugins.models.qwen2`)."""

from __future__ import annotations

from torch import nn

from tokenloom.builtin_plugins.models.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(self, layer_index, qkv_bias=True, output_bias=False)
