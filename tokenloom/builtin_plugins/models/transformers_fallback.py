"""The Transformers fallback (``--model-impl transformers``, and ``auto`` for an architecture no
native plugin serves): transformers' own modeling code for the architecture, with each attention
layer's ``softmax(QK^T)V`` handed to tokenloom's paged :class:`Attention` through transformers'
attention interface. Embeddings, norms, MLPs and rotary embeddings (from tokenloom's positions)
stay transformers'; the KV cache, prefix caching, chunked prefill and batching are the engine's.

The whole batch runs as one transformers sequence (``[1, num_tokens]``): no causal mask is built
(transformers builds none for an attention function it has no mask function for), because the
paged attention knows from the ``AttentionMetadata`` where each sequence starts and what it may see.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tokenloom.model_api import (
    Attention,
    ConfigError,
    KVCacheSpec,
    ModelContext,
    ModelLoadError,
    head_size_of,
    mixture_of_experts_error,
    sliding_windows_of,
)

logger = logging.getLogger(__name__)

#: the name under which tokenloom's paged attention is registered in transformers'
#: ``ALL_ATTENTION_FUNCTIONS`` and set as the config's ``_attn_implementation``
ATTENTION_IMPLEMENTATION = "tokenloom_paged"
NATIVE_HINT = "write a model plugin for it (see PLUGINS.md, register_models)"


def transformers_config(hf_config: Any) -> Any:
    """``hf_config`` as transformers' config class of its model type (a GGUF file's config is
    plain attributes)."""
    import transformers

    if isinstance(hf_config, transformers.PreTrainedConfig):
        return hf_config
    attributes = dict(hf_config.to_dict())
    model_type = attributes.pop("model_type", None)
    try:
        return transformers.AutoConfig.for_model(model_type, **attributes)
    except ValueError as exc:
        raise ModelLoadError(
            f"transformers {transformers.__version__} has no config class for model type {model_type!r}: "
            f"the Transformers fallback cannot build this model; {NATIVE_HINT}"
        ) from exc


def transformers_causal_lm_class(hf_config: Any) -> type:
    """The transformers class the fallback would run for ``hf_config``, or a ModelLoadError that
    says why it cannot: no such class in the installed transformers, not a decoder-only causal
    LM, a multimodal model, layers that do not attend, a mixture of experts, or attention that
    does not go through transformers' attention interface."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architectures = list(getattr(hf_config, "architectures", None) or [])
    version = transformers.__version__
    known = [name for name in architectures if isinstance(getattr(transformers, name, None), type)]
    if not architectures:
        raise ModelLoadError(
            "the model's config names no architecture (its 'architectures' is empty): the Transformers "
            "fallback cannot tell which transformers class to run; add it to config.json"
        )
    if not known:
        raise ModelLoadError(
            f"transformers {version} has no class {', '.join(architectures)}, so the Transformers fallback "
            f"cannot run it; {NATIVE_HINT}"
        )
    architecture = known[0]
    if architecture not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise ModelLoadError(
            f"{architecture} is not a decoder-only causal language model (an encoder such as BERT, or "
            "another head): the Transformers fallback generates text with causal LMs only; an encoder "
            "with a native plugin serves embeddings with --model-impl auto"
        )
    config = transformers_config(hf_config)
    if config.get_text_config() is not config:
        raise ModelLoadError(
            f"{architecture} is a multimodal model: the Transformers fallback serves text-only causal LMs; {NATIVE_HINT}"
        )
    # a recurrent or convolutional layer would mix the flat batch's sequences (transformers keeps
    # their state in its own cache, which the fallback does not use)
    other_layers = sorted(
        set(getattr(config.get_text_config(), "layer_types", None) or []) - {"full_attention", "sliding_attention"}
    )
    if other_layers:
        raise ModelLoadError(
            f"{architecture} has {', '.join(other_layers)} layers: the Transformers fallback runs models whose "
            f"layers all attend (fully or in a sliding window) over tokenloom's paged KV cache; {NATIVE_HINT}"
        )
    moe_error = mixture_of_experts_error(hf_config, architecture)
    if moe_error is not None:
        raise moe_error
    model_class = getattr(transformers, architecture)
    if not model_class.is_backend_compatible():
        raise ModelLoadError(
            f"{architecture}'s attention does not go through transformers' attention interface (transformers "
            f"{version} does not declare it compatible with custom attention backends), so the Transformers "
            f"fallback cannot plug tokenloom's paged attention in; {NATIVE_HINT}"
        )
    return model_class


