"""GGUF metadata -> the model config the model plugins read: a :class:`GGUFModelConfig` with the
attributes, defaults and ``to_dict()`` of transformers' LlamaConfig, Qwen2Config, Qwen3Config,
Gemma2Config, Gemma3TextConfig, Olmo2Config,
GraniteConfig, Phi3Config, Qwen3MoeConfig, Qwen2MoeConfig, OlmoeConfig or MixtralConfig (llama.cpp's ``llama``
with experts). RoPE scaling comes from llama.cpp's ``rope.scaling.*`` keys and, for Llama 3,
from the ``rope_freqs.weight`` tensor (carried as ``freq_factors``, see
:mod:`tokenloom.layers.rotary`); expert tensors in an architecture tokenloom serves dense only
are refused by what they are.

Built from llama.cpp's metadata keys without transformers: ``AutoConfig.from_pretrained(...,
gguf_file=...)`` parses the whole vocabulary, and merely importing a transformers config class
costs 1.5-2 s (transformers.activations pulls in torch.distributed and torch._dynamo), most of
a server's start-up. The tests compare every field with transformers' own conversion, so the
defaults below track the installed transformers.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile, SkippedStringArray
from tokenloom.errors import ModelLoadError

# transformers' RotaryEmbeddingConfigMixin.default_theta (Gemma 3 has its own pair, below)
DEFAULT_ROPE_THETA = 10_000.0
GEMMA3_GLOBAL_ROPE_THETA, GEMMA3_LOCAL_ROPE_THETA = 1_000_000.0, 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer attends globally


class GGUFModelConfig:
    """A model config as plain attributes (``config.hidden_size``, ``config.rope_parameters``):
    what transformers' config class of the same architecture would hold, picklable, and cheap."""

    def __init__(self, **attributes: Any):
        self.__dict__.update(attributes)

    @property
    def rope_scaling(self) -> Any:
        # transformers 5 keeps one RoPE dict, rope_parameters; rope_scaling is its old name
        return self.rope_parameters

    @rope_scaling.setter
    def rope_scaling(self, value: Any) -> None:
        self.rope_parameters = value

    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    def get_text_config(self, *args: Any, **kwargs: Any) -> GGUFModelConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.__dict__)

    def __repr__(self) -> str:
        fields = ", ".join(f"{key}={value!r}" for key, value in self.__dict__.items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GGUFModelConfig) and self.__dict__ == other.__dict__


def _pretrained_config_defaults() -> dict[str, Any]:
    """What transformers' PreTrainedConfig sets on every config."""
    return {
        "architectures": None,
        "output_hidden_states": False,
        "return_dict": True,
        "dtype": None,
        "chunk_size_feed_forward": 0,
        "is_encoder_decoder": False,
        "id2label": {0: "LABEL_0", 1: "LABEL_1"},
        "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "problem_type": None,
        "_name_or_path": "",
        "output_attentions": False,
    }


def _common(gguf: GGUFFile) -> dict[str, Any]:
    """Keys every supported architecture states the same way (absent optional keys are left out,
    so the architecture's default applies)."""

    def required(key: str) -> Any:
        value = gguf.arch_get(key)
        if value is None:
            raise ModelLoadError(
                f"GGUF file {gguf.path} lacks the metadata key {gguf.architecture}.{key}; the file is incomplete"
            )
        return value

    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab_size = gguf.arch_get("vocab_size")
    if vocab_size is None and tokens is not None:
        vocab_size = tokens.count if isinstance(tokens, SkippedStringArray) else len(tokens)
    fields: dict[str, Any] = {
        "hidden_size": int(required("embedding_length")),
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": int(required("attention.head_count")),
        "num_key_value_heads": int(gguf.arch_get("attention.head_count_kv", required("attention.head_count"))),
        "max_position_embeddings": int(required("context_length")),
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        # llama.cpp writes an output projection only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
    }
    if vocab_size is not None:
        fields["vocab_size"] = int(vocab_size)
    for config_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
        ("unk_token_id", "unknown_token_id"),
    ):
        token_id = gguf.get(f"tokenizer.ggml.{gguf_key}")
        if token_id is not None:
            fields[config_key] = int(token_id)
    return fields


