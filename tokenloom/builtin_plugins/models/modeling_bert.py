"""BERT, the encoder (registered by :mod:`~tokenloom.builtin_plugins.models.bert`): word,
absolute position and token type embeddings, then post-norm layers of bidirectional
self-attention and a GELU MLP, each followed by a residual add and LayerNorm; a
:class:`~tokenloom.layers.pooler.Pooler` turns the last hidden states into one vector.

Prefill only: every prompt runs whole in one step and attends both ways within itself, so
the model keeps no KV cache (its ``KVCacheSpec`` has no layers). Every input is one segment
(token type 0), as sentence-transformers embeds single texts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.model_api import (
    Attention,
    ColumnParallelLinear,
    ConfigError,
    KVCacheSpec,
    ModelContext,
    Pooler,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_checkpoint_weights,
)

# checkpoint projection names -> the fused QKV projection's shards
BERT_STACKED_PARAMS = (
    ("qkv_proj", "query", "q"),
    ("qkv_proj", "key", "k"),
    ("qkv_proj", "value", "v"),
)
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        position_type = getattr(config, "position_embedding_type", "absolute") or "absolute"
        if position_type != "absolute":
            raise ConfigError(f"BertModel supports absolute position embeddings only, not {position_type!r}")
        hidden_size = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden_size, params_dtype=dtype)
        self.position_embeddings = VocabParallelEmbedding(
            config.max_position_embeddings, hidden_size, params_dtype=dtype
        )
        self.token_type_embeddings = VocabParallelEmbedding(config.type_vocab_size, hidden_size, params_dtype=dtype)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(embeddings + self.token_type_embeddings.weight[0])


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, layer_index: int, linear_options: dict[str, Any]):
        super().__init__()
        num_heads = config.num_attention_heads
        if config.hidden_size % num_heads:
            raise ConfigError(f"hidden_size {config.hidden_size} is not divisible by {num_heads} attention heads")
        head_size = config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_size, num_heads, bias=True, **linear_options)
        self.attn = Attention(num_heads, head_size, head_size**-0.5, layer_index=layer_index)
        self.q_size = self.qkv_proj.q_size

    def forward(self, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        query, key, value = self.qkv_proj(hidden_states).split([self.q_size, self.q_size, self.q_size], dim=-1)
        # SDPA on many short sequences is ~20x slower on strided slices of the fused output
        return self.attn(query.contiguous(), key.contiguous(), value.contiguous(), attn_metadata)


class BertResidualOutput(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BERT's ``attention.output`` and ``output``."""

    def __init__(self, input_size: int, config: Any, linear_options: dict[str, Any]):
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, bias=True, **linear_options)
        self.LayerNorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_eps, dtype=linear_options["params_dtype"]
        )

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, layer_index: int, linear_options: dict[str, Any]):
        super().__init__()
        # "self" is the checkpoint's module name (attention.self.query ...)
        self.self = BertSelfAttention(config, layer_index, linear_options)
        self.output = BertResidualOutput(config.hidden_size, config, linear_options)

    def forward(self, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        return self.output(self.self(hidden_states, attn_metadata), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, linear_options: dict[str, Any]):
        super().__init__()
        activation = _ACTIVATIONS.get(config.hidden_act)
        if activation is None:
            raise ConfigError(
                f"unsupported BERT activation {config.hidden_act!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
            )
        self.activation = activation
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True, **linear_options)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int, linear_options: dict[str, Any]):
        super().__init__()
        self.attention = BertAttention(config, layer_index, linear_options)
        self.intermediate = BertIntermediate(config, linear_options)
        self.output = BertResidualOutput(config.intermediate_size, config, linear_options)

    def forward(self, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        attended = self.attention(hidden_states, attn_metadata)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, linear_options: dict[str, Any]):
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(config, index, linear_options) for index in range(config.num_hidden_layers)
        )

    def forward(self, hidden_states: torch.Tensor, attn_metadata) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states, attn_metadata)
        return hidden_states


class BertModel(nn.Module):
    """The BERT encoder honouring ``ModelProtocol`` for the pooling runner: ``forward``
    returns the last hidden states, ``pooler`` pools them (CLS unless the model's
    sentence-transformers files or ``--pooler-config`` say otherwise)."""

    default_pooling_type = "CLS"
    #: checkpoint tensors outside the encoder: BERT's next-sentence pooler, the pre-training
    #: heads, the position-id buffer (with or without a head model's ``bert.`` prefix)
    ignored_checkpoint_weights = (
        "pooler.*",
        "bert.pooler.*",
        "cls.*",
        "embeddings.position_ids",
        "bert.embeddings.position_ids",
    )

    def __init__(self, ctx: ModelContext):
        super().__init__()
        config = ctx.hf_config
        self.config = config
        self.dtype = ctx.dtype
        linear_options = {"quant_method": ctx.quantization, "params_dtype": ctx.dtype}
        self.embeddings = BertEmbeddings(config, ctx.dtype)
        self.encoder = BertEncoder(config, linear_options)
        self.pooler = Pooler.from_config(ctx.pooler_config, default_pooling_type=self.default_pooling_type)
        # prefill-only and bidirectional: nothing is cached between steps
        self.kv_cache_spec = KVCacheSpec(
            num_layers=0,
            num_kv_heads=config.num_attention_heads,
            head_size=config.hidden_size // config.num_attention_heads,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        if not attn_metadata.bidirectional:
            # an encoder attends both ways whatever the runner assumed; no KV cache is written then
            attn_metadata = dataclasses.replace(attn_metadata, bidirectional=True)
        max_positions = self.config.max_position_embeddings
        if positions.numel() and int(positions.max()) >= max_positions:
            raise ConfigError(
                f"BertModel has {max_positions} position embeddings; a sequence is longer (lower --max-model-len)"
            )
        return self.encoder(self.embeddings(input_ids, positions), attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ConfigError(
            "BertModel is an encoder without a language-model head: it pools (embeddings, scores) and cannot generate"
        )

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """Checkpoints of BERT with a head prefix the encoder ``bert.``; old ones name
        LayerNorm parameters ``gamma``/``beta``."""
        name = name.removeprefix("bert.")
        if name.endswith(".gamma"):
            return name[: -len("gamma")] + "weight"
        if name.endswith(".beta"):
            return name[: -len("beta")] + "bias"
        return name

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return load_checkpoint_weights(
            self,
            weights,
            stacked_params=BERT_STACKED_PARAMS,
            rename=self.checkpoint_name,
            ignored=self.ignored_checkpoint_weights,
        )
