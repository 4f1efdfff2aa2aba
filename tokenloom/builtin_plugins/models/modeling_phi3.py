"""Phi-3 (and Phi-4-mini): the Llama network whose checkpoints fuse the projections: ``qkv_proj``
(query, key and value rows in that order) and ``gate_up_proj`` (gate rows, then up rows), split
here at load into the shards tokenloom's fused layers take, so tensor parallelism slices them
like any other. RoPE may rotate part of each head (``partial_rotary_factor``); ``longrope``
scaling is served within its original context (see :mod:`tokenloom.layers.rotary`). Registered
by :mod:`~tokenloom.builtin_plugins.models.phi3`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from tokenloom.builtin_plugins.models.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenloom.model_api import ModelLoadError


def _rows(weight: Any, start: int, length: int) -> Any:
    """Rows ``start:start + length`` of a checkpoint weight; a packed GGUF weight stays packed."""
    if hasattr(weight, "narrow_rows"):
        return weight.narrow_rows(start, length)
    return weight.narrow(0, start, length)


class Phi3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(self, layer_index, qkv_bias=False, output_bias=False)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        config = self.config
        q_rows = config.num_attention_heads * self.head_size
        kv_rows = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * self.head_size
        for name, weight in weights:
            if name.endswith(".self_attn.qkv_proj.weight"):
                prefix = name.removesuffix("qkv_proj.weight")
                self._check_rows(name, weight, q_rows + 2 * kv_rows)
                yield prefix + "q_proj.weight", _rows(weight, 0, q_rows)
                yield prefix + "k_proj.weight", _rows(weight, q_rows, kv_rows)
                yield prefix + "v_proj.weight", _rows(weight, q_rows + kv_rows, kv_rows)
            elif name.endswith(".mlp.gate_up_proj.weight"):
                prefix = name.removesuffix("gate_up_proj.weight")
                self._check_rows(name, weight, 2 * config.intermediate_size)
                yield prefix + "gate_proj.weight", _rows(weight, 0, config.intermediate_size)
                yield prefix + "up_proj.weight", _rows(weight, config.intermediate_size, config.intermediate_size)
            else:
                yield name, weight

    @staticmethod
    def _check_rows(name: str, weight: Any, expected: int) -> None:
        if weight.shape[0] != expected:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has {weight.shape[0]} rows; the config's shape needs {expected}"
            )
