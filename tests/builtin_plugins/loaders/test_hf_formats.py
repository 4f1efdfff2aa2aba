"""The ``safetensors`` and ``pt`` load formats on a tiny Hugging Face model directory (single
file and sharded), ``--ignore-patterns``, ``--hf-overrides``, and the errors for missing,
truncated and corrupt files."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers.gguf_files import tiny_model_state_dict

from tokenloom.builtin_plugins import loaders
from tokenloom.builtin_plugins.loaders import pt_format, safetensors_format
from tokenloom.builtin_plugins.loaders.pt_format import PtLoadFormat
from tokenloom.builtin_plugins.loaders.safetensors_format import SafetensorsLoadFormat
from tokenloom.core.config import LoadConfig, ModelConfig
from tokenloom.core.model_files import LoadFormat
from tokenloom.errors import ModelLoadError
from tokenloom.plugins.registry import resolve_target


def save_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    config, state_dict = tiny_model_state_dict("llama")
    return config, state_dict


def model_directory(tmp_path, tiny_model, *, shards: int = 1, kind: str = "safetensors") -> str:
    from safetensors.torch import save_file

    config, state_dict = tiny_model
    directory = tmp_path / f"{kind}-{shards}"
    directory.mkdir()
    config.save_pretrained(directory)
    save_tokenizer(str(directory))
    names = sorted(state_dict)
    groups = [names[i::shards] for i in range(shards)]
    extension = "safetensors" if kind == "safetensors" else "bin"
    stem = "model" if kind == "safetensors" else "pytorch_model"
    weight_map = {}
    for index, group in enumerate(groups):
        file_name = f"{stem}.{extension}" if shards == 1 else f"{stem}-{index + 1:05d}-of-{shards:05d}.{extension}"
        tensors = {name: state_dict[name].contiguous() for name in group}
        if kind == "safetensors":
            save_file(tensors, str(directory / file_name))
        else:
            torch.save(tensors, str(directory / file_name))
        weight_map.update({name: file_name for name in group})
    if shards > 1:
        index_name = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
        (directory / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(directory)


FORMATS = [("safetensors", SafetensorsLoadFormat), ("pt", PtLoadFormat)]


@pytest.mark.parametrize("kind, format_class", FORMATS)
@pytest.mark.parametrize("shards", [1, 3])
def test_yields_every_tensor_once_with_its_values(tmp_path, tiny_model, kind, format_class, shards):
    directory = model_directory(tmp_path, tiny_model, shards=shards, kind=kind)
    load_format = format_class()
    assert load_format.can_load(directory)
    weights = list(load_format.iterate_weights(directory, ModelConfig(), LoadConfig(use_tqdm_on_load=False)))
    names = [name for name, _ in weights]
    assert sorted(names) == sorted(tiny_model[1]) and len(names) == len(set(names))
    for name, tensor in weights:
        assert torch.equal(tensor, tiny_model[1][name]), name


@pytest.mark.parametrize("kind, format_class", FORMATS)
def test_config_and_tokenizer_come_from_the_directory_with_overrides(tmp_path, tiny_model, kind, format_class):
    directory = model_directory(tmp_path, tiny_model, kind=kind)
    load_format = format_class()
    config = load_format.load_config(directory, ModelConfig(hf_overrides={"rms_norm_eps": 0.125}))
    assert config.model_type == "llama" and config.hidden_size == 64
    assert config.rms_norm_eps == 0.125
    tokenizer = load_format.load_tokenizer(directory, ModelConfig())
    assert tokenizer("hello world").input_ids == [3, 4]


def test_ignore_patterns_skip_matching_shards(tmp_path, tiny_model):
    directory = model_directory(tmp_path, tiny_model, shards=3)
    ignored = "model-00002-of-00003.safetensors"
    load_config = LoadConfig(ignore_patterns=["*-00002-of-*"])
    names = {name for name, _ in SafetensorsLoadFormat().iterate_weights(directory, ModelConfig(), load_config)}
    with open(os.path.join(directory, "model.safetensors.index.json")) as handle:
        skipped = {n for n, f in json.load(handle)["weight_map"].items() if f == ignored}
    assert skipped and names == set(tiny_model[1]) - skipped


def test_ignore_patterns_match_relative_paths_without_an_index(tmp_path, tiny_model):
    directory = model_directory(tmp_path, tiny_model)
    shutil.copy(os.path.join(directory, "model.safetensors"), os.path.join(directory, "consolidated.safetensors"))
    load_config = LoadConfig(ignore_patterns=["consolidated*"])
    names = [name for name, _ in SafetensorsLoadFormat().iterate_weights(directory, ModelConfig(), load_config)]
    assert len(names) == len(tiny_model[1])


def test_truncated_safetensors_names_the_file(tmp_path, tiny_model):
    directory = model_directory(tmp_path, tiny_model)
    path = os.path.join(directory, "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as error:
        list(SafetensorsLoadFormat().iterate_weights(directory, ModelConfig(), LoadConfig()))
    assert path in str(error.value) and "truncated or corrupt" in str(error.value)


def test_missing_shard_named_by_the_index(tmp_path, tiny_model):
    directory = model_directory(tmp_path, tiny_model, shards=3)
    os.remove(os.path.join(directory, "model-00003-of-00003.safetensors"))
    with pytest.raises(ModelLoadError, match="model-00003-of-00003.safetensors"):
        list(SafetensorsLoadFormat().iterate_weights(directory, ModelConfig(), LoadConfig()))


def test_missing_config_and_missing_directory(tmp_path, tiny_model):
    directory = model_directory(tmp_path, tiny_model)
    os.remove(os.path.join(directory, "config.json"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        SafetensorsLoadFormat().load_config(directory, ModelConfig())
    with pytest.raises(ModelLoadError, match="does not exist"):
        list(SafetensorsLoadFormat().iterate_weights(str(tmp_path / "absent"), ModelConfig(), LoadConfig()))


def test_corrupt_pt_file_names_the_file(tmp_path, tiny_model):
    directory = model_directory(tmp_path, tiny_model, kind="pt")
    path = os.path.join(directory, "pytorch_model.bin")
    with open(path, "wb") as handle:
        handle.write(b"not a zip file at all")
    with pytest.raises(ModelLoadError) as error:
        list(PtLoadFormat().iterate_weights(directory, ModelConfig(), LoadConfig()))
    assert path in str(error.value)


def test_pt_refuses_pickled_objects_that_are_not_tensors(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.ones(2), "note": "text"}, str(path))
    with pytest.raises(ModelLoadError, match="dict of tensors"):
        list(PtLoadFormat().iterate_weights(str(path), ModelConfig(), LoadConfig()))


def test_can_load_prefers_safetensors_when_both_exist(tmp_path, tiny_model):
    directory = model_directory(tmp_path, tiny_model)
    torch.save({"x": torch.ones(1)}, os.path.join(directory, "pytorch_model.bin"))
    assert SafetensorsLoadFormat().can_load(directory)
    assert not PtLoadFormat().can_load(directory)
    assert not SafetensorsLoadFormat().can_load(str(tmp_path / "absent"))


def test_progress_bar_over_shards(tmp_path, tiny_model, capsys):
    directory = model_directory(tmp_path, tiny_model, shards=3)
    list(SafetensorsLoadFormat().iterate_weights(directory, ModelConfig(), LoadConfig(use_tqdm_on_load=True)))
    assert "loading safetensors shards" in capsys.readouterr().err


@pytest.mark.slow
def test_packaged_sentence_transformer_loads(tmp_path):
    from tokenloom.builtin_plugins.model_sources.pip_packages import PipPackageModelSource

    path = PipPackageModelSource().resolve("all-minilm-l6-v2").path
    load_format = SafetensorsLoadFormat()
    assert load_format.can_load(path)
    config = load_format.load_config(path, ModelConfig())
    assert config.model_type == "bert" and config.hidden_size == 384
    assert load_format.load_tokenizer(path, ModelConfig())("hello world").input_ids == [101, 7592, 2088, 102]
    names = {name for name, _ in load_format.iterate_weights(path, ModelConfig(), LoadConfig())}
    assert "embeddings.word_embeddings.weight" in names and len(names) > 90


@pytest.mark.hook("register_load_formats")
@pytest.mark.parametrize(
    "module, name, target",
    [
        (
            safetensors_format,
            "safetensors",
            "tokenloom.builtin_plugins.loaders.safetensors_format:SafetensorsLoadFormat",
        ),
        (pt_format, "pt", "tokenloom.builtin_plugins.loaders.pt_format:PtLoadFormat"),
    ],
)
def test_hooks_register_lazily(module, name, target):
    registered = []
    loaders.register_load_formats(register=lambda n, t, **o: registered.append((n, t)))
    assert (name, target) in registered and target.startswith(module.__name__ + ":")
    assert issubclass(resolve_target(target), LoadFormat)
