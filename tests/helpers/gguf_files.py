"""Tiny GGUF files for loader tests, written with ``gguf.GGUFWriter`` the way llama.cpp's
converter writes them: a transformers model's weights under GGUF names, with llama.cpp's
conversions applied (Llama Q/K rotary permutation, Gemma ``1 + w`` norms, RoPE scaling as
``rope.scaling.*`` keys and Llama 3's ``rope_freqs.weight``), optionally quantized with
``gguf.quants.quantize``; and small byte-level / sentencepiece vocabularies.
"""

from __future__ import annotations

import math
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
    "qwen3": {
        **HF_TO_GGUF_BLOCK,
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    },
    "gemma2": {
        **HF_TO_GGUF_BLOCK,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "granite": {**HF_TO_GGUF_BLOCK, "post_attention_layernorm": "ffn_norm"},
    "phi3": {
        **HF_TO_GGUF_BLOCK,
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
        "post_attention_layernorm": "ffn_norm",
    },
    "olmo2": {
        **HF_TO_GGUF_BLOCK,
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "gemma3": {
        **HF_TO_GGUF_BLOCK,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    },
}
HF_TO_GGUF_BLOCK_BY_ARCH["qwen3moe"] = {**HF_TO_GGUF_BLOCK_BY_ARCH["qwen3"], "mlp.gate": "ffn_gate_inp"}
HF_TO_GGUF_BLOCK_BY_ARCH["llama"]["mlp.gate"] = "ffn_gate_inp"  # Mixtral's router
HF_TO_GGUF_BLOCK_BY_ARCH["olmoe"] = {**HF_TO_GGUF_BLOCK_BY_ARCH["qwen3moe"]}
HF_TO_GGUF_BLOCK_BY_ARCH["qwen2moe"] = {
    **HF_TO_GGUF_BLOCK_BY_ARCH["qwen2"],
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (HF halves -> interleaved pairs)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def rope_parameters_of(hf_config: Any) -> dict:
    """The RoPE settings the converter reads: the global layers' when they are nested."""
    parameters = dict(hf_config.rope_parameters)
    return dict(parameters.get("full_attention", parameters))


def llama3_rope_factors(hf_config: Any) -> np.ndarray:
    """What llama.cpp's converter (``LlamaModel.generate_extra_tensors``) writes as
    ``rope_freqs.weight`` for ``rope_type: llama3``: one divisor per rotary frequency."""
    rope = rope_parameters_of(hf_config)
    base = rope.get("rope_theta", 10000.0)
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def add_rope_scaling(writer: GGUFWriter, architecture: str, hf_config: Any) -> None:
    """The converter's ``rope.scaling.*`` keys (``TextModel.set_gguf_parameters``)."""
    rope = rope_parameters_of(hf_config)
    rope_type, factor = rope.get("rope_type"), rope.get("factor")
    if rope_type == "linear" and factor is not None:
        writer.add_string(f"{architecture}.rope.scaling.type", "linear")
        writer.add_float32(f"{architecture}.rope.scaling.factor", factor)
    elif rope_type == "yarn" and factor is not None:
        writer.add_string(f"{architecture}.rope.scaling.type", "yarn")
        writer.add_float32(f"{architecture}.rope.scaling.factor", factor)
        writer.add_uint32(
            f"{architecture}.rope.scaling.original_context_length", rope["original_max_position_embeddings"]
        )
        for hf_key, gguf_key in (
            ("attention_factor", "yarn_attn_factor"),
            ("beta_fast", "yarn_beta_fast"),
            ("beta_slow", "yarn_beta_slow"),
        ):
            if rope.get(hf_key) is not None:
                writer.add_float32(f"{architecture}.rope.scaling.{gguf_key}", rope[hf_key])


def gguf_name(architecture: str, hf_name: str) -> str:
    match = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf_name)
    if match:
        layer, module, suffix = match.groups()
        return f"blk.{layer}.{HF_TO_GGUF_BLOCK_BY_ARCH[architecture][module]}.{suffix}"
    module, suffix = hf_name.rsplit(".", 1)
    return f"{HF_TO_GGUF_TOP[module]}.{suffix}"


def num_experts_of(hf_config: Any) -> int:
    """A mixture-of-experts config's experts per layer (0: dense)."""
    return getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0


def expert_stacks(state_dict: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The experts of a transformers (>= 5) MoE model's state dict as llama.cpp stacks them:
    ``blk.N.ffn_{gate,up,down}_exps.weight`` of shape [experts, out, in]."""
    stacks = {}
    for name, tensor in state_dict.items():
        match = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if not match:
            continue
        layer, kind = match.groups()
        data = tensor.detach().float().numpy()
        if kind == "down_proj":
            stacks[f"blk.{layer}.ffn_down_exps.weight"] = data.copy()
        else:
            half = data.shape[1] // 2
            stacks[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, :half].copy()
            stacks[f"blk.{layer}.ffn_up_exps.weight"] = data[:, half:].copy()
    return stacks


def write_model_gguf(
    path: str,
    architecture: str,
    hf_config: Any,
    state_dict: dict[str, torch.Tensor],
    *,
    quant_type: GGMLQuantizationType | None = None,
    expert_quant_type: GGMLQuantizationType | None = None,
    quant_type_of: dict[str, GGMLQuantizationType] | None = None,
    tokenizer: dict | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> str:
    """Write ``state_dict`` (a transformers model's) as a llama.cpp-style GGUF of ``architecture``.

    2-D weights whose rows fit ``quant_type`` blocks are quantized; norms and biases stay F32.
    ``quant_type_of`` maps GGUF tensor-name endings (``"attn_v.weight"``) to the type those
    take instead (as llama.cpp's mixes, Q4_K_M, give some tensors more bits).
    A mixture of experts' stacked expert weights are quantized to ``expert_quant_type`` (its
    router stays F32, as llama.cpp's converter keeps it), and its expert keys are written.
    ``extra_tensors`` (GGUF name -> array) are written as they are.
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
    if architecture != "gemma2":  # the Gemma 2 converter writes no RoPE base: llama.cpp's 10000 applies
        writer.add_float32(
            f"{prefix}.rope.freq_base",
            hf_config.rope_parameters.get("rope_theta")
            if "rope_theta" in hf_config.rope_parameters
            else hf_config.rope_parameters["full_attention"]["rope_theta"],
        )
    writer.add_uint32(f"{prefix}.vocab_size", hf_config.vocab_size)
    add_rope_scaling(writer, architecture, hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if architecture in ("llama", "granite"):
        writer.add_uint32(f"{prefix}.rope.dimension_count", head_dim)
    if architecture == "granite":  # the converter's names for Granite's multipliers
        writer.add_float32(f"{prefix}.attention.scale", hf_config.attention_multiplier)
        writer.add_float32(f"{prefix}.embedding_scale", hf_config.embedding_multiplier)
        writer.add_float32(f"{prefix}.residual_scale", hf_config.residual_multiplier)
        writer.add_float32(f"{prefix}.logit_scale", hf_config.logits_scaling)
    num_experts = num_experts_of(hf_config)
    if num_experts:  # what the converter writes for Mixtral (llama), Qwen3-MoE, Qwen2-MoE and OLMoE
        writer.add_uint32(f"{prefix}.expert_count", num_experts)
        writer.add_uint32(f"{prefix}.expert_used_count", hf_config.num_experts_per_tok)
        if architecture in ("qwen3moe", "qwen2moe"):
            writer.add_uint32(f"{prefix}.expert_feed_forward_length", hf_config.moe_intermediate_size)
        if architecture == "qwen2moe":
            writer.add_uint32(f"{prefix}.expert_shared_feed_forward_length", hf_config.shared_expert_intermediate_size)
    if architecture in ("qwen3", "qwen3moe"):
        writer.add_uint32(f"{prefix}.attention.key_length", head_dim)
        writer.add_uint32(f"{prefix}.attention.value_length", head_dim)
    if architecture == "phi3":  # Phi3MiniModel.set_gguf_parameters and generate_extra_tensors
        rope = rope_parameters_of(hf_config)
        rotary_dim = int(rope.get("partial_rotary_factor", 1.0) * head_dim)
        original = getattr(hf_config, "original_max_position_embeddings", hf_config.max_position_embeddings)
        writer.add_uint32(f"{prefix}.rope.dimension_count", rotary_dim)
        writer.add_uint32(f"{prefix}.rope.scaling.original_context_length", original)
        writer.add_uint32(f"{prefix}.attention.sliding_window", getattr(hf_config, "sliding_window", None) or 0)
        if rope.get("long_factor"):
            scale = hf_config.max_position_embeddings / original
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
            writer.add_float32(f"{prefix}.rope.scaling.attn_factor", attn_factor)
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if architecture == "gemma2":
        writer.add_uint32(f"{prefix}.attention.key_length", head_dim)
        writer.add_uint32(f"{prefix}.attention.value_length", head_dim)
        writer.add_float32(f"{prefix}.attn_logit_softcapping", hf_config.attn_logit_softcapping)
        writer.add_float32(f"{prefix}.final_logit_softcapping", hf_config.final_logit_softcapping)
        writer.add_uint32(f"{prefix}.attention.sliding_window", hf_config.sliding_window)
    if architecture == "gemma3":
        writer.add_uint32(f"{prefix}.attention.key_length", head_dim)
        writer.add_uint32(f"{prefix}.attention.value_length", head_dim)
        writer.add_uint32(f"{prefix}.attention.sliding_window", hf_config.sliding_window)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if architecture == "phi3":  # its config's default (32000) lies outside a tiny vocabulary
        writer.add_uint32("tokenizer.ggml.padding_token_id", hf_config.pad_token_id)
    if tokenizer:
        add_tokenizer(writer, tokenizer)
    if architecture == "llama" and rope_parameters_of(hf_config).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(hf_config))
    for name, data in expert_stacks(state_dict).items():
        if expert_quant_type is not None:
            writer.add_tensor(name, quantize(data, expert_quant_type), raw_dtype=expert_quant_type)
        else:
            writer.add_tensor(name, data.astype(np.float32))
    for hf_name, tensor in state_dict.items():
        if ".mlp.experts." in hf_name:
            continue  # written stacked, above
        if hf_name == "lm_head.weight" and (hf_config.tie_word_embeddings or architecture == "gemma2"):
            continue  # the Gemma 2 converter drops lm_head: llama.cpp reads the embedding as output
        data = tensor.detach().float().numpy().copy()
        if architecture in ("llama", "granite") and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in hf_name else hf_config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if architecture in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            data = data + 1.0
        name = gguf_name(architecture, hf_name)
        if quant_type is not None and data.ndim == 2 and data.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name:
            tensor_type = next(
                (special for ending, special in (quant_type_of or {}).items() if name.endswith(ending)), quant_type
            )
            writer.add_tensor(name, quantize(data, tensor_type), raw_dtype=tensor_type)
        else:
            writer.add_tensor(name, data.astype(np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
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
    if architecture == "qwen3":
        # transformers' GGUF conversion ignores attention.key_length: keep head_dim = hidden / heads here
        return transformers.Qwen3Config(rope_theta=10000.0, head_dim=16, **common)
    if architecture == "phi3":
        return transformers.Phi3Config(rope_theta=10000.0, pad_token_id=0, **common)
    if architecture == "gemma2":
        return transformers.Gemma2Config(
            head_dim=32, sliding_window=64, query_pre_attn_scalar=32, **{**common, "tie_word_embeddings": True}
        )
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
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
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


def write_mixtral_gguf(path: str, num_experts: int = 4, experts_per_token: int = 2) -> str:
    """A tiny Mixtral as llama.cpp's converter writes one: llama architecture, ``expert_count``,
    and per layer a router (``ffn_gate_inp``) and stacked experts (``ffn_{gate,up,down}_exps``)
    in place of the dense MLP."""
    config, state_dict = tiny_model_state_dict("llama")
    dense = {name: tensor for name, tensor in state_dict.items() if ".mlp." not in name}
    writer = GGUFWriter(path, "llama")
    for key, value in {
        "block_count": config.num_hidden_layers,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "rope.dimension_count": config.hidden_size // config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "expert_count": num_experts,
        "expert_used_count": experts_per_token,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32("llama.rope.freq_base", 1e6)
    for hf_name, tensor in dense.items():
        writer.add_tensor(gguf_name("llama", hf_name), tensor.float().numpy().copy())
    hidden, intermediate = config.hidden_size, config.intermediate_size
    for layer in range(config.num_hidden_layers):
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", np.zeros((num_experts, hidden), np.float32))
        for name, shape in (
            ("gate", (intermediate, hidden)),
            ("up", (intermediate, hidden)),
            ("down", (hidden, intermediate)),
        ):
            writer.add_tensor(f"blk.{layer}.ffn_{name}_exps.weight", np.zeros((num_experts, *shape), np.float32))
    finish(writer)
    return path
