"""Gemma 3 text models: local sliding-window and global layers (each kind with its own RoPE
base), per-head q/k RMSNorm, ``(1 + weight)`` norms before and after both attention and
MLP, embeddings scaled by ``sqrt(hidden_size)``, GeGLU, ``query_pre_attn_scalar`` as the
softmax scale, and optional attention / final logit soft-capping.

``Gemma3ForConditionalGeneration`` runs the text part of the multimodal checkpoint (image
inputs are not supported). Registered by :mod:`~tokenloom.builtin_plugins.models.gemma3`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.model_api import (
    DecoderForCausalLM,
    GatedMLP,
    GemmaRMSNorm,
    SelfAttention,
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


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint; vision weights are skipped."""

    # the vision tower and its projector, under either naming (transformers >= 4.52 first)
    ignored_checkpoint_weights = (
        *Gemma3ForCausalLM.ignored_checkpoint_weights,
        "model.vision_tower.*",
        "model.multi_modal_projector.*",
        "vision_tower.*",
        "multi_modal_projector.*",
    )

    # checkpoint prefixes of the language model: transformers >= 4.52 names first
    _TEXT_PREFIXES = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("lm_head.", "lm_head."),
    )

    @staticmethod
    def text_config(hf_config):
        return getattr(hf_config, "text_config", hf_config)

    def checkpoint_name(self, name: str) -> str:
        for prefix, replacement in self._TEXT_PREFIXES:
            if name.startswith(prefix):
                return replacement + name[len(prefix) :]
        return name
