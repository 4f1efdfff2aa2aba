"""The ``gguf`` load format on tiny GGUF files written like llama.cpp writes them: config,
tokenizer and weights compared with the original transformers model and with transformers'
own GGUF conversion; plus the error cases."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from helpers.gguf_files import (
    byte_level_vocab,
    finish,
    sentencepiece_vocab,
    tiny_model_state_dict,
    write_metadata_only_gguf,
    write_model_gguf,
)

from tokenloom.builtin_plugins import loaders
from tokenloom.builtin_plugins.loaders import gguf_format
from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat, hf_tensor_name
from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGUFWeight
from tokenloom.core.config import LoadConfig, ModelConfig
from tokenloom.core.model_files import LoadFormat
from tokenloom.errors import ModelLoadError
from tokenloom.plugins.registry import resolve_target

ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


def dense(weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, GGUFWeight) else weight.float()


def transformers_reference(directory: str, file_name: str):
    """transformers' own GGUF conversion: (config, {hf_name: dequantized tensor})."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(directory, gguf_file=file_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(os.path.join(directory, file_name), return_tensors=True, model_to_load=model)
    return config, tensors["tensors"], set(model.state_dict())


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_gguf(request, tmp_path_factory):
    architecture = request.param
    config, state_dict = tiny_model_state_dict(architecture)
    directory = tmp_path_factory.mktemp(architecture)
    path = write_model_gguf(
        str(directory / "model.gguf"), architecture, config, state_dict, quant_type=GGMLQuantizationType.Q8_0
    )
    return SimpleNamespace(
        architecture=architecture, config=config, state_dict=state_dict, path=path, directory=str(directory)
    )


def test_config_equals_transformers_conversion(tiny_gguf):
    ours = GGUFLoadFormat().load_config(tiny_gguf.path, ModelConfig())
    reference, _, _ = transformers_reference(tiny_gguf.directory, "model.gguf")
    ours_dict, reference_dict = ours.to_dict(), reference.to_dict()
    # names, and the class to build, are ours to state; transformers leaves architectures empty
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "transformers_version"):
        ours_dict.pop(key, None), reference_dict.pop(key, None)
    if tiny_gguf.architecture in ("gemma2", "gemma3"):
        # llama.cpp scales Gemma queries by 1/sqrt(head_dim); transformers keeps the class default
        assert ours_dict.pop("query_pre_attn_scalar") == tiny_gguf.config.head_dim
        reference_dict.pop("query_pre_attn_scalar")
    if tiny_gguf.architecture == "qwen3":
        # transformers' conversion ignores attention.key_length and keeps Qwen3Config's 128
        assert ours_dict.pop("head_dim") == tiny_gguf.config.head_dim
        reference_dict.pop("head_dim")
    assert ours_dict == reference_dict
    assert ours.architectures == [
        {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM",
            "gemma3": "Gemma3ForCausalLM",
            "phi3": "Phi3ForCausalLM",
        }[tiny_gguf.architecture]
    ]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "intermediate_size",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(ours, key) == getattr(tiny_gguf.config, key), key


def test_weights_have_hf_names_and_equal_transformers_dequantized_values(tiny_gguf):
    ours = {name: dense(weight) for name, weight in GGUFLoadFormat().iterate_weights(tiny_gguf.path, None, None)}
    _, reference, model_parameters = transformers_reference(tiny_gguf.directory, "model.gguf")
    assert set(ours) == set(reference)
    tied = {"lm_head.weight"} if tiny_gguf.config.tie_word_embeddings else set()
    assert set(ours) == model_parameters - tied
    for name, tensor in reference.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor.float()), name


