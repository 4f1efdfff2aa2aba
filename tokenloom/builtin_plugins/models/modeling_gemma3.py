"""Gemma 3 text models: local sliding-window and global layers (each kind with its own RoPE
base), per-head q/k RMSNorm, ``(1 + weight)`` norms before and after both attention and
MLP, embeddings scaled by ``sqrt(hidden_size)``, GeGLU, ``query_pre_attn_scalar`` as the
softmax scale, and optional attention / final logit soft-capping.

``Gemma3ForConditionalGeneration`` is the multimodal checkpoint: the SigLIP vision tower
(:mod:`~tokenloom.builtin_plugins.models.modeling_siglip`), Gemma 3's projector (the tower's
patches average-pooled to ``mm_tokens_per_image``, the soft-embedding RMSNorm, one matrix to
the language model's width) and this language model, where an image's tokens attend to each
other both ways during prefill (its items are ``bidirectional``), as transformers' mask from
``token_type_ids`` has them. Registered by :mod:`~tokenloom.builtin_plugins.models`, with its
processor :mod:`~tokenloom.builtin_plugins.models.gemma3_processing`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.builtin_plugins.models.modeling_siglip import SiglipVisionTransformer
from tokenloom.model_api import (
    ConfigError,
    DecoderForCausalLM,
    GatedMLP,
    GemmaRMSNorm,
    ModelContext,
    MultiModalItem,
    SelfAttention,
    item_features,
    layer_types_of,
    rope_parameters_from_config,
)

# transformers < 4.53 kept one RoPE config for global layers and a base for local ones
_LEGACY_LOCAL_ROPE_THETA = 10000.0


class Gemma3DecoderLayer(nn.Module):
    """Gemma's sandwich layer. ``rope_layer_type`` picks the RoPE settings (None: the model's
    one setting); ``qk_norm`` is Gemma 3's per-head query/key norm (None for Gemma 2)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        layer_index: int,
        rope_layer_type: str | None,
        *,
        qk_norm: type[nn.Module] | None = GemmaRMSNorm,
    ):
        super().__init__()
        config = model.config
        hidden_size, eps, dtype = config.hidden_size, config.rms_norm_eps, model.dtype
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps, params_dtype=dtype)
        self.self_attn = SelfAttention(
            hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            model.head_size,
            layer_index=layer_index,
            rotary_emb=model.rope(rope_layer_type),
            scale=config.query_pre_attn_scalar**-0.5,
            qkv_bias=attention_bias,
            output_bias=attention_bias,
            sliding_window=model.sliding_windows[layer_index],
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None),
            qk_norm=qk_norm,
            norm_eps=eps,
            **model.linear_options(),
        )
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps, params_dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps, params_dtype=dtype)
        hidden_act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.mlp = GatedMLP(hidden_size, config.intermediate_size, hidden_act, **model.linear_options())
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps, params_dtype=dtype)

    def forward(self, positions, hidden_states, residual, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, attn_metadata))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    norm_class = GemmaRMSNorm

    def make_layer(self, layer_index: int) -> nn.Module:
        return Gemma3DecoderLayer(self, layer_index, layer_types_of(self.config)[layer_index])

    def embedding_multiplier(self) -> torch.Tensor:
        # rounded to the model dtype as transformers does (sqrt(640) becomes 25.25 in bf16)
        return torch.tensor(self.config.hidden_size**0.5, dtype=self.dtype)

    def rope_parameters(self, layer_type: str | None) -> dict[str, Any]:
        nested = getattr(self.config, "rope_parameters", None)
        if layer_type == "sliding_attention" and not (isinstance(nested, dict) and layer_type in nested):
            theta = getattr(self.config, "rope_local_base_freq", None) or _LEGACY_LOCAL_ROPE_THETA
            return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 1.0}
        return rope_parameters_from_config(self.config, layer_type)


def mm_tokens_per_side(config: Any) -> int:
    """Image tokens along one side of the pooled patch grid (``mm_tokens_per_image`` is its square)."""
    side = math.isqrt(config.mm_tokens_per_image)
    patches_per_side = config.vision_config.image_size // config.vision_config.patch_size
    if side * side != config.mm_tokens_per_image or patches_per_side % side:
        raise ConfigError(
            f"mm_tokens_per_image {config.mm_tokens_per_image} must be the square of a number dividing the vision "
            f"tower's {patches_per_side} patches per side"
        )
    return side


class Gemma3MultiModalProjector(nn.Module):
    """``[images, patches, vision hidden]`` -> ``[images, mm_tokens_per_image, text hidden]``:
    the patch grid average-pooled in square windows, RMS-normalised, then projected."""

    def __init__(self, config: Any, text_hidden_size: int, dtype: torch.dtype):
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        self.pool_size = self.patches_per_side // mm_tokens_per_side(config)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, params_dtype=dtype)
        # stored [vision hidden, text hidden]: the features multiply it from the left
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text_hidden_size, dtype=dtype))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        num_images, _, hidden_size = features.shape
        grid = features.transpose(1, 2).reshape(num_images, hidden_size, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.pool_size).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, hidden_size)).view(num_images, -1, hidden_size)
        return torch.matmul(normed, self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The Gemma 3 language model (``text_config``) with the SigLIP tower and projector beside it."""

    # checkpoint prefixes: transformers >= 4.52 names first (its files keep SigLIP's
    # vision_model level, its modules in memory drop it), then the older layout
    _CHECKPOINT_PREFIXES = (
        ("model.language_model.", "model."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.vision_model.", "vision_tower."),
    )

    # SigLIP's pooling head: transformers' Gemma 3 reads the tower's last hidden states, never it
    ignored_checkpoint_weights = (
        *Gemma3ForCausalLM.ignored_checkpoint_weights,
        "model.vision_tower.head.*",
        "*vision_tower.vision_model.head.*",
    )

    def __init__(self, ctx: ModelContext):
        super().__init__(ctx)
        if not self.is_first_stage or not self.is_last_stage:
            # the model runner merges image embeddings on the stage that samples only
            raise ConfigError(
                "Gemma3ForConditionalGeneration does not run with pipeline parallelism yet: use "
                "--pipeline-parallel-size 1",
                param="pipeline_parallel_size",
            )
        config = ctx.hf_config
        self.vision_tower = SiglipVisionTransformer(config.vision_config, self.dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(config, self.config.hidden_size, self.dtype)

    @staticmethod
    def text_config(hf_config: Any) -> Any:
        if getattr(hf_config, "vision_config", None) is None or getattr(hf_config, "text_config", None) is None:
            raise ConfigError(
                "a Gemma3ForConditionalGeneration config needs its text_config and its vision_config (the SigLIP "
                "tower); a text-only Gemma 3 is Gemma3ForCausalLM"
            )
        return hf_config.text_config

    def checkpoint_name(self, name: str) -> str:
        for prefix, replacement in self._CHECKPOINT_PREFIXES:
            if name.startswith(prefix):
                return replacement + name[len(prefix) :]
        return name

    def image_features(self, pixel_values: torch.Tensor, attention_backend: Any) -> torch.Tensor:
        """``[images, 3, image_size, image_size]`` -> ``[images * mm_tokens_per_image, hidden_size]``."""
        return self.multi_modal_projector(self.vision_tower(pixel_values, attention_backend)).flatten(0, 1)

    def embed_multimodal(self, item: MultiModalItem, attention_backend: Any) -> torch.Tensor:
        """One image's ``mm_tokens_per_image`` embeddings (the request's ``image_embeds`` as they are)."""
        return item_features(item, self.dtype, lambda pixels: self.image_features(pixels, attention_backend))