def _rope_theta(gguf: GGUFFile, default: float) -> float:
    rope_theta = gguf.arch_get("rope.freq_base")
    return float(rope_theta) if rope_theta is not None else default


# the tensor in which llama.cpp's converter stores Llama 3 RoPE scaling: per-frequency divisors
ROPE_FREQS_TENSOR = "rope_freqs.weight"
_FLOAT_ARRAY_TYPES = {0: np.float32, 1: np.float16}  # ggml F32, F16


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any]:
    """The RoPE scaling llama.cpp's ``rope.scaling.*`` keys state, under transformers' names
    (``{}`` for none); a ModelLoadError for what tokenloom cannot reproduce exactly.

    llama.cpp reads a scaling factor without a type as linear (files written before the type key).
    """
    factor = gguf.arch_get("rope.scaling.factor", gguf.arch_get("rope.scale_linear"))
    scaling_type = str(gguf.arch_get("rope.scaling.type", "none" if factor is None else "linear"))
    attn_factor = gguf.arch_get("rope.scaling.attn_factor")
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise _unsupported_rope(gguf, f"rope.scaling.attn_factor {float(attn_factor)}")
    if scaling_type == "none" or factor is None or float(factor) in (0.0, 1.0):
        return {}
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type == "yarn":
        for key, neutral in (("rope.scaling.yarn_ext_factor", 1.0), ("rope.scaling.yarn_log_multiplier", 0.0)):
            value = gguf.arch_get(key)
            if value is not None and float(value) != neutral:
                raise _unsupported_rope(gguf, f"YaRN with {key} {float(value)}")
        parameters: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = gguf.arch_get("rope.scaling.original_context_length")
        if original is not None:
            parameters["original_max_position_embeddings"] = int(original)
        # the converter writes these from the Hugging Face config; transformers' defaults otherwise
        for key, name in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ("rope.scaling.yarn_attn_factor", "attention_factor"),
        ):
            value = gguf.arch_get(key)
            if value is not None:
                parameters[name] = float(value)
        return parameters
    raise _unsupported_rope(gguf, f"rope.scaling.type {scaling_type!r}")


def _unsupported_rope(gguf: GGUFFile, what: str) -> ModelLoadError:
    return ModelLoadError(
        f"GGUF file {gguf.path} states RoPE scaling tokenloom cannot reproduce ({what}); "
        "supported: none, linear, yarn, and Llama 3 frequency factors (rope_freqs.weight)"
    )


def _rope_freq_factors(gguf: GGUFFile, rotary_dim: int) -> list[float] | None:
    """The ``rope_freqs.weight`` divisors (Llama 3 scaling), or None when the file has none."""
    info = gguf.tensors.get(ROPE_FREQS_TENSOR)
    if info is None:
        return None
    dtype = _FLOAT_ARRAY_TYPES.get(info.ggml_type)
    if dtype is None or info.num_elements != rotary_dim // 2:
        raise ModelLoadError(
            f"GGUF file {gguf.path}: {ROPE_FREQS_TENSOR} must be {rotary_dim // 2} F32 or F16 values "
            f"(one per rotary frequency of the {rotary_dim}-dimensional rotation); it holds "
            f"{info.num_elements} of ggml type {info.ggml_type}"
        )
    factors = [float(value) for value in gguf.tensor_data(info).view(dtype)]
    if not all(math.isfinite(value) and value > 0 for value in factors):
        raise ModelLoadError(f"GGUF file {gguf.path}: {ROPE_FREQS_TENSOR} holds a factor that is not a positive number")
    return factors


def _rope_parameters(gguf: GGUFFile, default_theta: float, rotary_dim: int) -> dict[str, Any]:
    """``rope_parameters`` of a model with one RoPE setting for every layer."""
    parameters: dict[str, Any] = {"rope_theta": _rope_theta(gguf, default_theta), "rope_type": "default"}
    parameters.update(_rope_scaling(gguf))
    freq_factors = _rope_freq_factors(gguf, rotary_dim)
    if freq_factors is not None:
        parameters["freq_factors"] = freq_factors
    return parameters


