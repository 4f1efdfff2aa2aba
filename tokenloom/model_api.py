"""The one stable import surface for the code of a model plugin: the causal-LM skeleton, the
layers a model is built from (attention, MLPs, norms, rotary embeddings, the tensor-parallel
linear, embedding and LM-head layers, the pooler), what the model runner hands a model and
expects of it, and what ``load_weights`` needs. Internal modules may move; the names here do not.

A model plugin is two modules: its registration (``@hookimpl register_models``, from
:mod:`tokenloom.plugin_api`, which imports no torch, so ``tokenloom plugins`` and
``tokenloom models`` stay fast) and its model file, which imports from here. Importing this
module imports torch: only a worker building the model does.
"""

from __future__ import annotations

from tokenloom.core.batch import encoder_attention_metadata
from tokenloom.core.model_interface import (
    IntermediateTensors,
    KVCacheSpec,
    ModelContext,
    ModelProtocol,
    mixture_of_experts_error,
)
from tokenloom.core.multimodal.inputs import MultiModalItem, item_features
from tokenloom.errors import ConfigError, ModelLoadError
from tokenloom.layers.activation import get_act_and_mul
from tokenloom.layers.attention import Attention
from tokenloom.layers.decoder import GatedMLP, SelfAttention
from tokenloom.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenloom.layers.fused_decode import FusedDecodeLayer
from tokenloom.layers.fused_moe import FusedMoE, expert_stacked_params, route
from tokenloom.layers.layernorm import GemmaRMSNorm, RMSNorm
from tokenloom.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    kv_heads_per_rank,
)
from tokenloom.layers.mrope import MRotaryEmbedding, get_mrope
from tokenloom.layers.pipeline import MissingLayer, number_attention_layers, stage_layers
from tokenloom.layers.pooler import Pooler
from tokenloom.layers.quantization import QuantizationMethod, materialize
from tokenloom.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from tokenloom.layers.weight_loading import DECODER_STACKED_PARAMS, load_checkpoint_weights
from tokenloom.models.causal_lm import (
    DecoderForCausalLM,
    DecoderStack,
    head_size_of,
    layer_types_of,
    sliding_windows_of,
)

__all__ = [
    # what the model runner hands a model and expects of it
    "ModelContext",
    "ModelProtocol",
    "KVCacheSpec",
    "IntermediateTensors",
    "mixture_of_experts_error",
    # a model that sees: the items it embeds, and its encoder's attention over each whole item
    "MultiModalItem",
    "item_features",
    "encoder_attention_metadata",
    "ModelLoadError",
    "ConfigError",
    # the decoder-only skeleton: a model file adds its decoder layer
    "DecoderForCausalLM",
    "DecoderStack",
    "head_size_of",
    "layer_types_of",
    "sliding_windows_of",
    # layers
    "SelfAttention",
    "GatedMLP",
    "Attention",
    "RMSNorm",
    "GemmaRMSNorm",
    "get_act_and_mul",
    "RotaryEmbedding",
    "MRotaryEmbedding",
    "get_mrope",
    "get_rope",
    "rope_parameters_from_config",
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "kv_heads_per_rank",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "FusedDecodeLayer",
    # mixture of experts: router, top-k routing, every expert a batch routes to in one operator
    "FusedMoE",
    "expert_stacked_params",
    "route",
    "Pooler",
    # pipeline stages
    "MissingLayer",
    "stage_layers",
    "number_attention_layers",
    # weights
    "load_checkpoint_weights",
    "DECODER_STACKED_PARAMS",
    "QuantizationMethod",
    "materialize",
]
