"""Gemma 2: Gemma 3's sandwich layer (``(1 + weight)`` RMSNorms before and after both attention
and MLP, GeGLU, embeddings scaled by ``sqrt(hidden_size)``, ``query_pre_attn_scalar`` as the
softmax scale) without the q/k norms, with one RoPE setting for every layer, sliding-window
attention on alternate layers (``layer_types``: the first slides), and soft-capped attention
and final logits (``attn_logit_softcapping``, ``final_logit_softcapping``). Registered by
:mod:`~tokenloom.builtin_plugins.models.gemma2`."""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenloom.builtin_plugins.models.modeling_gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM
from tokenloom.model_api import rope_parameters_from_config


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    def make_layer(self, layer_index: int) -> nn.Module:
        return Gemma3DecoderLayer(self, layer_index, None, qk_norm=None)

    def rope_parameters(self, layer_type: str | None) -> dict[str, Any]:
        # unlike Gemma 3, local and global layers share one RoPE base
        return rope_parameters_from_config(self.config)
