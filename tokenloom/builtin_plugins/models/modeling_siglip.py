"""The SigLIP vision tower the models that see share (Idefics3/SmolVLM, Gemma 3): patches by a
strided convolution and learned absolute positions, then CLIP's pre-norm encoder layers
(tokenloom's linear layers and the platform's attention backend, both ways over each frame's
patches) and a final LayerNorm. Checkpoint names are transformers' ``SiglipVisionTransformer``
ones (``embeddings.*``, ``encoder.layers.*``, ``post_layernorm.*``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.builtin_plugins.models.modeling_llava import CLIPEncoderLayer
from tokenloom.model_api import encoder_attention_metadata


class SiglipVisionEmbeddings(nn.Module):
    """Patches by a strided convolution (with a bias) and learned absolute positions, no class token."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            dtype=dtype,
        )
        self.position_embedding = nn.Embedding(
            (config.image_size // config.patch_size) ** 2, config.hidden_size, dtype=dtype
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[frames, channels, image_size, image_size]`` -> ``[frames, patches, hidden]``
        (a whole frame's patches take the positions in order)."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        # SigLIP's encoder layer is CLIP's: pre-norm, bidirectional attention, a two-layer MLP
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, dtype) for _ in range(config.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    """Every layer of the SigLIP tower and its ``post_layernorm`` (no pooling head: the models
    that see read the last hidden states)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.image_size = config.image_size
        self.embeddings = SiglipVisionEmbeddings(config, dtype)
        self.encoder = SiglipEncoder(config, dtype)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor, attention_backend: Any) -> torch.Tensor:
        """``[frames, 3, image_size, image_size]`` -> ``[frames, patches, hidden]``."""
        embeddings = self.embeddings(pixel_values)
        num_frames, num_patches, hidden_size = embeddings.shape
        attn_metadata = encoder_attention_metadata([num_patches] * num_frames, attention_backend)
        hidden_states = embeddings.reshape(num_frames * num_patches, hidden_size)
        for layer in self.encoder.layers:
            hidden_states = layer(hidden_states, attn_metadata)
        return self.post_layernorm(hidden_states).view(num_frames, num_patches, hidden_size)
