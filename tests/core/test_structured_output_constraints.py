"""Constraint parsing without a model or a backend: the forms a request's ``structured_outputs``
dict may take, the errors that name what to change, ``--guided-decoding-backend``'s option
syntax, and the size and depth limits checked before anything recursive reads a schema."""

from __future__ import annotations

import json
import re

import pytest

from tokenloom.core.structured_output_constraints import (
    MAX_CONSTRAINT_DEPTH,
    BackendOptions,
    forbid_additional_properties,
    parse_backend_option,
    parse_constraint,
)
from tokenloom.errors import ConfigError, InvalidRequestError


def test_parse_constraint_forms_and_options():
    constraint, backend, no_fallback = parse_constraint(
        {"json": '{"type": "object"}', "backend": "xgrammar", "disable_fallback": True}, BackendOptions()
    )
    assert (constraint.kind, constraint.spec, backend, no_fallback) == ("json", {"type": "object"}, "xgrammar", True)
    assert parse_constraint({"choice": ["a", "b"]}, BackendOptions())[0].spec == ("a", "b")
    assert parse_constraint({"json_object": True}, BackendOptions())[0].kind == "json_object"
    relaxed = parse_constraint({"json": {}, "whitespace_pattern": "[ ]?"}, BackendOptions())[0]
    assert relaxed.any_whitespace and relaxed.whitespace_pattern == "[ ]?"
    compact = parse_constraint({"json": {}}, BackendOptions(disable_any_whitespace=True))[0]
    assert not compact.any_whitespace
    # only JSON has optional whitespace: the pattern does not split the regex cache entries
    assert parse_constraint({"regex": "a", "whitespace_pattern": " "}, BackendOptions())[0].whitespace_pattern is None


def test_pydantic_model_class_is_a_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int

    constraint = parse_constraint({"json": Point}, BackendOptions())[0]
    assert constraint.spec["properties"]["x"]["type"] == "integer"


@pytest.mark.parametrize(
    "request_dict, message",
    [
        ({"jsn": {}}, "unknown structured_outputs key(s) jsn"),
        ({"json": {}, "regex": "a"}, "exactly one constraint"),
        ({}, "got none"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "foo"}}, "invalid JSON schema"),
        ({"json": {"properties": {"a": {"minimum": "zero"}}}}, "invalid JSON schema at properties/a/minimum"),
        ({"json": [1, 2]}, "must be a JSON object"),
        ({"choice": []}, "non-empty list of strings"),
        ({"choice": ["a", 1]}, "non-empty list of strings"),
        ({"regex": ""}, "non-empty string"),
        ({"structural_tag": "[oops"}, "not valid JSON"),
    ],
)
def test_bad_constraints_name_the_problem(request_dict, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as error:
        parse_constraint(request_dict, BackendOptions())
    assert error.value.param == "structured_outputs"


def test_disable_additional_properties_closes_every_object():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {}},
            "b": {"type": "object", "additionalProperties": True},
        },
        "$defs": {"d": {"properties": {"x": {"enum": [{"type": "object"}]}}}},
    }
    closed = forbid_additional_properties(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True  # an explicit choice stays
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["properties"]["x"]["enum"] == [{"type": "object"}]  # values are not schemas
    assert "additionalProperties" not in schema  # the request's schema is not changed
    constraint = parse_constraint({"json": schema, "disable_additional_properties": True}, BackendOptions())[0]
    assert constraint.spec == closed


def test_backend_option_syntax():
    assert parse_backend_option("auto") == ("auto", BackendOptions())
    assert parse_backend_option("xgrammar:disable-any-whitespace") == (
        "xgrammar",
        BackendOptions(disable_any_whitespace=True),
    )
    assert parse_backend_option("outlines:no-fallback, no-additional-properties") == (
        "outlines",
        BackendOptions(disable_fallback=True, disable_additional_properties=True),
    )
    with pytest.raises(ConfigError, match="unknown option 'fast'"):
        parse_backend_option("xgrammar:fast")


# -- schema checks: size and depth first, off the caller's thread, bounded ---------------------


def wide_schema(num_properties: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(num_properties)}}


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_an_oversized_schema_is_refused_before_jsonschema_reads_it(monkeypatch):
    import jsonschema

    def never(*args, **kwargs):
        raise AssertionError("the schema check ran on an oversized schema")

    monkeypatch.setattr(jsonschema.validators, "validator_for", never)
    schema = wide_schema(50_000)  # 1.7 MB of JSON: jsonschema takes about 20 s over it
    for value in (schema, json.dumps(schema)):
        with pytest.raises(InvalidRequestError, match="longer than 262144 characters of JSON") as error:
            parse_constraint({"json": value}, BackendOptions())
        assert error.value.param == "structured_outputs"


@pytest.mark.parametrize("as_text", [False, True])
def test_a_deep_schema_is_a_400_not_a_recursion_error(as_text):
    schema = deep_schema(150)  # 301 levels of JSON objects
    with pytest.raises(InvalidRequestError, match=f"nests deeper than {MAX_CONSTRAINT_DEPTH} levels") as error:
        parse_constraint({"json": json.dumps(schema) if as_text else schema}, BackendOptions())
    assert error.value.param == "structured_outputs"
    # far deeper than the C parser's own limit: still a 400
    with pytest.raises(InvalidRequestError, match="nests deeper"):
        parse_constraint({"json": "[" * 200_000}, BackendOptions())
    # at the limit it is checked as usual (jsonschema's recursion fits in the stack)
    constraint, _, _ = parse_constraint({"json": deep_schema((MAX_CONSTRAINT_DEPTH - 1) // 2)}, BackendOptions())
    assert constraint.kind == "json"


def test_a_deep_structural_tag_or_choice_is_a_400():
    nested: list = []
    for _ in range(100):
        nested = [nested]
    with pytest.raises(InvalidRequestError, match="nests deeper"):
        parse_constraint({"structural_tag": {"structures": nested, "triggers": []}}, BackendOptions())
    with pytest.raises(InvalidRequestError, match="longer than"):
        parse_constraint({"choice": ["x" * 1000] * 300}, BackendOptions())