def _llama_config(gguf: GGUFFile) -> GGUFModelConfig:
    fields = {
        **_pretrained_config_defaults(),
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "pad_token_id": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pretraining_tp": 1,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        **_common(gguf),
    }
    head_dim = gguf.arch_get("rope.dimension_count")
    fields["head_dim"] = (
        int(head_dim) if head_dim is not None else fields["hidden_size"] // fields["num_attention_heads"]
    )
    fields["rope_parameters"] = _rope_parameters(gguf, DEFAULT_ROPE_THETA, fields["head_dim"])
    if _expert_count(gguf):
        return _mixtral_config(gguf, fields)
    return GGUFModelConfig(**fields)


def _expert_count(gguf: GGUFFile) -> int:
    """The file's experts per MoE layer (0: a dense model)."""
    count = gguf.arch_get("expert_count")
    return int(count) if count else 0


def _expert_fields(gguf: GGUFFile) -> dict[str, Any]:
    used = gguf.arch_get("expert_used_count")
    if not used:
        raise ModelLoadError(
            f"GGUF file {gguf.path} lacks the metadata key {gguf.architecture}.expert_used_count (experts per "
            "token) of its mixture of experts; the file is incomplete"
        )
    return {"num_experts_per_tok": int(used)}


def _mixtral_config(gguf: GGUFFile, llama_fields: dict[str, Any]) -> GGUFModelConfig:
    """llama.cpp writes Mixtral as ``llama`` with experts; its feed_forward_length is each expert's."""
    fields = {key: value for key, value in llama_fields.items() if key not in ("pretraining_tp", "mlp_bias")}
    fields.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        sliding_window=None,
        num_local_experts=_expert_count(gguf),
        router_jitter_noise=0.0,
        **_expert_fields(gguf),
    )
    return GGUFModelConfig(**fields)


def _qwen2_config(gguf: GGUFFile) -> GGUFModelConfig:
    fields = {
        **_pretrained_config_defaults(),
        **_qwen_fields(gguf),
        "model_type": "qwen2",
    }
    rotary_dim = fields["hidden_size"] // fields["num_attention_heads"]
    fields["rope_parameters"] = _rope_parameters(gguf, DEFAULT_ROPE_THETA, rotary_dim)
    return GGUFModelConfig(**fields)


def _qwen3_config(gguf: GGUFFile) -> GGUFModelConfig:
    fields = {
        **_pretrained_config_defaults(),
        **_qwen_fields(gguf),
        "model_type": "qwen3",
        "attention_bias": False,
    }
    # Qwen3's head size is its own (128 in every size), not hidden_size / heads
    fields["head_dim"] = int(
        gguf.arch_get("attention.key_length", fields["hidden_size"] // fields["num_attention_heads"])
    )
    fields["rope_parameters"] = _rope_parameters(gguf, DEFAULT_ROPE_THETA, fields["head_dim"])
    return GGUFModelConfig(**fields)


def _qwen3_moe_config(gguf: GGUFFile) -> GGUFModelConfig:
    """llama.cpp's ``qwen3moe``: every layer a mixture of experts, routing renormalised (llama.cpp
    does so for every qwen3moe file; the key is not written)."""
    fields = _qwen3_config(gguf).to_dict()
    expert_size = gguf.arch_get("expert_feed_forward_length")
    if expert_size is None or not _expert_count(gguf):
        raise ModelLoadError(
            f"GGUF file {gguf.path} lacks the metadata key qwen3moe."
            f"{'expert_count' if not _expert_count(gguf) else 'expert_feed_forward_length'}; the file is incomplete"
        )
    fields.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=_expert_count(gguf),
        moe_intermediate_size=int(expert_size),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **_expert_fields(gguf),
    )
    return GGUFModelConfig(**fields)


