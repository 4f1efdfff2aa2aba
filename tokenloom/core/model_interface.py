"""What the core expects of a model plugin (:class:`ModelProtocol`) and what it hands one
when building it (:class:`ModelContext`), plus :class:`KVCacheSpec`, the KV shape a model needs,
and :func:`mixture_of_experts_error`, which the loader and the dense models use to refuse an MoE
config by what it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenloom.errors import ModelLoadError


@dataclass
class KVCacheSpec:
    """The KV cache a model needs: one ``[2, num_blocks, block_size, num_kv_heads, head_size]``
    tensor per attention layer. ``num_layers=0``: the model keeps none (a prefill-only encoder)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    # per layer: the sliding window in tokens, or None for full attention
    sliding_windows: list[int | None] = field(default_factory=list)

    def bytes_per_block(self, block_size: int, element_size: int) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_size * element_size


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: the hidden states after its last layer and the
    residual not yet added to them (both ``[num_tokens, hidden_size]``). A model split into
    stages returns this from ``forward`` on every stage but the last, and receives it as
    ``intermediate_tensors`` on every stage but the first."""

    hidden_states: Any
    residual: Any


@dataclass
class ModelContext:
    """Everything a model plugin's constructor receives."""

    hf_config: Any  # a config with transformers' attributes (PretrainedConfig or GGUFModelConfig), after --hf-overrides, --rope-*
    dtype: Any  # torch.dtype of weights and activations
    device: Any  # torch.device
    # the checkpoint's QuantizationConfig (pass it to linear layers as their quant_method: each
    # gets its method by module name once the model is built), or None for unquantized weights
    quantization: Any = None
    # False when the platform chose the dtype (--dtype auto): layers may then run small batches
    # in a narrower dtype where that is faster; True (the default) keeps every layer in ``dtype``
    exact_dtype: bool = True
    model_config: Any = None  # tokenloom.core.config.ModelConfig
    # "generate" or "pooling"; a pooling runner wants hidden states, not logits
    runner: str = "generate"
    # for the pooling runner: the resolved tokenloom.core.pooling.PoolerConfig (None: defaults)
    pooler_config: Any = None
    # this worker's place among the engine's workers and its tensor-/pipeline-parallel
    # communicators (tokenloom.core.distributed.ParallelState; None: one worker)
    parallel: Any = None


class ModelProtocol(Protocol):
    """A model plugin: an ``nn.Module`` constructed as ``Model(ctx: ModelContext)``.

    A model that sees (registered with a ``multimodal_processor``) also has
    ``embed_multimodal(item, attention_backend)`` (one image's ``[item.length, hidden_size]``
    embeddings) and ``embed_input_ids(input_ids)``, and its ``forward`` takes
    ``inputs_embeds=``: the token embeddings with the step's image placeholders replaced."""

    kv_cache_spec: KVCacheSpec

    def forward(self, input_ids: Any, positions: Any, attn_metadata: Any) -> Any:
        """Run the flat batch: ``input_ids`` and ``positions`` are ``[num_tokens]``; returns
        hidden states ``[num_tokens, hidden_size]``. K/V are written to
        ``attn_metadata.kv_caches[layer]`` at ``attn_metadata.slot_mapping``.

        A model that splits into pipeline stages (``ctx.parallel.place.pp_size > 1``) also
        takes ``intermediate_tensors=`` (an :class:`IntermediateTensors`, on every stage but
        the first, which embeds ``input_ids``) and returns an :class:`IntermediateTensors` on
        every stage but the last; ``layer`` then counts the stage's own layers from 0."""

    def compute_logits(self, hidden_states: Any) -> Any:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float logits."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load ``(hf_name, tensor)`` pairs (a tensor may be a packed quantized weight with a
        ``dequantize()`` method); returns the names of the parameters it filled."""


# config keys that count a mixture-of-experts model's experts (Mixtral / Qwen-MoE, OLMoE / DeepSeek)
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def mixture_of_experts_error(hf_config: Any, architecture: str) -> ModelLoadError | None:
    """The error refusing ``hf_config`` as a mixture-of-experts model ``architecture`` does not
    serve, or None for a dense one.

    A dense model built from an MoE checkpoint would only report its MLP weights as missing, so
    the model is named for what it is instead (the loader asks for an architecture no plugin
    registers, a dense built-in model for a config stating experts).
    """
    num_experts = next(
        (value for key in _EXPERT_COUNT_KEYS if isinstance(value := getattr(hf_config, key, None), int)), 0
    )
    if num_experts <= 1:
        return None
    style = "Mixtral-style, " if getattr(hf_config, "model_type", None) == "mixtral" else ""
    used = getattr(hf_config, "num_experts_per_tok", None)
    per_token = f", {used} per token" if isinstance(used, int) else ""
    return ModelLoadError(
        f"{architecture} is a mixture-of-experts model ({style}{num_experts} experts{per_token}), which tokenloom "
        "does not serve: its built-in mixture-of-experts models are Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, "
        "OlmoeForCausalLM and MixtralForCausalLM"
    )
