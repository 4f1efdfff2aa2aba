"""The paged ``Attention`` module a model layer calls: it reshapes flat projections into
heads and hands them, with this layer's KV cache, to the step's attention backend
(``attn_metadata.backend``: the platform's choice, or the one ``--attention-backend`` /
``VLLM_ATTENTION_BACKEND`` names, resolved by the model runner through
:func:`tokenloom.core.platform.attention_backend_target`)."""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.errors import ConfigError


class Attention(nn.Module):
    """Attention of one layer over the paged KV cache ``attn_metadata.kv_caches[layer_index]``.

    :param scale: the softmax scale (usually ``head_size ** -0.5``).
    :param sliding_window: attend only to the last ``sliding_window`` positions, or None.
    :param logits_soft_cap: ``cap * tanh(scores / cap)`` before the softmax, or None.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        layer_index: int = 0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(f"{num_heads} attention heads cannot be grouped over {num_kv_heads} KV heads")
        if sliding_window is not None and sliding_window < 1:
            raise ConfigError(f"sliding window must be a positive number of tokens, not {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata) -> torch.Tensor:
        """``query [T, Hq * D]``, ``key/value [T, Hkv * D]`` (or split into heads) -> ``[T, Hq * D]``."""
        if attn_metadata.backend is None:
            raise ConfigError(
                "AttentionMetadata.backend is not set: the model runner must attach the platform's backend"
            )
        num_tokens = query.shape[0]
        output = attn_metadata.backend.forward(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            attn_metadata.kv_caches[self.layer_index] if attn_metadata.kv_caches else None,
            attn_metadata,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
        return output.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"layer={self.layer_index}, window={self.sliding_window}, soft_cap={self.logits_soft_cap}"
        )
