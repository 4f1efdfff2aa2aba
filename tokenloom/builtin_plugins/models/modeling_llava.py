"""LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector
and a Llama language model (registered by :mod:`~tokenloom.builtin_plugins.models`, with its
processor :mod:`~tokenloom.builtin_plugins.models.llava_processing`).

The vision tower is built from tokenloom's layers: its projections and MLPs are linear layers
on the CPU kernels, and its attention is the platform's attention backend over each image's
patches, both ways and without a KV cache. An image's embeddings (the hidden states of
``vision_feature_layer``, the class token dropped under the ``default`` strategy, through the
projector) replace its placeholder tokens' embeddings in the language model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.builtin_plugins.models.modeling_llama import LlamaForCausalLM
from tokenloom.model_api import (
    Attention,
    ConfigError,
    ModelContext,
    MultiModalItem,
    QKVParallelLinear,
    ReplicatedLinear,
    encoder_attention_metadata,
    item_features,
)

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _activation(name: str, what: str):
    if name not in _ACTIVATIONS:
        raise ConfigError(f"{what} {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


class CLIPVisionEmbeddings(nn.Module):
    """Patches by a strided convolution, a class token first, learned absolute positions."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        hidden_size = config.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            hidden_size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
            dtype=dtype,
        )
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, hidden_size, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, channels, height, width]`` -> ``[images, patches + 1, hidden]``."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        class_token = self.class_embedding.expand(patches.shape[0], 1, -1)
        embeddings = torch.cat([class_token, patches], dim=1)
        return embeddings + self.position_embedding.weight[: embeddings.shape[1]]


class CLIPAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        num_heads = config.num_attention_heads
        head_size = config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_size, num_heads, bias=True, params_dtype=dtype)
        self.out_proj = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True, params_dtype=dtype)
        self.attn = Attention(num_heads, head_size, head_size**-0.5)
        self.hidden_size = config.hidden_size

    def forward(self, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        query, key, value = self.qkv_proj(hidden_states).split([self.hidden_size] * 3, dim=-1)
        return self.out_proj(self.attn(query.contiguous(), key.contiguous(), value.contiguous(), attn_metadata))


class CLIPMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.activation = _activation(config.hidden_act, "CLIP vision activation")
        self.fc1 = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True, params_dtype=dtype)
        self.fc2 = ReplicatedLinear(config.intermediate_size, config.hidden_size, bias=True, params_dtype=dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(hidden_states)))


class CLIPEncoderLayer(nn.Module):
    """Pre-norm, non-causal: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.self_attn = CLIPAttention(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = CLIPMLP(config, dtype)

    def forward(self, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states), attn_metadata)
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config, dtype) for _ in range(config.num_hidden_layers))


class CLIPVisionTower(nn.Module):
    """``CLIPVisionModel``'s transformer, run up to the layer whose hidden states LLaVA reads
    (``post_layernorm`` belongs to the layers it never reads: loaded and unused)."""

    def __init__(self, config: Any, dtype: torch.dtype, feature_layer: int):
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config, dtype)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.encoder = CLIPEncoder(config, dtype)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        num_layers = config.num_hidden_layers
        # hidden_states[i] is the output of layer i (0: the embeddings), as transformers counts
        self.num_layers_run = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
        if not 0 <= self.num_layers_run <= num_layers:
            raise ConfigError(f"vision_feature_layer {feature_layer} is outside the {num_layers}-layer vision tower")

    def forward(self, pixel_values: torch.Tensor, attention_backend: Any) -> torch.Tensor:
        """``[images, 3, H, W]`` -> the chosen layer's hidden states ``[images, patches + 1, hidden]``."""
        embeddings = self.pre_layrnorm(self.embeddings(pixel_values))
        num_images, num_tokens, hidden_size = embeddings.shape
        attn_metadata = encoder_attention_metadata([num_tokens] * num_images, attention_backend)
        hidden_states = embeddings.reshape(num_images * num_tokens, hidden_size)
        for layer in self.encoder.layers[: self.num_layers_run]:
            hidden_states = layer(hidden_states, attn_metadata)
        return hidden_states.view(num_images, num_tokens, hidden_size)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_size: int, text_size: int, activation: str, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = ReplicatedLinear(vision_size, text_size, bias=bias, params_dtype=dtype)
        self.activation = _activation(activation, "projector_hidden_act")
        self.linear_2 = ReplicatedLinear(text_size, text_size, bias=bias, params_dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.activation(self.linear_1(features)))


# checkpoint prefixes of the layouts transformers has saved LLaVA in -> this model's names
_CHECKPOINT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The Llama language model (``text_config``) with the vision tower and projector beside it."""

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        if not self.is_first_stage or not self.is_last_stage:
            # the model runner merges image embeddings on the stage that samples only
            raise ConfigError(
                "LlavaForConditionalGeneration does not run with pipeline parallelism yet: use "
                "--pipeline-parallel-size 1",
                param="pipeline_parallel_size",
            )
        config = ctx.hf_config
        feature_layer = config.vision_feature_layer
        if not isinstance(feature_layer, int):
            raise ConfigError(
                f"vision_feature_layer {feature_layer!r}: LLaVA with features of several layers is not supported"
            )
        self.select_strategy = config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ConfigError(f"vision_feature_select_strategy {self.select_strategy!r} is not supported")
        vision_config = config.vision_config
        self.vision_tower = CLIPVisionTower(vision_config, self.dtype, feature_layer)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision_config.hidden_size,
            self.config.hidden_size,
            config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)),
            self.dtype,
        )

    @staticmethod
    def text_config(hf_config: Any) -> Any:
        return hf_config.text_config

    def checkpoint_name(self, name: str) -> str:
        for prefix, replacement in _CHECKPOINT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
                break
        # CLIPVisionModel's checkpoints nest the transformer under vision_model
        return name.replace("vision_tower.vision_model.", "vision_tower.", 1)

    def embed_multimodal(self, item: MultiModalItem, attention_backend: Any) -> torch.Tensor:
        """One image's embeddings, ``[item.length, hidden_size]`` (the request's ``image_embeds`` as they are)."""
        return item_features(item, self.dtype, lambda pixels: self.image_features(pixels, attention_backend))

    def image_features(self, pixel_values: torch.Tensor, attention_backend: Any) -> torch.Tensor:
        """``[images, 3, H, W]`` -> the projected features of every image, ``[images * features, hidden_size]``."""
        features = self.vision_tower(pixel_values, attention_backend)
        if self.select_strategy == "default":
            features = features[:, 1:]  # the class token is not an image feature
        return self.multi_modal_projector(features).flatten(0, 1)
