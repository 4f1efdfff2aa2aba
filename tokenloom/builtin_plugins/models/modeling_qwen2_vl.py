"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``): a vision transformer over an image's native-resolution
patches, merged 2x2 into the language model's tokens, and a Qwen2 language model whose rotary
embedding is M-RoPE (registered by :mod:`~tokenloom.builtin_plugins.models`, with the processor
:mod:`~tokenloom.builtin_plugins.models.qwen2_vl_processing`).

The vision tower is built from tokenloom's layers: linear layers on the CPU kernels and the
platform's attention backend, both ways, over each image's patches (Qwen2.5-VL: over windows
of them, except on its full-attention blocks), each patch rotated by its 2-D (row, column)
position. The language model reads the (t, h, w) positions the model runner gives an image's
tokens (:mod:`tokenloom.core.multimodal.mrope`) through :class:`~tokenloom.layers.mrope.MRotaryEmbedding`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.builtin_plugins.models.modeling_llama import LlamaDecoderLayer
from tokenloom.builtin_plugins.models.modeling_qwen2 import Qwen2ForCausalLM
from tokenloom.model_api import (
    Attention,
    ConfigError,
    GatedMLP,
    ModelContext,
    MultiModalItem,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    encoder_attention_metadata,
    get_mrope,
)

_VISION_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "silu": F.silu,
}


def _vision_activation(name: str):
    if name not in _VISION_ACTIVATIONS:
        raise ConfigError(
            f"vision hidden_act {name!r} is not supported; supported: {', '.join(sorted(_VISION_ACTIVATIONS))}"
        )
    return _VISION_ACTIVATIONS[name]