def _qwen2_moe_config(gguf: GGUFFile) -> GGUFModelConfig:
    """llama.cpp's ``qwen2moe``: every layer a mixture of experts with a gated shared expert, routing
    not renormalised (llama.cpp never renormalises a qwen2moe file's weights). Absent expert
    sizes default as llama.cpp's loader defaults them."""
    fields = _qwen2_config(gguf).to_dict()
    num_experts = _expert_count(gguf)
    if not num_experts:
        raise ModelLoadError(
            f"GGUF file {gguf.path} lacks the metadata key qwen2moe.expert_count; the file is incomplete"
        )
    expert_fields = _expert_fields(gguf)
    expert_size = gguf.arch_get("expert_feed_forward_length")
    shared_size = gguf.arch_get("expert_shared_feed_forward_length")
    fields.update(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        qkv_bias=True,
        sliding_window=0,  # Qwen2MoeConfig's default (Qwen2Config's is None); no layer slides either way
        num_experts=num_experts,
        moe_intermediate_size=int(expert_size or fields["intermediate_size"] // expert_fields["num_experts_per_tok"]),
        shared_expert_intermediate_size=int(shared_size or fields["intermediate_size"]),
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        **expert_fields,
    )
    return GGUFModelConfig(**fields)


def _olmoe_config(gguf: GGUFFile) -> GGUFModelConfig:
    """llama.cpp's ``olmoe``: every layer a mixture of experts of ``feed_forward_length`` features,
    routing not renormalised (llama.cpp never renormalises an olmoe file's weights), no clipping."""
    num_experts = _expert_count(gguf)
    if not num_experts:
        raise ModelLoadError(f"GGUF file {gguf.path} lacks the metadata key olmoe.expert_count; the file is incomplete")
    fields = {
        **_pretrained_config_defaults(),
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        "vocab_size": 50304,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "pad_token_id": 1,
        "bos_token_id": None,
        "eos_token_id": 50279,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "num_experts": num_experts,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.01,
        **_expert_fields(gguf),
        **_common(gguf),
    }
    rotary_dim = fields["hidden_size"] // fields["num_attention_heads"]
    fields["rope_parameters"] = _rope_parameters(gguf, DEFAULT_ROPE_THETA, rotary_dim)
    return GGUFModelConfig(**fields)


def _qwen_fields(gguf: GGUFFile) -> dict[str, Any]:
    """What Qwen2Config and Qwen3Config share."""
    fields = {
        "vocab_size": 151936,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        # llama.cpp states no sliding window for Qwen2, and transformers' default is off
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "attention_dropout": 0.0,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        **_common(gguf),
    }
    fields["layer_types"] = ["full_attention"] * fields["num_hidden_layers"]
    return fields


def _gemma3_config(gguf: GGUFFile) -> GGUFModelConfig:
    fields = {
        **_pretrained_config_defaults(),
        "model_type": "gemma3_text",
        "vocab_size": 262_208,
        "hidden_activation": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "_sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
        **_common(gguf),
    }
    head_dim = int(gguf.arch_get("attention.key_length", fields["hidden_size"] // fields["num_attention_heads"]))
    fields["head_dim"] = head_dim
    # llama.cpp scales queries by 1/sqrt(head_dim) for every Gemma 3 size but the 27B (62 layers),
    # which uses hidden_size / num_heads; the Hugging Face configs agree
    fields["query_pre_attn_scalar"] = (
        fields["hidden_size"] // fields["num_attention_heads"] if fields["num_hidden_layers"] == 62 else head_dim
    )
    sliding_window = gguf.arch_get("attention.sliding_window")
    if sliding_window is not None:
        fields["sliding_window"] = int(sliding_window)
    if ROPE_FREQS_TENSOR in gguf.tensors:
        raise _unsupported_rope(gguf, f"{ROPE_FREQS_TENSOR} in a Gemma 3 file")
    # llama.cpp scales the global layers' positions only (the 4B-27B models: linear, factor 8)
    fields["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        "full_attention": {
            "rope_type": "default",
            "rope_theta": _rope_theta(gguf, GEMMA3_GLOBAL_ROPE_THETA),
            **_rope_scaling(gguf),
        },
    }
    fields["layer_types"] = [
        "full_attention" if (index + 1) % GEMMA3_SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
        for index in range(fields["num_hidden_layers"])
    ]
    return GGUFModelConfig(**fields)


def _gemma2_config(gguf: GGUFFile) -> GGUFModelConfig:
    fields = {
        **_pretrained_config_defaults(),
        "model_type": "gemma2",
        "vocab_size": 256_000,
        "hidden_activation": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "use_bidirectional_attention": None,
        **_common(gguf),
    }
    head_dim = int(gguf.arch_get("attention.key_length", fields["hidden_size"] // fields["num_attention_heads"]))
    fields["head_dim"] = head_dim
    # llama.cpp scales queries by 1/sqrt(head_dim) but for the 27B (46 layers): hidden_size / num_heads,
    # as the Hugging Face configs state
    fields["query_pre_attn_scalar"] = (
        fields["hidden_size"] // fields["num_attention_heads"] if fields["num_hidden_layers"] == 46 else head_dim
    )
    for key in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        gguf_key = "attention.sliding_window" if key == "sliding_window" else key
        value = gguf.arch_get(gguf_key)
        if value is not None:
            fields[key] = int(value) if key == "sliding_window" else float(value)
    fields["rope_parameters"] = _rope_parameters(gguf, DEFAULT_ROPE_THETA, head_dim)
    # llama.cpp's Gemma 2 pattern, and transformers': even layers slide, odd ones attend globally
    fields["layer_types"] = [
        "sliding_attention" if index % 2 == 0 else "full_attention" for index in range(fields["num_hidden_layers"])
    ]
    return GGUFModelConfig(**fields)


def _olmo2_config(gguf: GGUFFile) -> GGUFModelConfig:
    if gguf.arch_get("attention.sliding_window"):
        # llama.cpp's olmo2 also holds OLMo 3, whose sliding-window layers Olmo2ForCausalLM lacks
        raise ModelLoadError(
            f"GGUF file {gguf.path} is an OLMo 3 model (olmo2 architecture with a sliding window), "
            "which tokenloom does not serve yet; OLMo 2 files load"
        )
    fields = {
        **_pretrained_config_defaults(),
        "model_type": "olmo2",
        "vocab_size": 50304,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "pad_token_id": 1,
        "bos_token_id": None,
        "eos_token_id": 50279,
        "attention_bias": False,
        "attention_dropout": 0.0,
        **_common(gguf),
    }
    rotary_dim = fields["hidden_size"] // fields["num_attention_heads"]
    fields["rope_parameters"] = _rope_parameters(gguf, DEFAULT_ROPE_THETA, rotary_dim)
    return GGUFModelConfig(**fields)


def _granite_config(gguf: GGUFFile) -> GGUFModelConfig:
    fields = _llama_config(gguf).to_dict()
    fields.pop("pretraining_tp")
    head_dim = fields.pop("head_dim")
    if head_dim != fields["hidden_size"] // fields["num_attention_heads"]:
        raise ModelLoadError(
            f"GGUF file {gguf.path} rotates {head_dim} of each head's "
            f"{fields['hidden_size'] // fields['num_attention_heads']} features (rope.dimension_count), "
            "which Granite cannot state; tokenloom serves Granite files that rotate whole heads"
        )
    logits_scaling = gguf.arch_get("logit_scale")
    if logits_scaling is None:  # llama.cpp refuses such a file too
        raise ModelLoadError(
            f"GGUF file {gguf.path} lacks the metadata key granite.logit_scale; the file is incomplete"
        )
    # llama.cpp reads an absent (or zero) multiplier as none, and an absent attention scale as 1/sqrt(head size)
    attention_scale = float(gguf.arch_get("attention.scale", 0.0))
    fields.update(
        model_type="granite",
        embedding_multiplier=float(gguf.arch_get("embedding_scale", 0.0)) or 1.0,
        residual_multiplier=float(gguf.arch_get("residual_scale", 0.0)) or 1.0,
        attention_multiplier=attention_scale or head_dim**-0.5,
        logits_scaling=float(logits_scaling),
    )
    return GGUFModelConfig(**fields)


# llama.cpp's Phi-3 LongRoPE factors (per rotary frequency), which the config carries
PHI3_ROPE_FACTOR_TENSORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}


def _phi3_config(gguf: GGUFFile) -> GGUFModelConfig:
    fields = {
        **_pretrained_config_defaults(),
        "model_type": "phi3",
        "vocab_size": 32064,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
        # llama.cpp disables Phi-3's sliding window (the converter's value is unreliable), as does
        # transformers' GGUF conversion
        "sliding_window": None,
        **_common(gguf),
    }
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    rotary_dim = int(gguf.arch_get("rope.dimension_count", head_dim))
    original = gguf.arch_get("rope.scaling.original_context_length")
    fields["original_max_position_embeddings"] = int(original) if original is not None else 4096
    rope: dict[str, Any] = {
        "rope_theta": _rope_theta(gguf, DEFAULT_ROPE_THETA),
        "partial_rotary_factor": rotary_dim / head_dim,
        "rope_type": "default",
    }
    present = [name for name in PHI3_ROPE_FACTOR_TENSORS.values() if name in gguf.tensors]
    if present:
        if len(present) != 2:
            raise ModelLoadError(f"GGUF file {gguf.path} holds {present[0]} without its long/short counterpart")
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = fields["original_max_position_embeddings"]
        for key, tensor_name in PHI3_ROPE_FACTOR_TENSORS.items():
            rope[key] = _float_tensor(gguf, tensor_name, rotary_dim // 2)
        attn_factor = gguf.arch_get("rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    fields["rope_parameters"] = rope
    return GGUFModelConfig(**fields)


def _float_tensor(gguf: GGUFFile, name: str, length: int) -> list[float]:
    info = gguf.tensors[name]
    dtype = _FLOAT_ARRAY_TYPES.get(info.ggml_type)
    if dtype is None or info.num_elements != length:
        raise ModelLoadError(
            f"GGUF file {gguf.path}: {name} must be {length} F32 or F16 values (one per rotary frequency); it "
            f"holds {info.num_elements} of ggml type {info.ggml_type}"
        )
    return [float(value) for value in gguf.tensor_data(info).view(dtype)]


# llama.cpp's architecture name -> the model architecture it is served as (the config's ``architectures``)
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

GGUF_CONFIG_BUILDERS: dict[str, Callable[[GGUFFile], GGUFModelConfig]] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "qwen3": _qwen3_config,
    "qwen3moe": _qwen3_moe_config,
    "qwen2moe": _qwen2_moe_config,
    "olmoe": _olmoe_config,
    "gemma2": _gemma2_config,
    "gemma3": _gemma3_config,
    "olmo2": _olmo2_config,
    "granite": _granite_config,
    "phi3": _phi3_config,
}

# the built-in models a GGUF file with experts maps onto
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM", "MixtralForCausalLM")
# llama.cpp's expert tensors: per-layer router, stacked expert projections
_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate_inp|gate_exps|up_exps|down_exps|gate_up_exps)\.weight$")


def _refuse_unserved_experts(gguf: GGUFFile, config: GGUFModelConfig) -> None:
    """A ModelLoadError naming expert tensors in a file whose architecture tokenloom builds dense:
    the model would only report its MLP weights as missing."""
    if any(_EXPERT_TENSOR.match(name) for name in gguf.tensors) and config.architectures[0] not in MOE_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {gguf.path} holds mixture-of-experts tensors in architecture {gguf.architecture!r}, whose "
            f"experts tokenloom does not serve; it serves the experts of {', '.join(MOE_ARCHITECTURES)} "
            "(llama.cpp's qwen3moe, qwen2moe and olmoe, and llama with expert_count for Mixtral)"
        )


def gguf_to_hf_config(gguf: GGUFFile) -> GGUFModelConfig:
    """The model config of the model in ``gguf``; ModelLoadError for other architectures."""
    builder = GGUF_CONFIG_BUILDERS.get(gguf.architecture)
    if builder is None:
        raise ModelLoadError(
            f"GGUF file {gguf.path} holds a model of architecture {gguf.architecture or '(none)'!r}, "
            f"which tokenloom cannot load from GGUF; supported architectures: {', '.join(sorted(GGUF_CONFIG_BUILDERS))}"
        )
    config = builder(gguf)
    # a builder names the architecture where the file's is ambiguous (llama with experts: Mixtral)
    if not config.architectures:
        config.architectures = [GGUF_ARCHITECTURES[gguf.architecture]]
    _refuse_unserved_experts(gguf, config)
    return config