def test_weights_round_trip_to_the_original_model(tiny_gguf):
    """Undoing llama.cpp's transforms recovers the original weights (up to Q8_0 rounding)."""
    for name, weight in GGUFLoadFormat().iterate_weights(tiny_gguf.path, None, None):
        original = tiny_gguf.state_dict[name]
        if isinstance(weight, GGUFWeight):
            assert weight.type_name == "Q8_0" and weight.shape == original.shape
            step = original.abs().reshape(-1, 32).amax(dim=1, keepdim=True) / 127
            error = (weight.dequantize() - original).abs().reshape(-1, 32)
            assert torch.all(error <= step * 0.5 + 1e-4), name
        else:
            torch.testing.assert_close(weight.float(), original, rtol=0, atol=1e-6)


def test_llama_q_and_k_rows_are_unpermuted_in_packed_form():
    order = gguf_format.rope_unpermute_order(8, 2)
    # llama.cpp interleaves a head's halves: rows [0, 2, 1, 3] of head 0 hold HF rows [0, 1, 2, 3]
    assert order.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_quantization_is_gguf_only_when_a_tensor_is_quantized(tiny_gguf, tmp_path):
    load_format = GGUFLoadFormat()
    assert load_format.quantization(tiny_gguf.path) == "gguf"
    float_only = write_metadata_only_gguf(str(tmp_path / "f32.gguf"), "llama")
    assert load_format.quantization(float_only) is None


def test_float_tensors_are_views_of_the_file_not_copies(tmp_path):
    path = write_metadata_only_gguf(
        str(tmp_path / "m.gguf"),
        "llama",
        tensors={
            "token_embd.weight": np.arange(64, dtype=np.float32).reshape(2, 32),
            "output_norm.weight": np.ones(32, dtype=np.float16),
        },
    )
    weights = dict(GGUFLoadFormat().iterate_weights(path, None, None))
    embedding = weights["model.embed_tokens.weight"]
    assert embedding.dtype == torch.float32 and embedding.shape == (2, 32)
    assert torch.equal(embedding, torch.arange(64, dtype=torch.float32).reshape(2, 32))
    assert weights["model.norm.weight"].dtype == torch.float16
    # tensors point into the file's memory map instead of owning a copy
    gguf = GGUFFile(path)
    mapped = gguf.tensor_data(gguf.tensors["token_embd.weight"])
    view = gguf_format._tensor(gguf, gguf.tensors["token_embd.weight"])
    assert view.data_ptr() == mapped.ctypes.data


def test_hf_overrides_apply_to_the_config(tiny_gguf):
    config = GGUFLoadFormat().load_config(tiny_gguf.path, ModelConfig(hf_overrides={"max_position_embeddings": 64}))
    assert config.max_position_embeddings == 64


def test_iterate_weights_shows_a_progress_bar_when_asked(tiny_gguf, capsys):
    names = [
        name for name, _ in GGUFLoadFormat().iterate_weights(tiny_gguf.path, None, LoadConfig(use_tqdm_on_load=True))
    ]
    assert names and "loading GGUF tensors" in capsys.readouterr().err


