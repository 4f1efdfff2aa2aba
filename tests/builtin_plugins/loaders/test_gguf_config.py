"""GGUF metadata -> :class:`GGUFModelConfig`: transformers' defaults when a file leaves keys out,
the RoPE and override paths the model loader uses, and that no transformers import is needed."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter
from helpers.gguf_files import byte_level_vocab, finish, write_metadata_only_gguf

from tokenloom.builtin_plugins.loaders.gguf_config import (
    GGUF_ARCHITECTURES,
    GGUF_CONFIG_BUILDERS,
    GGUFModelConfig,
    gguf_to_hf_config,
)
from tokenloom.builtin_plugins.loaders.gguf_format import BLOCK_NAMES, GGUFLoadFormat
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.core.config import ModelConfig
from tokenloom.core.model_loader import apply_rope_overrides, resolve_dtype
from tokenloom.errors import ModelLoadError

# what write_minimal_gguf states, under transformers' names
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def write_minimal_gguf(path: str, architecture: str, **extra: int) -> str:
    """Only the keys tokenloom requires (and ``extra`` uint32 keys of the architecture): no
    vocabulary size, RoPE base, head size or special tokens."""
    writer = GGUFWriter(path, architecture)
    for key, value in {
        "embedding_length": 64,
        "feed_forward_length": 128,
        "block_count": 7,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "context_length": 256,
        **extra,
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
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "olmo2": transformers.Olmo2Config,
        "phi3": transformers.Phi3Config,
    }
    return classes[architecture](**fields)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "phi3"])
def test_keys_a_file_leaves_out_take_transformers_defaults(architecture, tmp_path):
    ours = gguf_to_hf_config(GGUFFile(write_minimal_gguf(str(tmp_path / "m.gguf"), architecture)))
    fields = dict(SHAPE, rms_norm_eps=float(np.float32(1e-6)), tie_word_embeddings=True)
    if architecture in ("gemma2", "gemma3"):
        fields.update(head_dim=16, query_pre_attn_scalar=16)  # hidden_size / heads, as llama.cpp computes
    if architecture == "qwen3":
        fields.update(head_dim=16)  # no attention.key_length: hidden_size / heads
    reference = transformers_config(architecture, **fields).to_dict()
    ours_dict = ours.to_dict()
    for key in ("architectures", "transformers_version"):
        ours_dict.pop(key, None), reference.pop(key, None)
    assert ours_dict == reference


def test_an_olmo3_file_is_refused_as_one(tmp_path):
    """llama.cpp writes OLMo 3 as olmo2 with a sliding window, which Olmo2ForCausalLM lacks."""
    path = write_metadata_only_gguf(str(tmp_path / "m.gguf"), "olmo2", extra={"olmo2.attention.sliding_window": 4096})
    with pytest.raises(ModelLoadError, match="OLMo 3"):
        gguf_to_hf_config(GGUFFile(path))


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


def test_llama3_rope_freqs_become_the_configs_freq_factors(tmp_path):
    factors = np.array([1.0, 1.5, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0], np.float32)
    path = write_metadata_only_gguf(
        str(tmp_path / "m.gguf"),
        "llama",
        extra={"llama.rope.dimension_count": 16},
        tensors={"token_embd.weight": np.zeros((8, 32), np.float32), "rope_freqs.weight": factors},
    )
    config = gguf_to_hf_config(GGUFFile(path))
    assert config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default", "freq_factors": factors.tolist()}
    assert pickle.loads(pickle.dumps(config)) == config


@pytest.mark.parametrize(
    "extra, rope_parameters",
    [
        ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, {}),
        (
            {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
            {"rope_type": "linear", "factor": 4.0},
        ),
        # llama.cpp reads a factor without a type as linear (files older than the type key)
        ({"llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.original_context_length": 32,
                "llama.rope.scaling.yarn_beta_fast": 16.0,
            },
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0},
        ),
    ],
    ids=["none", "linear", "legacy-linear", "yarn"],
)
def test_rope_scaling_keys_map_to_transformers_rope_parameters(extra, rope_parameters, tmp_path):
    path = write_metadata_only_gguf(str(tmp_path / "m.gguf"), "llama", extra=extra)
    expected = {"rope_theta": 10000.0, "rope_type": "default", **rope_parameters}
    assert gguf_to_hf_config(GGUFFile(path)).rope_parameters == expected


def test_gemma3_rope_scaling_applies_to_the_global_layers_only(tmp_path):
    """Gemma 3 4B-27B scale the global layers' positions (linear, factor 8), as llama.cpp does."""
    path = write_metadata_only_gguf(
        str(tmp_path / "m.gguf"),
        "gemma3",
        extra={"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0},
    )
    rope_parameters = gguf_to_hf_config(GGUFFile(path)).rope_parameters
    assert rope_parameters["full_attention"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0}
    assert rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize(
    "extra, tensors, message",
    [
        ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}, {}, "rope.scaling.type 'longrope'"),
        (
            {
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.yarn_ext_factor": 0.5,
            },
            {},
            "yarn_ext_factor 0.5",
        ),
        ({"llama.rope.scaling.attn_factor": 2.0}, {}, "attn_factor 2.0"),
        ({}, {"rope_freqs.weight": np.ones(3, np.float32)}, "must be 8 F32 or F16 values"),
        ({}, {"rope_freqs.weight": np.array([1, 1, 1, 1, 1, 1, 1, -2], np.float32)}, "not a positive number"),
    ],
    ids=["longrope", "yarn-ext-factor", "attn-factor", "rope-freqs-length", "rope-freqs-negative"],
)
def test_rope_scaling_tokenloom_cannot_reproduce_is_refused_by_name(extra, tensors, message, tmp_path):
    path = write_metadata_only_gguf(
        str(tmp_path / "m.gguf"),
        "llama",
        extra=extra,
        tensors={"token_embd.weight": np.zeros((8, 32), np.float32), **tensors},
    )
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        gguf_to_hf_config(GGUFFile(path))


