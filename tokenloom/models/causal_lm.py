"""What decoder-only models share, built-in or a plugin's (through :mod:`tokenloom.model_api`):
reading head size and per-layer sliding windows from a Hugging Face config, and
:class:`DecoderForCausalLM`, the
``model.embed_tokens -> model.layers -> model.norm -> lm_head`` skeleton with forward,
logits, weight loading and the KV-cache spec. A model file adds only its decoder layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenloom.core.model_interface import IntermediateTensors, KVCacheSpec, ModelContext
from tokenloom.layers import row_roles
from tokenloom.layers.embedding import ParallelLMHead, QuantizedLMHead, VocabParallelEmbedding
from tokenloom.layers.fused_decode import FusedDecodeStack
from tokenloom.layers.layernorm import RMSNorm
from tokenloom.layers.linear import kv_heads_per_rank
from tokenloom.layers.pipeline import MissingLayer, number_attention_layers, stage_layers
from tokenloom.layers.pooler import Pooler
from tokenloom.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config
from tokenloom.layers.weight_loading import DECODER_STACKED_PARAMS, ROTARY_BUFFERS, load_checkpoint_weights


def head_size_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_types_of(config: Any) -> list[str]:
    """Each layer's kind, ``"sliding_attention"`` or ``"full_attention"``.

    In order of precedence: ``layer_types`` (transformers >= 4.53), Qwen2's
    ``max_window_layers``, Gemma's ``sliding_window_pattern``, else every layer slides
    when the config has a window (Mistral).
    """
    num_layers = config.num_hidden_layers
    if not getattr(config, "sliding_window", None) or getattr(config, "use_sliding_window", True) is False:
        return ["full_attention"] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types[:num_layers])
    if getattr(config, "max_window_layers", None) is not None:
        first_sliding = config.max_window_layers
        return ["sliding_attention" if index >= first_sliding else "full_attention" for index in range(num_layers)]
    pattern = getattr(config, "sliding_window_pattern", None)
    if pattern:
        return ["sliding_attention" if (index + 1) % pattern else "full_attention" for index in range(num_layers)]
    return ["sliding_attention"] * num_layers


def sliding_windows_of(config: Any, model_config: Any = None) -> list[int | None]:
    """Each layer's sliding window in tokens (None: full attention); all None under
    ``--disable-sliding-window``."""
    if model_config is not None and getattr(model_config, "disable_sliding_window", False):
        return [None] * config.num_hidden_layers
    return [config.sliding_window if kind == "sliding_attention" else None for kind in layer_types_of(config)]


_UNBUILT = object()  # DecoderStack._fused_stack before the first forward


class DecoderStack(nn.Module):
    """``model.*`` of a Hugging Face causal LM: embedding, decoder layers, final norm.

    Each layer is called as ``layer(positions, hidden_states, residual, attn_metadata)`` and
    returns ``(hidden_states, residual)``: the residual add is fused into the next norm.

    On a pipeline stage only the layers of ``stage`` run (the others are
    :class:`~tokenloom.layers.pipeline.MissingLayer`); a stage after the first starts from
    the previous stage's :class:`IntermediateTensors`, and a stage before the last returns its own.
    """

    def __init__(
        self,
        embed_tokens: nn.Module,
        layers: list[nn.Module],
        norm: nn.Module,
        embedding_multiplier=None,
        *,
        stage: range | None = None,
        is_last_stage: bool = True,
    ):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        if embedding_multiplier is not None:
            self.register_buffer("embedding_multiplier", embedding_multiplier, persistent=False)
        else:
            self.embedding_multiplier = None
        stage = stage if stage is not None else range(len(layers))
        # a tuple, not a ModuleList: the layers are registered once, under ``layers``
        self._stage_layers = tuple(layers[stage.start : stage.stop])
        self.is_last_stage = is_last_stage
        # the stage's layers as one decode-step operator call, built on the first forward (the
        # layers' weights are packed after construction); None when they cannot be
        self._fused_stack: Any = _UNBUILT

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the first layer takes (scaled by the embedding multiplier)."""
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            hidden_states = hidden_states * self.embedding_multiplier
        return hidden_states

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate_tensors is None:
            hidden_states = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        if self._fused_stack is _UNBUILT:
            self._fused_stack = FusedDecodeStack.of(self._stage_layers)
        stacked = (
            self._fused_stack(positions, hidden_states, residual, attn_metadata)
            if self._fused_stack is not None
            else None
        )
        if stacked is not None:  # a decode step: every layer in one operator call
            hidden_states, residual = stacked
        else:
            prompt_query_lens = getattr(attn_metadata, "prompt_query_lens_cpu", None)
            with row_roles.computing(attn_metadata.query_lens_cpu if prompt_query_lens else (), prompt_query_lens):
                for layer in self._stage_layers:
                    hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """A decoder-only language model honouring ``ModelProtocol``; subclasses implement
    :meth:`make_layer` (and may override the class attributes below).

    ``load_weights`` also runs every linear layer's ``process_weights_after_loading``: the
    runner calls it once with the whole checkpoint, and nothing else is needed after it.
    """

    norm_class: type[nn.Module] = RMSNorm
    stacked_params = DECODER_STACKED_PARAMS
    #: checkpoint names (shell-style patterns) the model may leave unread; any other tensor no
    #: parameter takes is a load error naming it. A tied LM head and another pipeline stage's
    #: modules are skipped by :meth:`skipped_weight_prefixes` instead.
    ignored_checkpoint_weights: tuple[str, ...] = ROTARY_BUFFERS

    def __init__(self, ctx: ModelContext):
        super().__init__()
        config = self.text_config(ctx.hf_config)
        self.config = config
        self.ctx = ctx
        self.dtype = ctx.dtype
        self.quant_method = ctx.quantization
        self.head_size = head_size_of(config)
        self.sliding_windows = sliding_windows_of(config, ctx.model_config)
        self._ropes: dict[str, RotaryEmbedding] = {}
        # this worker's tensor-parallel group (None: one worker holds the whole model)
        self.tp_group = ctx.parallel.tp if ctx.parallel is not None and ctx.parallel.tp.size > 1 else None
        hidden_size = config.hidden_size
        # a head the checkpoint quantized is read from its own tensors, never tied to the embedding
        self.quantized_lm_head = bool(getattr(ctx.quantization, "quantizes_lm_head", False))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and not self.quantized_lm_head
        # pipeline parallelism: this worker builds its stage's layers only, the embedding on
        # the first stage (and on the last when the LM head shares its weight), the final
        # norm and the LM head on the last; every other module is a parameterless placeholder
        place = ctx.parallel.place if ctx.parallel is not None else None
        self.stage = stage_layers(config.num_hidden_layers, place)
        self.is_first_stage = place is None or place.is_first_stage
        self.is_last_stage = place is None or place.is_last_stage
        embed_tokens: nn.Module = MissingLayer()
        if self.is_first_stage or (self.is_last_stage and self.tie_word_embeddings):
            embed_tokens = VocabParallelEmbedding(
                config.vocab_size, hidden_size, params_dtype=self.dtype, tp_group=self.tp_group
            )
        layers = [
            self.make_layer(index) if index in self.stage else MissingLayer()
            for index in range(config.num_hidden_layers)
        ]
        # the stage's KV caches are its own layers' only: attention layer i reads cache i - stage.start
        number_attention_layers(layers[self.stage.start : self.stage.stop])
        norm: nn.Module = MissingLayer()
        if self.is_last_stage:
            norm = self.norm_class(hidden_size, config.rms_norm_eps, params_dtype=self.dtype)
        self.model = DecoderStack(
            embed_tokens, layers, norm, self.embedding_multiplier(), stage=self.stage, is_last_stage=self.is_last_stage
        )
        # float32 the platform chose (a CPU without native bfloat16): a float16 copy of the
        # head for decode steps reads half the bytes
        small_batch_dtype = torch.float16 if self.dtype == torch.float32 and not ctx.exact_dtype else None
        self.lm_head: nn.Module = MissingLayer()
        if self.is_last_stage and self.quantized_lm_head:
            self.lm_head = QuantizedLMHead(hidden_size, config.vocab_size, **self.linear_options())
        elif self.is_last_stage:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                hidden_size,
                params_dtype=self.dtype,
                small_batch_dtype=small_batch_dtype,
                tp_group=self.tp_group,
            )
            if self.tie_word_embeddings:
                self.lm_head.tie_to(embed_tokens)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        # --convert embed: the pooling runner pools the final hidden states (the last token's by default)
        self.pooler = (
            Pooler.from_config(ctx.pooler_config, default_pooling_type="LAST") if ctx.runner == "pooling" else None
        )
        total_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.kv_cache_spec = KVCacheSpec(
            num_layers=len(self.stage),
            # this rank's KV heads (a replicated head counts once on each rank that holds it)
            num_kv_heads=kv_heads_per_rank(total_kv_heads, self.tp_group.size if self.tp_group else 1)[0],
            head_size=self.head_size,
            sliding_windows=self.sliding_windows[self.stage.start : self.stage.stop],
        )

    # -- what subclasses customise -----------------------------------------------------

    @staticmethod
    def text_config(hf_config: Any) -> Any:
        """The config of the language model (multimodal wrappers return their text part)."""
        return hf_config

    def make_layer(self, layer_index: int) -> nn.Module:
        raise NotImplementedError

    def embedding_multiplier(self) -> torch.Tensor | None:
        """A factor applied to the token embeddings, or None."""
        return None

    def checkpoint_name(self, name: str) -> str:
        """The model's name for a checkpoint tensor."""
        return name

    # -- shared pieces -----------------------------------------------------------------

    def rope(self, layer_type: str | None = None) -> RotaryEmbedding:
        """The rotary embedding for ``layer_type``'s RoPE settings, built once and shared."""
        key = layer_type or "default"
        if key not in self._ropes:
            max_model_len = getattr(self.ctx.model_config, "max_model_len", None)
            self._ropes[key] = get_rope(
                self.head_size,
                self.rope_parameters(layer_type),
                self.config.max_position_embeddings,
                max_position=max_model_len,
                dtype=self.dtype,
            )
        return self._ropes[key]

    def rope_parameters(self, layer_type: str | None) -> dict[str, Any]:
        return rope_parameters_from_config(self.config, layer_type)

    def linear_options(self) -> dict[str, Any]:
        return {"quant_method": self.quant_method, "params_dtype": self.dtype, "tp_group": self.tp_group}

    # -- ModelProtocol -----------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings a multimodal model merges its media into (see ``forward``)."""
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """``inputs_embeds`` (a multimodal model's: token embeddings with its media merged in)
        replaces the embedding of ``input_ids``."""
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        if self.final_logit_softcapping:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return load_checkpoint_weights(
            self,
            weights,
            stacked_params=self.stacked_params,
            rename=self.checkpoint_name,
            skip_prefixes=self.skipped_weight_prefixes(),
            ignored=self.ignored_checkpoint_weights,
        )

    def skipped_weight_prefixes(self) -> tuple[str, ...]:
        """Model names the checkpoint need not fill here: a tied LM head, and every module of
        another pipeline stage (their tensors are skipped without being read)."""
        prefixes = [path + "." for path, module in self.named_modules() if isinstance(module, MissingLayer)]
        if self.tie_word_embeddings:
            prefixes.append("lm_head.")
        return tuple(prefixes)
