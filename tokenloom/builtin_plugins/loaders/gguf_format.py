"""The ``gguf`` load format: a llama.cpp ``.gguf`` file (or a directory holding exactly one).

Config and tokenizer come from the file's metadata; weights are yielded under their Hugging
Face names with llama.cpp's conversions undone (the Llama Q/K rotary row permutation, Gemma's
``1 + w`` norms). Quantized tensors stay packed as :class:`GGUFWeight` views of the
memory-mapped file; the ``gguf`` quantization method dequantizes them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

from tokenloom.builtin_plugins.loaders import hf_files
from tokenloom.builtin_plugins.loaders.gguf_config import GGUF_ARCHITECTURES
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile, GGUFTensorInfo, find_gguf_file
from tokenloom.errors import ConfigError
from tokenloom.plugin_api import LoadFormat, ModelLoadError

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_DECODER_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
# llama.cpp's mixture-of-experts tensors: the router, and each projection of every expert stacked
# (the names tokenloom's expert layers load, tokenloom.layers.fused_moe.expert_stacked_params)
_EXPERT_BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
}
# per architecture: GGUF block tensor -> Hugging Face sub-module of model.layers.N
BLOCK_NAMES: dict[str, dict[str, str]] = {
    # (Mixtral is llama with experts)
    "llama": {**_DECODER_BLOCK_NAMES, **_EXPERT_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"},
    "qwen2": {**_DECODER_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"},
    "qwen3": {
        **_DECODER_BLOCK_NAMES,
        "ffn_norm": "post_attention_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    "qwen3moe": {
        **_DECODER_BLOCK_NAMES,
        **_EXPERT_BLOCK_NAMES,
        "ffn_norm": "post_attention_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    "qwen2moe": {
        **_DECODER_BLOCK_NAMES,
        **_EXPERT_BLOCK_NAMES,
        "ffn_norm": "post_attention_layernorm",
        # the shared expert and its one-output sigmoid gate
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    },
    "olmoe": {
        **_DECODER_BLOCK_NAMES,
        **_EXPERT_BLOCK_NAMES,
        "ffn_norm": "post_attention_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    "gemma2": {
        **_DECODER_BLOCK_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "gemma3": {
        **_DECODER_BLOCK_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    "granite": {**_DECODER_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"},
    # fused projections as the Hugging Face checkpoint has them (Phi3ForCausalLM splits them)
    "phi3": {
        **{name: module for name, module in _DECODER_BLOCK_NAMES.items() if name not in ("ffn_gate", "ffn_up")},
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_norm": "post_attention_layernorm",
    },
    # no norm before attention or the MLP: attn_norm / ffn_norm have no place here
    "olmo2": {
        **{name: module for name, module in _DECODER_BLOCK_NAMES.items() if name != "attn_norm"},
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# tensors llama.cpp adds that have no Hugging Face parameter: the Llama 3 RoPE frequency
# factors and Phi-3's LongRoPE factors, which the config carries (gguf_config reads them as
# rope_parameters["freq_factors"], ["long_factor"] and ["short_factor"])
IGNORED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# architectures whose llama.cpp converter permuted the Q/K rows for its rotary layout
ROPE_PERMUTED_ARCHITECTURES = ("llama", "granite")
# architectures whose norms llama.cpp stores as ``1 + w`` (the HF modules compute ``x * (1 + w)``)
OFFSET_NORM_ARCHITECTURES = ("gemma2", "gemma3")

_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_name(architecture: str, gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None when it has none."""
    match = _BLOCK_TENSOR.match(gguf_name)
    if match:
        layer, tensor, suffix = match.groups()
        module = BLOCK_NAMES.get(architecture, {}).get(tensor)
        return f"model.layers.{layer}.{module}.{suffix}" if module else None
    match = _TOP_TENSOR.match(gguf_name)
    if match and match.group(1) in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[match.group(1)]}.{match.group(2)}"
    return None


