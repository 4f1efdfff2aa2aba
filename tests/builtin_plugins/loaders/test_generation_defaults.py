"""Generation defaults from generation_config.json and from GGUF general.sampling.* keys."""

from __future__ import annotations

import json

import pytest
from helpers.gguf_files import write_metadata_only_gguf

from tokenloom.builtin_plugins.loaders.generation_defaults import generation_defaults
from tokenloom.errors import ModelLoadError


def test_hf_generation_config_under_sampling_param_names(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": None,
                "max_new_tokens": 128,
                "do_sample": True,
                "eos_token_id": 2,
            }
        )
    )
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 128}


def test_gguf_sampling_metadata(tmp_path):
    path = write_metadata_only_gguf(
        str(tmp_path / "m.gguf"), "llama", extra={"general.sampling.temp": 0.7, "general.sampling.top_k": 40}
    )
    assert generation_defaults(path) == {"temperature": 0.7, "top_k": 40}


def test_nothing_stated_gives_an_empty_dict_and_bad_json_an_error(tmp_path):
    assert generation_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        generation_defaults(str(tmp_path))
