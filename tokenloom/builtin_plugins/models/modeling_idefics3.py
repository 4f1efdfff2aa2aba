"""Idefics3 (``Idefics3ForConditionalGeneration``: SmolVLM-256M/500M/2.2B): a SigLIP vision
tower, a pixel-shuffle connector and a Llama language model (registered by
:mod:`~tokenloom.builtin_plugins.models`, with its processor
:mod:`~tokenloom.builtin_plugins.models.idefics3_processing`).

An image arrives as frames (the tiles of a split image and the global image, each a square of
the tower's ``image_size``). Each frame runs through the SigLIP tower
(:mod:`~tokenloom.builtin_plugins.models.modeling_siglip`), its patches are pixel-shuffled
``scale_factor`` by ``scale_factor`` into fewer, wider tokens and projected to the language
model's width. One item covers the image's whole span in the prompt, the frame markers
(``<fake_token_around_image>``, ``<row_r_col_c>``, ``<global-img>``, the line breaks between
rows) included: the item's rows at ``<image>`` tokens are the frames' features, the others the
markers' own token embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.builtin_plugins.models.modeling_llama import LlamaForCausalLM
from tokenloom.builtin_plugins.models.modeling_siglip import SiglipVisionTransformer
from tokenloom.model_api import ConfigError, ModelContext, MultiModalItem, ReplicatedLinear, item_features


def image_seq_len(config: Any) -> int:
    """Feature tokens of one frame: the tower's patches after the pixel shuffle."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype):
        super().__init__()
        self.proj = ReplicatedLinear(input_size, output_size, bias=False, params_dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)


class Idefics3Connector(nn.Module):
    """Pixel shuffle (each ``scale`` x ``scale`` block of patches becomes one token, its
    features side by side), then one projection to the language model's width."""

    def __init__(self, config: Any, text_hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.scale_factor = config.scale_factor
        vision_size = config.vision_config.hidden_size
        self.modality_projection = Idefics3SimpleMLP(vision_size * self.scale_factor**2, text_hidden_size, dtype)

    def pixel_shuffle(self, features: torch.Tensor) -> torch.Tensor:
        """``[frames, side * side, hidden]`` -> ``[frames, (side / s) ** 2, hidden * s * s]``,
        in transformers' order (the block's rows grouped first, then its columns)."""
        num_frames, num_patches, hidden_size = features.shape
        side = int(num_patches**0.5)
        scale = self.scale_factor
        features = features.reshape(num_frames, side, side // scale, hidden_size * scale)
        features = features.permute(0, 2, 1, 3).reshape(
            num_frames, side // scale, side // scale, hidden_size * scale**2
        )
        return features.permute(0, 2, 1, 3).reshape(num_frames, num_patches // scale**2, hidden_size * scale**2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(self.pixel_shuffle(features))


# checkpoint prefixes of Idefics3 -> this model's names
_CHECKPOINT_PREFIXES = (
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The Llama language model (``text_config``) with the SigLIP tower and connector beside it."""

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        if not self.is_first_stage or not self.is_last_stage:
            # the model runner merges image embeddings on the stage that samples only
            raise ConfigError(
                "Idefics3ForConditionalGeneration does not run with pipeline parallelism yet: use "
                "--pipeline-parallel-size 1",
                param="pipeline_parallel_size",
            )
        config = ctx.hf_config
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        if side % config.scale_factor:
            raise ConfigError(
                f"scale_factor {config.scale_factor} does not divide the vision tower's {side} x {side} patches"
            )
        self.image_token_id = config.image_token_id
        self.image_seq_len = image_seq_len(config)
        self.vision_model = SiglipVisionTransformer(vision, self.dtype)
        self.connector = Idefics3Connector(config, self.config.hidden_size, self.dtype)

    @staticmethod
    def text_config(hf_config: Any) -> Any:
        return hf_config.text_config

    def checkpoint_name(self, name: str) -> str:
        for prefix, replacement in _CHECKPOINT_PREFIXES:
            if name.startswith(prefix):
                return replacement + name[len(prefix) :]
        return name

    def image_features(self, pixel_values: torch.Tensor, attention_backend: Any) -> torch.Tensor:
        """``[frames, 3, image_size, image_size]`` -> ``[frames * image_seq_len, hidden_size]``."""
        return self.connector(self.vision_model(pixel_values, attention_backend)).flatten(0, 1)

    def embed_multimodal(self, item: MultiModalItem, attention_backend: Any) -> torch.Tensor:
        """One image's span, ``[item.length, hidden_size]``: its frames' features (or the
        request's ``image_embeds``) at the ``<image>`` tokens, the markers' token embeddings
        around them."""
        token_ids = item.data["token_ids"]
        features = item_features(item, self.dtype, lambda pixels: self.image_features(pixels, attention_backend))
        embeddings = self.embed_input_ids(token_ids)
        embeddings[token_ids == self.image_token_id] = features.to(embeddings.dtype)
        return embeddings
