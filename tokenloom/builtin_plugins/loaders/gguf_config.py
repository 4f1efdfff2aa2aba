"""GGUF metadata -> a transformers config (LlamaConfig, Qwen2Config, Gemma3TextConfig).

Built from llama.cpp's metadata keys directly instead of ``AutoConfig.from_pretrained(...,
gguf_file=...)``, which parses the whole vocabulary and takes seconds; the result is checked
against transformers' own conversion in the tests.
"""

from __future__ import annotations

from typing import Any, Callable

from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile, SkippedStringArray
from tokenloom.errors import ModelLoadError


def _common(gguf: GGUFFile) -> dict[str, Any]:
    """Keys every supported architecture states the same way."""

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
    kwargs: dict[str, Any] = {
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
        kwargs["vocab_size"] = int(vocab_size)
    rope_theta = gguf.arch_get("rope.freq_base")
    if rope_theta is not None:
        kwargs["rope_theta"] = float(rope_theta)
    for config_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                                 ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        token_id = gguf.get(f"tokenizer.ggml.{gguf_key}")
        if token_id is not None:
            kwargs[config_key] = int(token_id)
    return kwargs


def _llama_config(gguf: GGUFFile):
    from transformers import LlamaConfig

    kwargs = _common(gguf)
    head_dim = gguf.arch_get("rope.dimension_count")
    if head_dim is not None:
        kwargs["head_dim"] = int(head_dim)
    return LlamaConfig(architectures=["LlamaForCausalLM"], **kwargs)


def _qwen2_config(gguf: GGUFFile):
    from transformers import Qwen2Config

    return Qwen2Config(architectures=["Qwen2ForCausalLM"], **_common(gguf))


def _gemma3_config(gguf: GGUFFile):
    from transformers import Gemma3TextConfig

    kwargs = _common(gguf)
    head_dim = int(gguf.arch_get("attention.key_length", kwargs["hidden_size"] // kwargs["num_attention_heads"]))
    kwargs["head_dim"] = head_dim
    # llama.cpp scales queries by 1/sqrt(head_dim) for every Gemma 3 size but the 27B (62 layers),
    # which uses hidden_size / num_heads; the Hugging Face configs agree
    kwargs["query_pre_attn_scalar"] = (
        kwargs["hidden_size"] // kwargs["num_attention_heads"] if kwargs["num_hidden_layers"] == 62 else head_dim
    )
    sliding_window = gguf.arch_get("attention.sliding_window")
    if sliding_window is not None:
        kwargs["sliding_window"] = int(sliding_window)
    return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **kwargs)


GGUF_CONFIG_BUILDERS: dict[str, Callable[[GGUFFile], Any]] = {
    "llama": _llama_config,
    "qwen2": _qwen2_config,
    "gemma3": _gemma3_config,
}


def gguf_to_hf_config(gguf: GGUFFile):
    """The transformers config of the model in ``gguf``; ModelLoadError for other architectures."""
    builder = GGUF_CONFIG_BUILDERS.get(gguf.architecture)
    if builder is None:
        raise ModelLoadError(
            f"GGUF file {gguf.path} holds a model of architecture {gguf.architecture or '(none)'!r}, "
            f"which tokenloom cannot load from GGUF; supported architectures: {', '.join(sorted(GGUF_CONFIG_BUILDERS))}"
        )
    return builder(gguf)
