"""The ``dummy`` load format: the real config and tokenizer, no weights, never auto-selected."""

from __future__ import annotations

import pytest
from helpers.gguf_files import byte_level_vocab, write_metadata_only_gguf

from tokenloom.builtin_plugins import loaders
from tokenloom.builtin_plugins.loaders.dummy_format import DummyLoadFormat
from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat
from tokenloom.core.config import LoadConfig, ModelConfig
from tokenloom.errors import ModelLoadError


def test_reads_config_and_tokenizer_through_the_real_format_and_yields_no_weights(tmp_path):
    path = write_metadata_only_gguf(
        str(tmp_path / "m.gguf"),
        "llama",
        tokenizer=byte_level_vocab(),
        extra={"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2},
    )
    dummy = DummyLoadFormat()
    assert isinstance(dummy.delegate(path), GGUFLoadFormat)
    config = dummy.load_config(path, ModelConfig(hf_overrides={"rms_norm_eps": 0.5}))
    assert config.architectures == ["LlamaForCausalLM"] and config.rms_norm_eps == 0.5
    assert (
        dummy.load_tokenizer(path, ModelConfig())("hello").input_ids
        == GGUFLoadFormat().load_tokenizer(path, ModelConfig())("hello").input_ids
    )
    assert list(dummy.iterate_weights(path, ModelConfig(), LoadConfig())) == []
    assert dummy.quantization(path) is None
    assert dummy.initializes_randomly is True


def test_is_never_chosen_by_auto(tmp_path):
    path = write_metadata_only_gguf(str(tmp_path / "m.gguf"), "llama")
    assert DummyLoadFormat().can_load(path) is False
    assert DummyLoadFormat.auto_selectable is False


def test_unreadable_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no format can read"):
        DummyLoadFormat().load_config(str(tmp_path), ModelConfig())


@pytest.mark.hook("register_load_formats")
def test_hook_registers_dummy():
    registered = []
    loaders.register_load_formats(register=lambda n, t, **o: registered.append((n, t)))
    assert ("dummy", "tokenloom.builtin_plugins.loaders.dummy_format:DummyLoadFormat") in registered
