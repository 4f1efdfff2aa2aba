"""OLMo 2: no norm before attention or the MLP; an RMSNorm after each (``post_attention_layernorm``,
``post_feedforward_layernorm``) before its residual add, and an RMSNorm over the whole query and
the whole key projection (not per head) before RoPE. Registered by
:mod:`~tokenloom.builtin_plugins.models.olmo2`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.model_api import DecoderForCausalLM, GatedMLP, ModelLoadError, SelfAttention, materialize


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over all of a projection's features, of which this rank holds
    ``rows = (first, count)``: under tensor parallelism the sum of squares is summed over the
    group. A KV head replicated on ``r`` ranks counts ``r`` times in that sum, and the features of
    the whole group number ``r`` times the projection's too, so the mean is exact either way."""

    def __init__(
        self,
        total_features: int,
        rows: tuple[int, int],
        eps: float,
        *,
        params_dtype: torch.dtype | None = None,
        tp_group: Any = None,
    ):
        super().__init__()
        self.total_features = total_features
        self.first_row, self.num_features = rows
        self.eps = eps
        self.tp_group = tp_group
        self.weight = nn.Parameter(
            torch.ones(self.num_features, dtype=params_dtype or torch.get_default_dtype()), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        if self.tp_group is None:
            variance = hidden.pow(2).mean(-1, keepdim=True)
        else:
            squares = self.tp_group.all_reduce(hidden.pow(2).sum(-1, keepdim=True))
            variance = squares / (self.num_features * self.tp_group.size)
        # transformers' Olmo2RMSNorm multiplies by the weight in float32, then rounds
        return (self.weight.float() * (hidden * torch.rsqrt(variance + self.eps))).to(x.dtype)

    def load_checkpoint_weight(self, param_name: str, loaded_weight: Any, shard_id: Any = None) -> None:
        tensor = materialize(loaded_weight, self.weight.dtype)
        if param_name != "weight" or tensor.shape != (self.total_features,):
            raise ModelLoadError(
                f"{type(self).__name__} expects 'weight' of shape ({self.total_features},), "
                f"got {param_name!r} of shape {tuple(tensor.shape)}"
            )
        self.weight.data.copy_(tensor[self.first_row : self.first_row + self.num_features])

    def extra_repr(self) -> str:
        return f"{self.num_features} of {self.total_features}, eps={self.eps}"


class Olmo2Attention(SelfAttention):
    """Self-attention whose queries and keys are normalised over the whole projection."""

    def __init__(self, model: DecoderForCausalLM, layer_index: int):
        config = model.config
        total_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(
            config.hidden_size,
            config.num_attention_heads,
            total_kv_heads,
            model.head_size,
            layer_index=layer_index,
            rotary_emb=model.rope(),
            qkv_bias=attention_bias,
            output_bias=attention_bias,
            sliding_window=model.sliding_windows[layer_index],
            **model.linear_options(),
        )
        options = dict(params_dtype=model.dtype, tp_group=model.tp_group)
        _, q_rows, first_q_row = self.qkv_proj.shard_rows("q")
        _, kv_rows, first_kv_row = self.qkv_proj.shard_rows("k")
        head_size, eps = model.head_size, config.rms_norm_eps
        self.q_norm = ProjectionRMSNorm(config.num_attention_heads * head_size, (first_q_row, q_rows), eps, **options)
        self.k_norm = ProjectionRMSNorm(total_kv_heads * head_size, (first_kv_row, kv_rows), eps, **options)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        num_tokens = qkv.shape[0]
        query = self.q_norm(qkv[:, :q_size]).view(num_tokens, self.num_heads, self.head_size)
        key = self.k_norm(qkv[:, q_size : q_size + kv_size]).view(num_tokens, self.num_kv_heads, self.head_size)
        query, key = self.rotary_emb(positions, query, key)
        return self.o_proj(self.attn(query, key, qkv[:, q_size + kv_size :], attn_metadata))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, model: DecoderForCausalLM, layer_index: int):
        super().__init__()
        config, dtype = model.config, model.dtype
        self.self_attn = Olmo2Attention(model, layer_index)
        self.post_attention_layernorm = model.norm_class(config.hidden_size, config.rms_norm_eps, params_dtype=dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, **model.linear_options())
        self.post_feedforward_layernorm = model.norm_class(config.hidden_size, config.rms_norm_eps, params_dtype=dtype)

    def forward(self, positions, hidden_states, residual, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        # the stack hands over (last output, residual): their sum is this layer's input
        if residual is not None:
            hidden_states = hidden_states + residual
        attention = self.post_attention_layernorm(self.self_attn(positions, hidden_states, attn_metadata))
        residual = hidden_states + attention
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2ForCausalLM(DecoderForCausalLM):
    def make_layer(self, layer_index: int) -> nn.Module:
        return Olmo2DecoderLayer(self, layer_index)
