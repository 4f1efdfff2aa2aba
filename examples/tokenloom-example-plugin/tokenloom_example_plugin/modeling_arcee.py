"""``ArceeForCausalLM`` (Arcee's AFM models): Llama's network with a plain MLP in place of the
gated one, ``down_proj(relu(up_proj(x)) ** 2)``: no ``gate_proj``, ReLU squared.

A model plugin's model file: everything comes from ``tokenloom.model_api``.
``DecoderForCausalLM`` gives the embedding, the layer stack, the final norm, the LM head,
RoPE (scaling included), sliding windows, weight loading, tensor and pipeline parallelism and the
KV-cache spec; this file adds the decoder layer, built from the same blocks as tokenloom's own.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.model_api import (
    DECODER_STACKED_PARAMS,
    ColumnParallelLinear,
    DecoderForCausalLM,
    ModelLoadError,
    RowParallelLinear,
    SelfAttention,
)


class ReluSquaredMLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``. Under tensor parallelism each rank holds a slice of
    the intermediate features: ``up_proj`` splits its outputs, ``down_proj`` its inputs (and
    all-reduces), so the activation runs on this rank's slice alone."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, **linear_options):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, **linear_options)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, **linear_options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class ArceeDecoderLayer(nn.Module):
    """Pre-norm self-attention, then the ReLU-squared MLP. ``forward`` takes the previous layer's
    output and the residual not yet added to it, and returns the same pair: each norm adds the
    residual as it normalises (``norm(x, residual) -> (normed, x + residual)``)."""

    def __init__(self, model: DecoderForCausalLM, layer_index: int):
        super().__init__()
        config = model.config
        if config.hidden_act != "relu2":
            raise ModelLoadError(
                f"ArceeForCausalLM computes relu2 in its MLP; the config asks for {config.hidden_act!r}"
            )
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.input_layernorm = model.norm_class(config.hidden_size, config.rms_norm_eps, params_dtype=model.dtype)
        self.self_attn = SelfAttention(
            config.hidden_size,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            model.head_size,
            layer_index=layer_index,
            rotary_emb=model.rope(),
            qkv_bias=attention_bias,
            output_bias=attention_bias,
            sliding_window=model.sliding_windows[layer_index],
            **model.linear_options(),
        )
        self.post_attention_layernorm = model.norm_class(
            config.hidden_size, config.rms_norm_eps, params_dtype=model.dtype
        )
        self.mlp = ReluSquaredMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=bool(getattr(config, "mlp_bias", False)),
            **model.linear_options(),
        )

    def forward(self, positions, hidden_states, residual, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class ArceeForCausalLM(DecoderForCausalLM):
    # the checkpoint's q_proj, k_proj and v_proj load into the fused qkv_proj as usual; the MLP
    # has no gate, so its up_proj is a layer of its own, not a shard of a gate_up_proj
    stacked_params = tuple(entry for entry in DECODER_STACKED_PARAMS if entry[0] == "qkv_proj")

    def make_layer(self, layer_index: int) -> nn.Module:
        return ArceeDecoderLayer(self, layer_index)