def patch_positions(grid_thw: tuple[int, int, int], merge_size: int) -> torch.Tensor:
    """``[t * h * w, 2]`` (row, column) of each patch in the order the image processor lays them
    out: ``merge_size x merge_size`` blocks, row by row, the frames one after another."""
    frames, height, width = grid_thw
    rows, columns = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    blocks = (height // merge_size, merge_size, width // merge_size, merge_size)
    rows = rows.reshape(blocks).transpose(1, 2).flatten()
    columns = columns.reshape(blocks).transpose(1, 2).flatten()
    return torch.stack([rows, columns], dim=-1).repeat(frames, 1)


def window_order(
    grid_thw: tuple[int, int, int], merge_size: int, window_patches: int
) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows over one image: the merged tokens' order that makes each window
    contiguous, and each window's length in patches (windows of ``window_patches`` merged
    tokens a side, the last row and column of windows cut short by the image's edge)."""
    frames, height, width = grid_thw
    merged_height, merged_width = height // merge_size, width // merge_size
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    tokens = torch.arange(frames * merged_height * merged_width).view(frames, merged_height, merged_width)
    for frame in range(frames):
        for top in range(0, merged_height, window_patches):
            for left in range(0, merged_width, window_patches):
                window = tokens[frame, top : top + window_patches, left : left + window_patches].flatten()
                order.append(window)
                lengths.append(window.numel() * merge_size**2)
    return torch.cat(order), lengths


class VisionAttention(nn.Module):
    """Multi-head attention both ways over each sequence of patches the metadata gives, queries
    and keys rotated by the patches' 2-D positions."""

    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.head_size = num_heads, dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True, params_dtype=dtype)
        self.proj = ReplicatedLinear(dim, dim, bias=True, params_dtype=dtype)
        self.attn = Attention(num_heads, self.head_size, self.head_size**-0.5)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata) -> torch.Tensor:
        num_patches = hidden_states.shape[0]
        query, key, value = self.qkv(hidden_states).view(num_patches, 3, self.num_heads, self.head_size).unbind(1)

        def rotated(x: torch.Tensor) -> torch.Tensor:
            x32 = x.float()
            swapped = torch.cat([-x32[..., self.head_size // 2 :], x32[..., : self.head_size // 2]], dim=-1)
            return (x32 * cos + swapped * sin).to(x.dtype).reshape(num_patches, -1)

        output = self.attn(rotated(query), rotated(key), value.reshape(num_patches, -1).contiguous(), attn_metadata)
        return self.proj(output)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, hidden_act: str, dtype: torch.dtype):
        super().__init__()
        self.fc1 = ReplicatedLinear(dim, hidden_dim, bias=True, params_dtype=dtype)
        self.act = _vision_activation(hidden_act)
        self.fc2 = ReplicatedLinear(hidden_dim, dim, bias=True, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``. Qwen2-VL: LayerNorms and a
    two-layer MLP; Qwen2.5-VL: RMSNorms and a gated MLP with biases."""

    def __init__(self, config: Any, qwen2_5: bool, dtype: torch.dtype):
        super().__init__()
        if qwen2_5:
            dim = config.hidden_size
            self.norm1: nn.Module = RMSNorm(dim, 1e-6, params_dtype=dtype)
            self.norm2: nn.Module = RMSNorm(dim, 1e-6, params_dtype=dtype)
            self.mlp: nn.Module = GatedMLP(
                dim, config.intermediate_size, config.hidden_act, bias=True, params_dtype=dtype
            )
        else:
            dim = config.embed_dim
            self.norm1 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
            self.norm2 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
            self.mlp = VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act, dtype)
        self.attn = VisionAttention(dim, config.num_heads, dtype)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_metadata) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cos, sin, attn_metadata)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class PatchEmbed(nn.Module):
    """A ``temporal x patch x patch`` convolution with the patch's stride: one matrix product over
    the image processor's flattened patches (``proj`` keeps the checkpoint's Conv3d weight)."""

    def __init__(self, config: Any, dim: int, dtype: torch.dtype):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, dim, kernel_size=kernel, stride=kernel, bias=False, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1))


class PatchMerger(nn.Module):
    """Each ``merge x merge`` block of patches (adjacent in the processor's order), normalised
    and concatenated, through a two-layer GELU MLP into one language-model token."""

    def __init__(self, out_dim: int, dim: int, merge_size: int, qwen2_5: bool, dtype: torch.dtype):
        super().__init__()
        self.merged_dim = dim * merge_size**2
        self.ln_q = RMSNorm(dim, 1e-6, params_dtype=dtype) if qwen2_5 else nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
        self.mlp = nn.Sequential(
            ReplicatedLinear(self.merged_dim, self.merged_dim, bias=True, params_dtype=dtype),
            nn.GELU(),
            ReplicatedLinear(self.merged_dim, out_dim, bias=True, params_dtype=dtype),
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(hidden_states).reshape(-1, self.merged_dim))


class VisionTransformer(nn.Module):
    """``visual``: patches of one image (``[t * h * w, C * T * P * P]``, its grid ``(t, h, w)``
    in patches) to its language-model tokens ``[t * h * w / merge**2, out_dim]``."""

    def __init__(self, config: Any, qwen2_5: bool, dtype: torch.dtype):
        super().__init__()
        dim = config.hidden_size if qwen2_5 else config.embed_dim
        out_dim = config.out_hidden_size if qwen2_5 else config.hidden_size
        self.merge_size = config.spatial_merge_size
        self.head_size = dim // config.num_heads
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        theta = float(rope_parameters.get("rope_theta") or 10000.0)
        quarter = self.head_size // 2
        # one frequency table for rows and one for columns, each over half the head's frequencies
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.patch_embed = PatchEmbed(config, dim, dtype)
        self.blocks = nn.ModuleList(VisionBlock(config, qwen2_5, dtype) for _ in range(config.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge_size, qwen2_5, dtype)
        # Qwen2.5-VL: windowed attention except on these blocks
        self.full_attention_blocks = set(config.fullatt_block_indexes) if qwen2_5 else None
        self.window_patches = config.window_size // self.merge_size // config.patch_size if qwen2_5 else 0

    def rotary_tables(self, grid_thw: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[patches, 1, head_size]`` of each patch's angles: its row's over the first
        quarter of the frequencies, its column's over the second, both halves of the head alike."""
        angles = patch_positions(grid_thw, self.merge_size).float().unsqueeze(-1) * self.inv_freq  # [N, 2, F]
        angles = angles.flatten(1)
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int], attention_backend: Any
    ) -> torch.Tensor:
        hidden_states = self.patch_embed(pixel_values)
        num_patches = hidden_states.shape[0]
        cos, sin = self.rotary_tables(grid_thw)
        full = encoder_attention_metadata([grid_thw[1] * grid_thw[2]] * grid_thw[0], attention_backend)
        windowed = full
        unit = self.merge_size**2
        if self.full_attention_blocks is not None:
            order, window_lengths = window_order(grid_thw, self.merge_size, self.window_patches)

            def by_window(x: torch.Tensor) -> torch.Tensor:
                return x.reshape(num_patches // unit, unit, *x.shape[1:])[order].reshape(x.shape)

            hidden_states, cos, sin = by_window(hidden_states), by_window(cos), by_window(sin)
            # a frame's patches stay together: its full attention does not mind their order
            windowed = encoder_attention_metadata(window_lengths, attention_backend)
        for index, block in enumerate(self.blocks):
            use_full = self.full_attention_blocks is None or index in self.full_attention_blocks
            hidden_states = block(hidden_states, cos, sin, full if use_full else windowed)
        merged = self.merger(hidden_states)
        if self.full_attention_blocks is not None:
            merged = merged[torch.argsort(order)]
        return merged


class Qwen2VLDecoderLayer(LlamaDecoderLayer):
    """Qwen2's layer; a step with M-RoPE positions (``[3, T]``) takes the Python path."""

    def forward(self, positions, hidden_states, residual, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, hidden_states, residual, attn_metadata)
        fused_decode, self.fused_decode = self.fused_decode, None
        try:
            return super().forward(positions, hidden_states, residual, attn_metadata)
        finally:
            self.fused_decode = fused_decode


# checkpoint prefixes of the layouts transformers has saved Qwen2-VL in -> this model's names
_CHECKPOINT_PREFIXES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
)


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """The Qwen2 language model (``text_config``) with M-RoPE, and the vision tower beside it."""

    qwen2_5 = False

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        if not self.is_first_stage or not self.is_last_stage:
            # the model runner merges image embeddings on the stage that samples only
            raise ConfigError(
                f"{type(self).__name__} does not run with pipeline parallelism yet: use --pipeline-parallel-size 1",
                param="pipeline_parallel_size",
            )
        self.visual = VisionTransformer(ctx.hf_config.vision_config, self.qwen2_5, self.dtype)

    @staticmethod
    def text_config(hf_config: Any) -> Any:
        text_config = getattr(hf_config, "text_config", None) or hf_config
        if getattr(text_config, "tie_word_embeddings", None) is None:
            # transformers keeps the tie on the outer config (Qwen2-VL-2B ties its embeddings)
            text_config = copy.copy(text_config)
            text_config.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        return text_config

    def rope(self, layer_type: str | None = None) -> RotaryEmbedding:
        """The M-RoPE every layer shares."""
        if "mrope" not in self._ropes:
            max_model_len = getattr(self.ctx.model_config, "max_model_len", None) or 0
            self._ropes["mrope"] = get_mrope(
                self.head_size,
                self.rope_parameters(layer_type),
                max(self.config.max_position_embeddings, max_model_len),
                dtype=self.dtype,
            )
        return self._ropes["mrope"]

    def make_layer(self, layer_index: int) -> nn.Module:
        return Qwen2VLDecoderLayer(self, layer_index, qkv_bias=True, output_bias=False)

    def checkpoint_name(self, name: str) -> str:
        for prefix, replacement in _CHECKPOINT_PREFIXES:
            if name.startswith(prefix):
                return replacement + name[len(prefix) :]
        return name

    def embed_multimodal(self, item: MultiModalItem, attention_backend: Any) -> torch.Tensor:
        """One image's embeddings, ``[item.length, hidden_size]``."""
        frames, height, width = (int(size) for size in item.data["image_grid_thw"])
        return self.visual(item.data["pixel_values"], (frames, height, width), attention_backend)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL with Qwen2.5-VL's vision tower: RMSNorm and gated-MLP blocks, window attention."""

    qwen2_5 = True
