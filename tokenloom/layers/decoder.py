"""The two blocks every decoder-only transformer layer is built from: :class:`SelfAttention`
(fused QKV projection, optional per-head q/k norm, rotary embedding, paged attention, output
projection) and :class:`GatedMLP` (fused gate/up projection, gated activation, down
projection). Sub-module names follow Hugging Face checkpoints with the fused projections
renamed ``qkv_proj`` and ``gate_up_proj``.

Under tensor parallelism (``tp_group``) each rank holds its query heads and the KV heads they
read (replicated when there are more ranks than KV heads) and its slice of the MLP's
intermediate features; ``o_proj`` and ``down_proj`` each end in one all-reduce."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.layers.activation import get_act_and_mul
from tokenloom.layers.attention import Attention
from tokenloom.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenloom.layers.quantization import QuantizationMethod
from tokenloom.layers.rotary import RotaryEmbedding


class SelfAttention(nn.Module):
    """Causal self-attention of one decoder layer over its paged KV cache.

    :param rotary_emb: shared by every layer with the same RoPE settings.
    :param scale: softmax scale; ``head_size ** -0.5`` when None.
    :param qk_norm: a norm class applied per head to queries and keys before RoPE, or None.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        *,
        layer_index: int,
        rotary_emb: RotaryEmbedding,
        scale: float | None = None,
        qkv_bias: bool = False,
        output_bias: bool = False,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        qk_norm: type[nn.Module] | None = None,
        norm_eps: float = 1e-6,
        quant_method: QuantizationMethod | None = None,
        params_dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ):
        super().__init__()
        linear_options = dict(
            quant_method=quant_method, params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group
        )
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_size, num_heads, num_kv_heads, bias=qkv_bias, **linear_options
        )
        self.o_proj = RowParallelLinear(num_heads * head_size, hidden_size, bias=output_bias, **linear_options)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_size = head_size
        self.rotary_emb = rotary_emb
        if qk_norm is not None:
            self.q_norm = qk_norm(head_size, norm_eps, params_dtype=params_dtype)
            self.k_norm = qk_norm(head_size, norm_eps, params_dtype=params_dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            self.num_heads,
            head_size,
            head_size**-0.5 if scale is None else scale,
            self.num_kv_heads,
            layer_index,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        value = qkv[:, q_size + kv_size :]
        if self.q_norm is None:
            # queries and keys sit side by side in qkv: one rotation covers both
            rotated = self.rotary_emb.rotate(positions, qkv[:, : q_size + kv_size])
            query, key = rotated[:, : self.num_heads], rotated[:, self.num_heads :]
        else:
            num_tokens = qkv.shape[0]
            query = self.q_norm(qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_size))
            key = self.k_norm(qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_size))
            query, key = self.rotary_emb(positions, query, key)
        return self.o_proj(self.attn(query, key, value, attn_metadata))


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with gate and up fused in one matmul."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        *,
        bias: bool = False,
        quant_method: QuantizationMethod | None = None,
        params_dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ):
        super().__init__()
        linear_options = dict(
            quant_method=quant_method, params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group
        )
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, **linear_options
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, **linear_options)
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
