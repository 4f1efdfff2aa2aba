"""EngineArgs, the typed flat set of engine arguments: one field per config-group field with
the group's default, grouped into an EngineConfig; unknown names are a clear error."""

from __future__ import annotations

import dataclasses

import pytest

from tokenloom.core.config import (
    CONFIG_GROUPS,
    ENGINE_ARG_GROUPS,
    JSON_CONFIG_ARGS,
    STRUCTURED_OUTPUT_ARGS,
    EngineArgs,
    EngineConfig,
    StructuredOutputConfig,
)
from tokenloom.errors import ConfigError


def test_engine_args_hold_every_group_field_with_the_groups_defaults():
    # a field added to a config group must be added to EngineArgs too (the CLI routes to it)
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert set(fields) == set(ENGINE_ARG_GROUPS) | set(STRUCTURED_OUTPUT_ARGS) | set(JSON_CONFIG_ARGS)
    for _, group in CONFIG_GROUPS:
        for group_field in dataclasses.fields(group):
            assert fields[group_field.name].default == group_field.default, group_field.name
    structured = {f.name: f.default for f in dataclasses.fields(StructuredOutputConfig)}
    for name, target in STRUCTURED_OUTPUT_ARGS.items():
        assert fields[name].default == structured[target], name


def test_defaults_give_the_groups_defaults():
    config = EngineArgs().create_engine_config()
    assert config == EngineConfig(
        **{group: cls() for group, cls in CONFIG_GROUPS}, structured_output=StructuredOutputConfig()
    )


def test_values_land_in_their_groups():
    args = EngineArgs(
        model="m",
        max_model_len=64,
        block_size=8,
        max_num_seqs=4,
        device="cpu",
        load_format="dummy",
        tensor_parallel_size=1,
        served_model_name="alias",
        guided_decoding_backend="xgrammar",
        reasoning_parser="deepseek_r1",
    )
    assert args.max_model_len == 64 and args.reasoning_parser == "deepseek_r1"  # plain typed attributes
    config = args.create_engine_config()
    assert (config.model.model, config.model.max_model_len, config.model.served_model_name) == ("m", 64, ["alias"])
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.device.device) == (8, 4, "cpu")
    assert config.load.load_format == "dummy"
    assert (config.structured_output.backend, config.structured_output.reasoning_parser) == ("xgrammar", "deepseek_r1")


def test_unknown_names_suggest_the_closest_one():
    with pytest.raises(ConfigError, match="unknown engine argument 'max_model_lenght'; did you mean 'max_model_len'"):
        EngineArgs.from_kwargs(max_model_lenght=64)
    with pytest.raises(TypeError, match="max_model_lenght"):
        EngineArgs(max_model_lenght=64)  # type: ignore[call-arg]  # the point of the test
    assert EngineArgs.from_kwargs(model="m", block_size=32) == EngineArgs(model="m", block_size=32)


def test_values_are_checked_when_grouped():
    with pytest.raises(ConfigError, match="--block-size: must be a positive power of two, got 12"):
        EngineArgs(block_size=12).create_engine_config()
