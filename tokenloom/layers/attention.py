"""The paged ``Attention`` module a model layer calls: it reshapes flat projections into
heads and hands them, with this layer's KV cache (and an fp8 cache's scales), to the step's
attention backend (``attn_metadata.backend``: the platform's choice, or the one
``--attention-backend`` / ``VLLM_ATTENTION_BACKEND`` names, resolved by the model runner through
:func:`tokenloom.core.platform.attention_backend_target`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenloom.errors import ConfigError
from tokenloom.kernels.paged_attention import is_fp8_kv_cache

# --calculate-kv-scales: scale = max |x| / constant over the first step's keys (values), so the
# largest element lands well inside the fp8 range (vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT)
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def calculate_kv_scales(scales, key: torch.Tensor, value: torch.Tensor) -> None:
    """Set a layer's :class:`~tokenloom.core.batch.KVCacheScales` from this step's keys and
    values, once (vLLM's rule: the first step that writes the cache decides). An all-zero (or
    non-finite) maximum keeps 1.0: a scale must stay positive and finite to divide by."""
    for name, rows, constant in (("k_scale", key, K_SCALE_CONSTANT), ("v_scale", value, V_SCALE_CONSTANT)):
        scale = float(rows.abs().max().float()) / constant if rows.numel() else 0.0
        if scale > 0.0 and math.isfinite(scale):
            setattr(scales, name, scale)
    scales.pending = False


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
        kv_cache = attn_metadata.kv_caches[self.layer_index] if attn_metadata.kv_caches else None
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        # the scales go only to backends that read an fp8 cache (a 16-bit cache's call is unchanged)
        fp8_scales = {}
        if is_fp8_kv_cache(kv_cache) and not attn_metadata.bidirectional:
            scales = attn_metadata.kv_scales[self.layer_index] if attn_metadata.kv_scales else None
            if scales is not None:
                if scales.pending:
                    calculate_kv_scales(scales, key, value)
                fp8_scales = {"k_scale": scales.k_scale, "v_scale": scales.v_scale}
        output = attn_metadata.backend.forward(
            query.view(num_tokens, self.num_heads, self.head_size),
            key,
            value,
            kv_cache,
            attn_metadata,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            **fp8_scales,
        )
        return output.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"layer={self.layer_index}, window={self.sliding_window}, soft_cap={self.logits_soft_cap}"
        )