def check_engine_config(hf_config: Any, config: Any) -> str:
    """The transformers class name the fallback runs for ``hf_config`` under the engine ``config``,
    or a ConfigError / ModelLoadError naming what to change (called in the main process, before
    any worker starts)."""
    architecture = transformers_causal_lm_class(hf_config).__name__
    for flag, value in (
        ("--tensor-parallel-size", config.parallel.tensor_parallel_size),
        ("--pipeline-parallel-size", config.parallel.pipeline_parallel_size),
    ):
        if value > 1:
            raise ConfigError(
                f"{flag} {value}: the Transformers fallback (running {architecture}) holds the whole model "
                f"in one worker; use {flag} 1, or a model with a native plugin",
                param=flag.removeprefix("--").replace("-", "_"),
            )
    if config.lora.enable_lora:
        raise ConfigError(
            f"--enable-lora: LoRA adapters need a native model plugin's layers; {architecture} runs through "
            "the Transformers fallback",
            param="enable_lora",
        )
    return architecture


def register_paged_attention() -> None:
    """Make ``ATTENTION_IMPLEMENTATION`` a valid ``_attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention_forward)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    softcap: float | None = None,
    *,
    tokenloom_attn_metadata: Any = None,
    tokenloom_paged_attention: nn.ModuleList | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over tokenloom's paged attention: ``query``
    ``[1, heads, tokens, head_size]``, ``key``/``value`` ``[1, kv_heads, tokens, head_size]``
    -> ``[1, tokens, heads, head_size]``. The step's metadata and the layers' ``Attention``
    modules arrive as keyword arguments that transformers passes through to here."""
    if tokenloom_attn_metadata is None or tokenloom_paged_attention is None:
        raise RuntimeError(
            f"{ATTENTION_IMPLEMENTATION} attention was called outside TransformersForCausalLM.forward "
            "(the model's layer did not pass its keyword arguments on)"
        )
    attention: Attention = tokenloom_paged_attention[module.layer_idx]
    _, num_heads, num_tokens, head_size = query.shape
    if (num_heads, key.shape[1], head_size) != (attention.num_heads, attention.num_kv_heads, attention.head_size):
        raise ModelLoadError(
            f"layer {module.layer_idx} attends with {num_heads} query heads, {key.shape[1]} KV heads of size "
            f"{head_size}, but the config gave {attention.num_heads}, {attention.num_kv_heads} and "
            f"{attention.head_size}: the Transformers fallback cannot size this model's KV cache"
        )
    # the module's own scale and soft cap, as transformers passes them (fixed per layer)
    if scaling is not None:
        attention.scale = scaling
    if softcap is not None:
        attention.logits_soft_cap = softcap
    output = attention(
        query[0].transpose(0, 1).contiguous(),
        key[0].transpose(0, 1).contiguous(),
        value[0].transpose(0, 1).contiguous(),
        tokenloom_attn_metadata,
    )
    return output.view(1, num_tokens, num_heads, head_size), None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no random
    initialisation: the checkpoint fills them) while buffers (rotary frequencies, embedding
    scales) are computed for real on the current device."""
    register_parameter = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]


def materialize_parameters(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter by an empty one on ``device``; a parameter shared by two
    modules (a tied LM head) stays shared."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device.type != "meta":
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device=device), requires_grad=False
                )
            setattr(module, name, replaced[id(param)])


class TransformersForCausalLM(nn.Module):
    """Any decoder-only causal LM of the installed transformers (see
    :func:`transformers_causal_lm_class`), as a tokenloom model.

    The transformers model's top-level modules are registered on this module under their own
    names, so parameter names are the checkpoint's (``model.layers.0.self_attn.q_proj.weight``);
    ``paged_attention`` holds one parameterless :class:`Attention` per layer."""

    def __init__(self, ctx: ModelContext):
        super().__init__()
        config = copy.deepcopy(transformers_config(ctx.hf_config))
        model_class = transformers_causal_lm_class(config)
        register_paged_attention()
        config._attn_implementation = ATTENTION_IMPLEMENTATION
        config.dtype = ctx.dtype
        self.architecture = model_class.__name__
        with parameters_on_meta():
            hf_model = model_class(config)
        materialize_parameters(hf_model, ctx.dtype, ctx.device)
        hf_model.eval()
        bidirectional = sorted(
            {type(module).__name__ for module in hf_model.modules() if getattr(module, "is_causal", True) is False}
        )
        if bidirectional:
            raise ModelLoadError(
                f"{self.architecture} attends both ways ({', '.join(bidirectional)} is not causal): the "
                "Transformers fallback serves decoder-only causal LMs"
            )
        # a tuple keeps the transformers model out of this module's tree: its children are
        # registered below under their own names instead
        self._hf_model = (hf_model,)
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self.text_config = config.get_text_config()
        self.lm_head_module: nn.Module = hf_model.get_output_embeddings()
        self.logit_scale = getattr(self.text_config, "logit_scale", None)  # Cohere: logits * scale
        self.logits_scaling = getattr(self.text_config, "logits_scaling", None)  # Granite: logits / scaling
        self.final_logit_softcapping = getattr(self.text_config, "final_logit_softcapping", None)
        num_layers = self.text_config.num_hidden_layers
        num_heads = self.text_config.num_attention_heads
        num_kv_heads = getattr(self.text_config, "num_key_value_heads", None) or num_heads
        head_size = head_size_of(self.text_config)
        sliding_windows = sliding_windows_of(self.text_config, ctx.model_config)
        self.paged_attention = nn.ModuleList(
            Attention(
                num_heads,
                head_size,
                head_size**-0.5,  # replaced by the module's own scaling on its first call
                num_kv_heads,
                layer_index,
                sliding_window=sliding_windows[layer_index],
                logits_soft_cap=getattr(self.text_config, "attn_logit_softcapping", None),
            )
            for layer_index in range(num_layers)
        )
        self.kv_cache_spec = KVCacheSpec(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size, sliding_windows=sliding_windows
        )
        self.dtype = ctx.dtype
        logger.info(
            "Transformers fallback: running transformers' %s with tokenloom's paged attention", self.architecture
        )

    @staticmethod
    def check_engine_config(hf_config: Any, config: Any) -> str:
        """The loader's question before it chooses this model (see :func:`check_engine_config`)."""
        return check_engine_config(hf_config, config)

    @property
    def hf_model(self) -> nn.Module:
        return self._hf_model[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        outputs = self.hf_model.base_model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            tokenloom_attn_metadata=attn_metadata,
            tokenloom_paged_attention=self.paged_attention,
        )
        hidden_states: torch.Tensor = outputs[0][0]
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head_module(hidden_states)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Checkpoint tensors by their transformers names; a packed quantized tensor (GGUF) is
        dequantized into the model's dtype."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        # names transformers has changed since checkpoints were written (GPT-NeoX's embed_out is lm_head)
        renamings = [
            mapping for mapping in get_model_conversion_mapping(self.hf_model) if isinstance(mapping, WeightRenaming)
        ]
        parameters = dict(self.named_parameters(remove_duplicate=False))
        # a tied LM head is the embedding's parameter under a second name: report the first
        canonical_names = {id(param): name for name, param in self.named_parameters()}
        loaded: set[str] = set()
        unexpected: list[str] = []
        for checkpoint_name, tensor in weights:
            name = checkpoint_name
            for renaming in renamings:
                name, _ = renaming.rename_source_key(name)
            param = parameters.get(name)
            if param is None:
                unexpected.append(checkpoint_name)
                continue
            if hasattr(tensor, "dequantize"):
                tensor = tensor.dequantize()
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {checkpoint_name} has shape {tuple(tensor.shape)}, but transformers' "
                    f"{self.architecture} built from the model's config expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor.to(param.dtype))
            loaded.add(canonical_names[id(param)])
        if unexpected:
            shown = ", ".join(unexpected[:5]) + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            logger.warning("checkpoint tensors that %s has no parameter for were skipped: %s", self.architecture, shown)
        return loaded
