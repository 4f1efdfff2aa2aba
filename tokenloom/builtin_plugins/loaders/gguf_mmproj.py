"""A GGUF language model with llama.cpp's separate multimodal projector file (``--mmproj
FILE``, as ``llama-server --mmproj``; llama.cpp's ``convert_hf_to_gguf.py --mmproj`` writes
it): the ``clip`` file's vision tower and projector turned into the multimodal model's config
(:func:`multimodal_config`) and weights under their Hugging Face names (:func:`mmproj_weights`).

One projector type is served: ``idefics3`` (SmolVLM), as ``Idefics3ForConditionalGeneration``.
The image processor's settings (the resized longest edge, the tile size, mean and std) come from
the file's metadata, since a GGUF model has no preprocessor configuration beside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from tokenloom.builtin_plugins.loaders.gguf_config import GGUFModelConfig
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.errors import ConfigError, ModelLoadError

# clip.projector_type -> the architecture that serves it
PROJECTOR_ARCHITECTURES = {"idefics3": "Idefics3ForConditionalGeneration"}
IMAGE_TOKEN = "<image>"

_VISION_PREFIX = "model.vision_model."
_TOP_LEVEL_NAMES = {
    "v.patch_embd": _VISION_PREFIX + "embeddings.patch_embedding",
    "v.position_embd": _VISION_PREFIX + "embeddings.position_embedding",
    "v.post_ln": _VISION_PREFIX + "post_layernorm",
    "mm.model.fc": "model.connector.modality_projection.proj",
}
_BLOCK_NAMES = {
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_BLOCK_TENSOR = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_TENSOR = re.compile(r"^(.+)\.(weight|bias)$")


def open_mmproj(path: str) -> GGUFFile:
    """The projector file at ``path``; ConfigError naming ``--mmproj`` when it is not one tokenloom serves."""
    import os

    from tokenloom.builtin_plugins.loaders.gguf_reader import find_gguf_file

    if not os.path.isfile(path):
        raise ConfigError(f"--mmproj {path}: no such file", param="mmproj")
    if find_gguf_file(path) != path:
        raise ConfigError(f"--mmproj {path}: not a GGUF file", param="mmproj")
    mmproj = GGUFFile(path)
    if mmproj.architecture != "clip" or not mmproj.get("clip.has_vision_encoder"):
        raise ConfigError(
            f"--mmproj {path}: holds architecture {mmproj.architecture!r}, not llama.cpp's clip vision projector "
            "(convert_hf_to_gguf.py --mmproj writes one)",
            param="mmproj",
        )
    projector = mmproj.get("clip.projector_type")
    if projector not in PROJECTOR_ARCHITECTURES:
        raise ConfigError(
            f"--mmproj {path}: projector type {projector!r} is not served; tokenloom serves "
            f"{', '.join(sorted(PROJECTOR_ARCHITECTURES))}",
            param="mmproj",
        )
    return mmproj


def multimodal_config(text_config: GGUFModelConfig, text_path: str, mmproj_path: str) -> GGUFModelConfig:
    """The config of the language model in ``text_path`` (``text_config``) with the vision
    tower and projector of the file at ``mmproj_path`` beside it."""
    mmproj = open_mmproj(mmproj_path)
    if text_config.architectures != ["LlamaForCausalLM"]:
        raise ConfigError(
            f"--mmproj: an idefics3 projector goes with a llama language model, not {text_config.architectures[0]}",
            param="mmproj",
        )
    tokens = GGUFFile(text_path, string_arrays=("tokenizer.ggml.tokens",)).get("tokenizer.ggml.tokens") or []
    if IMAGE_TOKEN not in tokens:
        raise ModelLoadError(f"GGUF file {text_path} has no {IMAGE_TOKEN} token for the images of --mmproj")

    def vision(key: str) -> Any:
        value = mmproj.get(f"clip.vision.{key}")
        if value is None:
            raise ModelLoadError(f"--mmproj file {mmproj.path} lacks clip.vision.{key}")
        return value

    image_size = int(vision("image_size"))
    vision_config = GGUFModelConfig(
        hidden_size=int(vision("embedding_length")),
        intermediate_size=int(vision("feed_forward_length")),
        num_hidden_layers=int(vision("block_count")),
        num_attention_heads=int(vision("attention.head_count")),
        image_size=image_size,
        patch_size=int(vision("patch_size")),
        layer_norm_eps=float(vision("attention.layer_norm_epsilon")),
        hidden_act="gelu_pytorch_tanh" if mmproj.get("clip.use_gelu", True) else "quick_gelu",
        num_channels=3,
    )
    return GGUFModelConfig(
        _name_or_path=text_path,
        dtype=text_config.dtype,
        architectures=[PROJECTOR_ARCHITECTURES[mmproj.get("clip.projector_type")]],
        text_config=text_config,
        vision_config=vision_config,
        scale_factor=int(mmproj.get("clip.vision.projector.scale_factor", 2)),
        image_token_id=tokens.index(IMAGE_TOKEN),
        tie_word_embeddings=text_config.tie_word_embeddings,
        # Idefics3ImageProcessor's options, as the converter took them from preprocessor_config.json
        image_processor_config={
            "size": {"longest_edge": int(mmproj.get("clip.vision.preproc_image_size", image_size))},
            "max_image_size": {"longest_edge": image_size},
            "image_mean": [float(value) for value in vision("image_mean")],
            "image_std": [float(value) for value in vision("image_std")],
        },
        mmproj=mmproj_path,
    )


def hf_vision_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a projector file's tensor, or None when it has none."""
    match = _BLOCK_TENSOR.match(gguf_name)
    if match:
        layer, tensor, suffix = match.groups()
        module = _BLOCK_NAMES.get(tensor)
        return f"{_VISION_PREFIX}encoder.layers.{layer}.{module}.{suffix}" if module else None
    match = _TOP_TENSOR.match(gguf_name)
    if match and match.group(1) in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[match.group(1)]}.{match.group(2)}"
    return None


def mmproj_weights(path: str) -> Iterator[tuple[str, Any]]:
    """The projector file's tensors under their Hugging Face names, as float tensors (the
    vision tower's layers are not quantized)."""
    from tokenloom.builtin_plugins.loaders.gguf_format import _materialize_float32, _tensor

    mmproj = open_mmproj(path)
    for info in mmproj.tensors.values():
        hf_name = hf_vision_name(info.name)
        if hf_name is None:
            raise ModelLoadError(
                f"--mmproj tensor {info.name} of {mmproj.path} has no counterpart in tokenloom's "
                f"{mmproj.get('clip.projector_type')} vision model"
            )
        yield hf_name, _materialize_float32(_tensor(mmproj, info))
