"""Tiny GGUF files for loader tests, written with ``gguf.GGUFWriter`` the way llama.cpp's
converter writes them: a transformers model's weights under GGUF names, with llama.cpp's
conversions applied (Llama Q/K rotary permutation, Gemma ``1 + w`` norms), optionally quantized
with ``gguf.quants.quantize``; and small byte-level / sentencepiece vocabularies.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

HF_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
HF_TO_GGUF_BLOCK_BY_ARCH = {
    "llama": {**HF_TO_GGUF_BLOCK, "post_attention_layernorm": "ffn_norm"},
    "qwen2": {**HF_TO_GGUF_BLOCK, "post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        **HF_TO_GGUF_BLOCK,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    },
}
HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (HF halves -> interleaved pairs)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(architecture: str, hf_name: str) -> str:
    match = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf_name)
    if match:
        layer, module, suffix = match.groups()
        return f"blk.{layer}.{HF_TO_GGUF_BLOCK_BY_ARCH[architecture][module]}.{suffix}"
    module, suffix = hf_name.rsplit(".", 1)
    return f"{HF_TO_GGUF_TOP[module]}.{suffix}"


def write_model_gguf(
    path: str,
    architecture: str,
    hf_config: Any,
    state_dict: dict[str, torch.Tensor],
    *,
    quant_type: GGMLQuantizationType | None = None,
    tokenizer: dict | None = None,
) -> str:
    """Write ``state_dict`` (a transformers model's) as a llama.cpp-style GGUF of ``architecture``.

    2-D weights whose rows fit ``quant_type`` blocks are quantized; norms and biases stay F32.
    """
    writer = GGUFWriter(path, architecture)
    prefix = architecture
    writer.add_uint32(f"{prefix}.block_count", hf_config.num_hidden_layers)
    writer.add_uint32(f"{prefix}.context_length", hf_config.max_position_embeddings)
    writer.add_uint32(f"{prefix}.embedding_length", hf_config.hidden_size)
    writer.add_uint32(f"{prefix}.feed_forward_length", hf_config.intermediate_size)
    writer.add_uint32(f"{prefix}.attention.head_count", hf_config.num_attention_heads)
    writer.add_uint32(f"{prefix}.attention.head_count_kv", hf_config.num_key_value_heads)
    writer.add_float32(f"{prefix}.attention.layer_norm_rms_epsilon", hf_config.rms_norm_eps)
    writer.add_float32(
        f"{prefix}.rope.freq_base",
        hf_config.rope_parameters.get("rope_theta")
        if "rope_theta" in hf_config.rope_parameters
        else hf_config.rope_parameters["full_attention"]["rope_theta"],
    )
    writer.add_uint32(f"{prefix}.vocab_size", hf_config.vocab_size)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if architecture == "llama":
        writer.add_uint32(f"{prefix}.rope.dimension_count", head_dim)
    if architecture == "gemma3":
        writer.add_uint32(f"{prefix}.attention.key_length", head_dim)
        writer.add_uint32(f"{prefix}.attention.value_length", head_dim)
        writer.add_uint32(f"{prefix}.attention.sliding_window", hf_config.sliding_window)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if tokenizer:
        add_tokenizer(writer, tokenizer)
    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and hf_config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy().copy()
        if architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in hf_name else hf_config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if architecture == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0
        name = gguf_name(architecture, hf_name)
        if quant_type is not None and data.ndim == 2 and data.shape[-1] % 32 == 0:
            writer.add_tensor(name, quantize(data, quant_type), raw_dtype=quant_type)
        else:
            writer.add_tensor(name, data.astype(np.float32))
    finish(writer)
    return path


def add_tokenizer(writer: GGUFWriter, tokenizer: dict) -> None:
    writer.add_string("tokenizer.ggml.model", tokenizer["model"])
    if "pre" in tokenizer:
        writer.add_string("tokenizer.ggml.pre", tokenizer["pre"])
    writer.add_array("tokenizer.ggml.tokens", tokenizer["tokens"])
    writer.add_array("tokenizer.ggml.token_type", tokenizer["token_type"])
    if "scores" in tokenizer:
        writer.add_array("tokenizer.ggml.scores", tokenizer["scores"])
    if "merges" in tokenizer:
        writer.add_array("tokenizer.ggml.merges", tokenizer["merges"])
    for key in ("unknown_token_id", "padding_token_id"):
        if key in tokenizer:
            writer.add_uint32(f"tokenizer.ggml.{key}", tokenizer[key])
    if "add_bos_token" in tokenizer:
        writer.add_bool("tokenizer.ggml.add_bos_token", tokenizer["add_bos_token"])
    if "chat_template" in tokenizer:
        writer.add_string("tokenizer.chat_template", tokenizer["chat_template"])


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def byte_level_vocab() -> dict:
    """A gpt2-style vocabulary: 3 control tokens, the 256 byte symbols, a few merges, and a
    user-defined ``<think>``; bos 1, eos 2."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbols = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ Ġ", "1 2", "ä ¸"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_symbols + merged + ["<think>"]
    token_type = [3, 3, 3] + [1] * (len(byte_symbols) + len(merged)) + [4]
    return {
        "model": "gpt2",
        "pre": "default",
        "tokens": tokens,
        "token_type": token_type,
        "merges": merges,
        "unknown_token_id": 0,
        "padding_token_id": 2,
        "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }


def sentencepiece_vocab() -> dict:
    """A llama-style sentencepiece BPE vocabulary with byte fallback and scores, no merges."""
    tokens = ["<pad>", "<s>", "</s>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    token_type = [3, 3, 3, 2] + [6] * 256
    pieces = [
        "▁",
        "a",
        "b",
        "c",
        "d",
        "e",
        "h",
        "l",
        "o",
        "r",
        "w",
        "▁a",
        "ab",
        "▁ab",
        "he",
        "ll",
        "hell",
        "hello",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "  ",
        "▁▁",
        "▁d",
        "cd",
    ]
    tokens += pieces + ["<start_of_turn>", "<end_of_turn>"]
    token_type += [1] * len(pieces) + [3, 3]
    scores = [-1000.0] * 260 + [-float(i) for i in range(len(pieces))] + [-1000.0, -1000.0]
    return {
        "model": "llama",
        "tokens": tokens,
        "token_type": token_type,
        "scores": scores,
        "unknown_token_id": 3,
        "padding_token_id": 0,
        "add_bos_token": True,
    }


def write_metadata_only_gguf(
    path: str,
    architecture: str,
    *,
    tokenizer: dict | None = None,
    extra: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> str:
    """A GGUF with a llama-like shape in the metadata, a tokenizer, and small F32 tensors."""
    writer = GGUFWriter(path, architecture)
    for key, value in {
        "block_count": 1,
        "context_length": 128,
        "embedding_length": 32,
        "feed_forward_length": 64,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
    }.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{architecture}.rope.freq_base", 10000.0)
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    if tokenizer:
        add_tokenizer(writer, tokenizer)
    for name, array in (tensors or {"token_embd.weight": np.zeros((8, 32), np.float32)}).items():
        writer.add_tensor(name, array)
    finish(writer)
    return path


def tiny_config(architecture: str):
    """A small transformers config of ``architecture`` (rows are multiples of 32 for quantization)."""
    import transformers

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if architecture == "llama":
        return transformers.LlamaConfig(rope_theta=10000.0, **common)
    if architecture == "qwen2":
        return transformers.Qwen2Config(rope_theta=10000.0, **common)
    if architecture == "gemma3":
        return transformers.Gemma3TextConfig(
            rope_theta=1000000.0,
            head_dim=32,
            sliding_window=64,
            query_pre_attn_scalar=32,
            **{**common, "tie_word_embeddings": True},
        )
    raise ValueError(architecture)


def tiny_model_state_dict(architecture: str, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny transformers model of ``architecture`` with random weights, and its state dict
    (norm weights randomised too, so offsets and permutations show)."""
    import transformers

    config = tiny_config(architecture)
    classes = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
    }
    torch.manual_seed(seed)
    model = classes[architecture](config)
    state_dict = {}
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in model.state_dict().items():
        state_dict[name] = torch.randn(tensor.shape, generator=generator) * 0.1
    return config, state_dict


def gguf_dir(tmp_path, name: str = "model.gguf") -> str:
    return os.path.join(str(tmp_path), name)