def test_mixture_of_experts_files_map_onto_qwen3_moe_and_mixtral(tmp_path):
    experts = {"expert_count": 16, "expert_used_count": 4}
    path = write_metadata_only_gguf(
        str(tmp_path / "q.gguf"),
        "qwen3moe",
        extra={
            **{f"qwen3moe.{key}": value for key, value in experts.items()},
            "qwen3moe.expert_feed_forward_length": 32,
        },
    )
    config = gguf_to_hf_config(GGUFFile(path))
    assert (config.architectures, config.model_type) == (["Qwen3MoeForCausalLM"], "qwen3_moe")
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (16, 4, 32)
    assert (config.norm_topk_prob, config.decoder_sparse_step, config.mlp_only_layers) == (True, 1, [])
    path = write_metadata_only_gguf(
        str(tmp_path / "m.gguf"), "llama", extra={f"llama.{key}": value for key, value in experts.items()}
    )
    config = gguf_to_hf_config(GGUFFile(path))
    assert (config.architectures, config.model_type) == (["MixtralForCausalLM"], "mixtral")
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (16, 4, 64)
    # Qwen3-MoE without its expert size, and any MoE file without its experts per token, are incomplete
    path = write_metadata_only_gguf(
        str(tmp_path / "n.gguf"), "qwen3moe", extra={f"qwen3moe.{key}": value for key, value in experts.items()}
    )
    with pytest.raises(ModelLoadError, match=r"lacks the metadata key qwen3moe\.expert_feed_forward_length"):
        gguf_to_hf_config(GGUFFile(path))
    path = write_metadata_only_gguf(str(tmp_path / "o.gguf"), "llama", extra={"llama.expert_count": 16})
    with pytest.raises(ModelLoadError, match=r"lacks the metadata key llama\.expert_used_count"):
        gguf_to_hf_config(GGUFFile(path))


def test_expert_tensors_in_an_architecture_served_dense_are_refused_as_such(tmp_path):
    """Expert tensors without an expert count (so not Mixtral), or in qwen2: named for what they are."""
    for architecture in ("llama", "qwen2"):
        path = write_metadata_only_gguf(
            str(tmp_path / f"{architecture}.gguf"),
            architecture,
            tensors={
                "token_embd.weight": np.zeros((8, 32), np.float32),
                "blk.0.ffn_gate_inp.weight": np.zeros((6, 32), np.float32),
            },
        )
        with pytest.raises(
            ModelLoadError, match=rf"holds mixture-of-experts tensors in architecture '{architecture}', whose experts"
        ):
            gguf_to_hf_config(GGUFFile(path))


def test_every_gguf_architecture_has_a_config_a_tensor_map_and_a_model():
    """One table names what each llama.cpp architecture loads as (``tokenloom models`` shows it):
    a GGUF architecture added to one of the three tables and not the others fails here."""
    from tokenloom.builtin_plugins.models import MODELS

    assert set(GGUF_ARCHITECTURES) == set(GGUF_CONFIG_BUILDERS) == set(BLOCK_NAMES)
    assert set(GGUF_ARCHITECTURES.values()) <= set(MODELS)
    # plus the one name a file's architecture does not give alone (Mixtral: llama with experts)
    assert GGUFLoadFormat.architecture_names == {**GGUF_ARCHITECTURES, "llama with experts": "MixtralForCausalLM"}


@pytest.mark.parametrize("architecture", ["olmoe", "qwen2moe"])
def test_olmoe_and_qwen2moe_files_take_transformers_defaults_and_llama_cpp_routing(architecture, tmp_path):
    """Every field as transformers' OlmoeConfig / Qwen2MoeConfig holds it for the file's keys:
    routing never renormalised (llama.cpp never renormalises either), a qwen2moe file without
    its expert sizes sized as llama.cpp sizes them (feed_forward_length / experts per token; the
    shared expert feed_forward_length)."""
    import transformers

    path = write_minimal_gguf(str(tmp_path / "m.gguf"), architecture, expert_count=16, expert_used_count=4)
    ours = gguf_to_hf_config(GGUFFile(path)).to_dict()
    fields = dict(SHAPE, rms_norm_eps=float(np.float32(1e-6)), tie_word_embeddings=True, num_experts=16)
    if architecture == "olmoe":
        reference = transformers.OlmoeConfig(**fields, num_experts_per_tok=4, norm_topk_prob=False)
    else:
        reference = transformers.Qwen2MoeConfig(
            **fields,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=128,
            norm_topk_prob=False,
        )
    expected = reference.to_dict()
    assert ours.pop("architectures") == [{"olmoe": "OlmoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}[architecture]]
    expected.pop("architectures"), expected.pop("transformers_version")
    assert ours == expected