@pytest.mark.parametrize("vocabulary", ["byte_level", "sentencepiece", "gemma"])
def test_tokenizer_matches_transformers_gguf_tokenizer(vocabulary, tmp_path):
    from transformers import AutoTokenizer

    vocab = byte_level_vocab() if vocabulary == "byte_level" else sentencepiece_vocab()
    architecture = "gemma3" if vocabulary == "gemma" else "llama"
    extra = {f"{architecture}.attention.key_length": 16} if architecture == "gemma3" else {}
    path = write_metadata_only_gguf(
        str(tmp_path / "tok.gguf"),
        architecture,
        tokenizer=vocab,
        extra={"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, **extra},
    )
    ours = GGUFLoadFormat().load_tokenizer(path, ModelConfig())
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    texts = [
        "hello world",
        " hello  world ",
        "hello<|im_start|>world<|im_end|>",
        "<think>hello</think>",
        "abcd\n\n\tab",
        "日本 🤗",
        "<s>hello</s>",
        "  ",
        "",
        "<start_of_turn>ab<end_of_turn>",
        "12 12",
    ]
    for text in texts:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == (
        reference.bos_token,
        reference.eos_token,
        reference.unk_token,
        reference.pad_token,
    )
    assert ours.chat_template == reference.chat_template


def test_tokenizer_carries_the_chat_template(tmp_path):
    path = write_metadata_only_gguf(str(tmp_path / "tok.gguf"), "llama", tokenizer=byte_level_vocab())
    tokenizer = GGUFLoadFormat().load_tokenizer(path, ModelConfig())
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert rendered == "<|im_start|>hello<|im_end|>"


def test_can_load_a_gguf_file_or_a_directory_with_exactly_one(tiny_gguf, tmp_path):
    load_format = GGUFLoadFormat()
    assert load_format.can_load(tiny_gguf.path) and load_format.can_load(tiny_gguf.directory)
    assert not load_format.can_load(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert not load_format.can_load(str(tmp_path / "config.json"))


def test_missing_and_ambiguous_paths_are_clear_errors(tmp_path):
    load_format = GGUFLoadFormat()
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_format.load_config(str(tmp_path / "absent.gguf"), ModelConfig())
    write_metadata_only_gguf(str(tmp_path / "a.gguf"), "llama")
    write_metadata_only_gguf(str(tmp_path / "b.gguf"), "llama")
    with pytest.raises(ModelLoadError, match="several .gguf files.*a.gguf, b.gguf"):
        load_format.load_config(str(tmp_path), ModelConfig())


def test_unknown_architecture_names_the_file_the_architecture_and_the_supported_ones(tmp_path):
    path = write_metadata_only_gguf(str(tmp_path / "mamba.gguf"), "mamba")
    load_format = GGUFLoadFormat()
    for action in (
        lambda: load_format.load_config(path, ModelConfig()),
        lambda: list(load_format.iterate_weights(path, None, None)),
    ):
        with pytest.raises(ModelLoadError) as error:
            action()
        message = str(error.value)
        assert path in message and "'mamba'" in message
        assert "gemma2, gemma3, granite, llama, olmo2, olmoe, phi3, qwen2, qwen2moe, qwen3, qwen3moe" in message


def test_unsupported_quant_type_is_reported_with_file_tensor_and_type(tmp_path):
    path = str(tmp_path / "iq.gguf")
    writer = GGUFWriter(path, "llama")
    for key, value in {"block_count": 1, "embedding_length": 32, "attention.head_count": 2}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 18), dtype=np.uint8), raw_dtype=GGMLQuantizationType.IQ4_NL)
    finish(writer)
    [(name, weight)] = list(GGUFLoadFormat().iterate_weights(path, None, None))
    assert name == "model.layers.0.mlp.up_proj.weight" and weight.shape == (4, 32)
    with pytest.raises(ModelLoadError) as error:
        weight.dequantize()
    assert all(part in str(error.value) for part in (path, "blk.0.ffn_up.weight", "IQ4_NL"))


def test_tensor_name_mapping():
    assert hf_tensor_name("llama", "token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("llama", "output.weight") == "lm_head.weight"
    assert hf_tensor_name("llama", "blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("llama", "blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("qwen2", "blk.1.attn_q.bias") == "model.layers.1.self_attn.q_proj.bias"
    assert hf_tensor_name("gemma3", "blk.0.ffn_norm.weight") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("gemma3", "blk.0.post_ffw_norm.weight") == "model.layers.0.post_feedforward_layernorm.weight"
    assert hf_tensor_name("gemma3", "blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("llama", "rope_freqs.weight") is None
    assert hf_tensor_name("llama", "blk.0.attn_q_norm.weight") is None


@pytest.mark.hook("register_load_formats")
def test_hook_registers_gguf_lazily():
    registered = {}
    loaders.register_load_formats(register=lambda name, target, **o: registered.setdefault(name, target))
    assert registered["gguf"] == "tokenloom.builtin_plugins.loaders.gguf_format:GGUFLoadFormat"
    assert list(registered) == ["safetensors", "pt", "gguf", "dummy"]  # --load-format auto's order
    assert issubclass(resolve_target(registered["gguf"]), LoadFormat)
