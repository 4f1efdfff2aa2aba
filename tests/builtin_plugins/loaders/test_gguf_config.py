"""GGUF metadata -> :class:`GGUFModelConfig`: transformers' defaults when a file leaves keys out,
the RoPE and override paths the model loader uses, and that no transformers import is needed."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter
from helpers.gguf_files import byte_level_vocab, finish, write_metadata_only_gguf

from tokenloom.builtin_plugins.loaders.gguf_config import GGUFModelConfig, gguf_to_hf_config
from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.core.config import ModelConfig
from tokenloom.core.model_loader import apply_rope_overrides, resolve_dtype

# what write_minimal_gguf states, under transformers' names
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def write_minimal_gguf(path: str, architecture: str) -> str:
    """Only the keys tokenloom requires: no vocabulary size, RoPE base, head size or special tokens."""
    writer = GGUFWriter(path, architecture)
    for key, value in {
        "embedding_length": 64,
        "feed_forward_length": 128,
        "block_count": 7,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "context_length": 256,
    }.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    finish(writer)
    return path


def transformers_config(architecture: str, **fields):
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "gemma3": transformers.Gemma3TextConfig,
    }
    return classes[architecture](**fields)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gemma3"])
def test_keys_a_file_leaves_out_take_transformers_defaults(architecture, tmp_path):
    ours = gguf_to_hf_config(GGUFFile(write_minimal_gguf(str(tmp_path / "m.gguf"), architecture)))
    fields = dict(SHAPE, rms_norm_eps=float(np.float32(1e-6)), tie_word_embeddings=True)
    if architecture == "gemma3":
        fields.update(head_dim=16, query_pre_attn_scalar=16)  # hidden_size / heads, as llama.cpp computes
    reference = transformers_config(architecture, **fields).to_dict()
    ours_dict = ours.to_dict()
    for key in ("architectures", "transformers_version"):
        ours_dict.pop(key, None), reference.pop(key, None)
    assert ours_dict == reference


def test_the_vocabulary_size_falls_back_to_the_token_count(tmp_path):
    vocab = byte_level_vocab()
    path = write_metadata_only_gguf(str(tmp_path / "m.gguf"), "llama", tokenizer=vocab)
    assert gguf_to_hf_config(GGUFFile(path)).vocab_size == len(vocab["tokens"])


def test_the_config_is_plain_picklable_data_with_transformers_spellings(tmp_path):
    config = GGUFLoadFormat().load_config(write_minimal_gguf(str(tmp_path / "m.gguf"), "llama"), ModelConfig())
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.get_text_config() is config and not hasattr(config, "text_config")
    assert config.name_or_path == str(tmp_path / "m.gguf") and config.num_labels == 2
    assert config.rope_scaling is config.rope_parameters
    assert "head_dim=16" in repr(config)
    copied = config.to_dict()
    copied["rope_parameters"]["rope_theta"] = 1.0
    assert config.rope_parameters["rope_theta"] == 10000.0  # to_dict hands out a copy


def test_rope_flags_and_hf_overrides_reach_the_config(tmp_path):
    path = write_minimal_gguf(str(tmp_path / "m.gguf"), "llama")
    config = GGUFLoadFormat().load_config(path, ModelConfig(hf_overrides={"rms_norm_eps": 0.5}))
    apply_rope_overrides(config, ModelConfig(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5))
    assert config.rms_norm_eps == 0.5
    assert config.rope_parameters == {"rope_theta": 5e5, "rope_type": "linear", "type": "linear", "factor": 2.0}
    assert config.rope_scaling == config.rope_parameters


def test_dtype_is_read_without_touching_the_deprecated_torch_dtype():
    import torch

    class Config:
        dtype = "bfloat16"

        @property
        def torch_dtype(self):
            raise AssertionError("torch_dtype read")

    class Platform:
        @staticmethod
        def default_dtype(stored):
            return stored

    assert resolve_dtype("auto", Config(), Platform()) == torch.bfloat16
    assert resolve_dtype("auto", GGUFModelConfig(dtype=None), Platform()) == torch.float32


def test_reading_a_gguf_config_does_not_import_transformers(tmp_path):
    # transformers' config classes take seconds to import: the server's start-up must not pay for them
    path = write_minimal_gguf(str(tmp_path / "m.gguf"), "llama")
    code = (
        "import sys; from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat; "
        "from tokenloom.core.config import ModelConfig; "
        f"config = GGUFLoadFormat().load_config({path!r}, ModelConfig()); "
        "assert config.hidden_size == 64; "
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'transformers'))"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