def rope_unpermute_order(num_rows: int, num_heads: int):
    """Row order undoing llama.cpp's Q/K permutation: it interleaves each head's two rotary
    halves (row ``2i`` <- ``i``, ``2i+1`` <- ``half + i``); ``new[j] = old[order[j]]``."""
    import torch

    head_dim = num_rows // num_heads
    return torch.arange(num_rows).view(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def gguf_path(path: str) -> str:
    """The .gguf file at ``path``, or a ModelLoadError saying why there is none."""
    found = find_gguf_file(path)
    if found is not None:
        return found
    if not os.path.exists(path):
        raise ModelLoadError(f"GGUF model path {path} does not exist")
    if os.path.isdir(path):
        candidates = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if candidates:
            raise ModelLoadError(
                f"{path} holds several .gguf files ({', '.join(candidates)}); pass the path of the one to load"
            )
        raise ModelLoadError(f"{path} holds no .gguf file")
    raise ModelLoadError(f"{path} is not a GGUF file")


class GGUFLoadFormat(LoadFormat):
    """Reads ``.gguf`` files; see the module docstring."""

    # (llama.cpp writes Mixtral as llama with experts: gguf_config.py tells the two apart)
    architecture_names = {**GGUF_ARCHITECTURES, "llama with experts": "MixtralForCausalLM"}

    def can_load(self, path: str) -> bool:
        return find_gguf_file(path) is not None

    def load_config(self, path: str, model_config: Any) -> Any:
        from tokenloom.builtin_plugins.loaders.gguf_config import gguf_to_hf_config

        file_path = gguf_path(path)
        config = gguf_to_hf_config(GGUFFile(file_path))
        config._name_or_path = file_path
        mmproj = getattr(model_config, "mmproj", None)
        if mmproj:  # a vision projector beside the language model (gguf_mmproj.py)
            from tokenloom.builtin_plugins.loaders.gguf_mmproj import multimodal_config

            config = multimodal_config(config, file_path, mmproj)
        return hf_files.apply_hf_overrides(config, getattr(model_config, "hf_overrides", None))

    def load_tokenizer(self, path: str, model_config: Any) -> Any:
        from tokenloom.builtin_plugins.loaders.gguf_tokenizer import load_gguf_tokenizer

        tokenizer_path = getattr(model_config, "tokenizer", None)
        if tokenizer_path and find_gguf_file(tokenizer_path) is None:
            return hf_files.load_hf_tokenizer(path, model_config)
        if getattr(model_config, "tokenizer_mode", "auto") == "slow":
            # never a silent fast tokenizer for a user who asked for the slow one
            raise ConfigError(
                "--tokenizer-mode slow: a GGUF file's vocabulary builds a fast tokenizer only; use "
                "--tokenizer-mode auto, or pass --tokenizer with a Hugging Face tokenizer directory",
                param="tokenizer-mode",
            )
        return load_gguf_tokenizer(gguf_path(tokenizer_path or path))

    def quantization(self, path: str) -> str | None:
        from tokenloom.builtin_plugins.quantization.gguf_blocks import FLOAT_TYPES

        gguf = GGUFFile(gguf_path(path))
        return "gguf" if any(info.ggml_type not in FLOAT_TYPES for info in gguf.tensors.values()) else None

    def generation_defaults(self, path: str) -> dict[str, Any]:
        from tokenloom.builtin_plugins.loaders.generation_defaults import generation_defaults

        return generation_defaults(path)

    def iterate_weights(self, path: str, model_config: Any, load_config: Any) -> Iterator[tuple[str, Any]]:
        gguf = GGUFFile(gguf_path(path))
        architecture = gguf.architecture
        if architecture not in BLOCK_NAMES:
            raise ModelLoadError(
                f"GGUF file {gguf.path} holds architecture {architecture or '(none)'!r}, whose tensor names "
                f"tokenloom cannot map; supported architectures: {', '.join(sorted(BLOCK_NAMES))}"
            )
        num_heads = gguf.arch_get("attention.head_count")
        num_kv_heads = gguf.arch_get("attention.head_count_kv", num_heads)
        tensors = list(gguf.tensors.values())
        for info in hf_files.with_progress(
            tensors, load_config, total=len(tensors), description="loading GGUF tensors"
        ):
            hf_name = hf_tensor_name(architecture, info.name)
            if hf_name is None:
                # serving the model without the tensor would compute something else
                if info.name not in IGNORED_TENSORS:
                    raise ModelLoadError(
                        f"GGUF tensor {info.name} of {gguf.path} has no counterpart in tokenloom's "
                        f"{architecture} model: the file is of a variant tokenloom does not implement"
                    )
                continue
            weight = _tensor(gguf, info)
            if architecture in ROPE_PERMUTED_ARCHITECTURES and info.name.endswith((".attn_q.weight", ".attn_k.weight")):
                heads = num_heads if ".attn_q." in info.name else num_kv_heads
                weight = _permute_rows(weight, rope_unpermute_order(info.shape[0], int(heads)))
            elif architecture in OFFSET_NORM_ARCHITECTURES and info.name.endswith("norm.weight"):
                weight = _materialize_float32(weight) - 1.0
            yield hf_name, weight
        mmproj = getattr(model_config, "mmproj", None)
        if mmproj:
            from tokenloom.builtin_plugins.loaders.gguf_mmproj import mmproj_weights

            yield from mmproj_weights(mmproj)


def _tensor(gguf: GGUFFile, info: GGUFTensorInfo):
    """A float tensor as a torch view of the file, a quantized one as a packed GGUFWeight (whose
    ``release`` drops its pages once a layer has packed it)."""
    import functools

    import torch

    from tokenloom.builtin_plugins.quantization.gguf_blocks import FLOAT_TYPES, GGUFWeight

    raw = torch.from_numpy(gguf.tensor_data(info))
    if info.ggml_type in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[info.ggml_type]).view(info.shape)
    rows = info.num_elements // info.shape[-1] if info.shape else 1
    return GGUFWeight(
        raw.view(rows, -1),
        info.ggml_type,
        info.shape,
        name=info.name,
        path=gguf.path,
        release=functools.partial(gguf.release_pages, info),
    )


def _permute_rows(weight, order):
    if hasattr(weight, "permute_rows"):
        return weight.permute_rows(order)
    return weight.index_select(0, order)


def _materialize_float32(weight):
    return weight.dequantize() if hasattr(weight, "dequantize") else weight.float()
