"""lm-format-enforcer's JSON parser with exact number and string rules, character by character:
random walks over the characters it allows always end in JSON the schema accepts; every number
it can end on is a JSON number (an integer for integer schemas) and it takes every JSON number;
whitespace and escapes count towards string lengths."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from tokenloom.builtin_plugins.structured_output.lm_format_enforcer_backend import (
    LMFormatEnforcerBackend,
    lm_format_enforcer_schema,
)
from tokenloom.builtin_plugins.structured_output.lm_format_enforcer_json import StrictJsonSchemaParser
from tokenloom.core.structured_output_constraints import BackendOptions, Constraint

JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
JSON_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
# characters a walk picks from: JSON's structure, number and escape characters, some text
ALPHABET = set('{}[],:"-+.eE0123456789 \\/bfnrtuaAdD8') | {"é", "日"}


def parser_for(schema: dict) -> StrictJsonSchemaParser:
    return StrictJsonSchemaParser.for_schema(lm_format_enforcer_schema(schema))


def feed(parser, text: str):
    for character in text:
        assert character in parser.get_allowed_characters(), f"{character!r} refused after {text!r}"
        parser = parser.add_character(character)
    return parser


def allowed(parser) -> set[str]:
    return set(parser.get_allowed_characters())


def random_walk(schema: dict, rng: random.Random, max_chars: int = 60) -> str | None:
    """One walk over the allowed characters (of ALPHABET when it can), ending where the parser can end, a
    third of the time it may; None when it runs out."""
    parser, text = parser_for(schema), ""
    for _ in range(max_chars):
        if parser.can_end() and text.strip() and rng.random() < 0.35:
            return text
        # property names and the like are outside ALPHABET: then any allowed character
        choices = sorted(allowed(parser) & ALPHABET) or sorted(allowed(parser))
        if not choices:
            assert parser.can_end(), f"dead end after {text!r}"
            return text
        character = rng.choice(choices)
        parser, text = parser.add_character(character), text + character
    return None


SCHEMAS = {
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "numbers_in_an_object": {
        "type": "object",
        "properties": {"count": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["count", "price"],
    },
    "numbers_in_an_array": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    "integers_in_an_array": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "max_length": {"type": "string", "maxLength": 3},
    "min_length": {"type": "string", "minLength": 2},
    "length_bounds": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 1, "maxLength": 4}},
        "required": ["word"],
    },
    "enum_with_leading_space": {"enum": [" a", "b"]},
    "integer_or_string": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]},
    "numeric_const": {
        "type": "object",
        "properties": {"v": {"const": 2.5}, "n": {"type": "integer", "const": -3}},
        "required": ["v", "n"],
    },
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_character_walks_end_in_valid_json(name):
    schema = SCHEMAS[name]
    assert LMFormatEnforcerBackend(None, 0, [], BackendOptions()).supports(Constraint("json", schema)) is None
    rng = random.Random(name)
    finished = 0
    for _ in range(400):
        text = random_walk(schema, rng)
        if text is None:
            continue
        finished += 1
        value = json.loads(text)  # strict: no raw control characters, valid escapes
        jsonschema.validate(value, schema)
        if schema.get("type") == "integer":
            assert isinstance(value, int) and JSON_INTEGER.fullmatch(text.strip()), text
    assert finished > 100


def complete_numbers(schema: dict, max_length: int) -> set[str]:
    """Every string of at most ``max_length`` number characters the parser can end on."""
    found: set[str] = set()

    def walk(parser, text: str) -> None:
        if text and parser.can_end():
            found.add(text)
        if len(text) < max_length:
            for character in allowed(parser) & set("-+.eE0123456789"):
                walk(parser.add_character(character), text + character)

    walk(parser_for(schema), "")
    return found


def test_every_number_the_parser_ends_on_is_a_json_number_and_integers_are_integers():
    integers = complete_numbers({"type": "integer"}, 4)
    numbers = complete_numbers({"type": "number"}, 5)
    assert {"0", "-0", "7", "-12", "1234"} <= integers and not {"01", "1e5", "-0.5", "1.0"} & integers
    assert {"0.5", "-0.25", "1e5", "2E-3", "2e+3", "1.5e7"} <= numbers
    assert not {"1.", "1.e5", ".5", "-.5", "00"} & numbers
    assert all(JSON_INTEGER.fullmatch(text) for text in integers)
    assert all(JSON_NUMBER.fullmatch(text) for text in numbers)
    # and every JSON number of that length: exactly the grammar, not a subset of it
    assert integers == {text for text in numbers if JSON_INTEGER.fullmatch(text) and len(text) <= 4}


def test_the_parser_takes_every_json_number():
    rng = random.Random(5)
    for _ in range(300):
        value = rng.choice(
            [rng.randint(-(10**9), 10**9), rng.uniform(-1e6, 1e6), rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30)]
        )
        text = json.dumps(value)
        parser = feed(parser_for({"type": "number"}), text)
        assert parser.can_end(), text
        if isinstance(value, int):
            assert feed(parser_for({"type": "integer"}), text).can_end()


def test_whitespace_and_escapes_count_towards_string_lengths():
    three = feed(parser_for({"type": "string", "maxLength": 3}), '"   ')
    assert allowed(three) == {'"'}  # the library did not count leading spaces
    assert '"' in allowed(feed(parser_for({"type": "string", "maxLength": 3}), '"a\\n'))
    two = parser_for({"type": "string", "minLength": 2})
    assert '"' not in allowed(feed(two, '"\\ud83d\\ude00'))  # one character, as a surrogate pair
    assert '"' in allowed(feed(two, '"\\ud83d\\ude00x'))
    assert '"' in allowed(feed(two, '"ab'))
    enum = feed(parser_for({"enum": [" a", "b"]}), '" ')
    assert allowed(enum) == {"a"}  # the library offered the space again, and again


def test_numbers_end_where_the_object_goes_on():
    schema = SCHEMAS["numbers_in_an_object"]
    parser = feed(parser_for(schema), '{"count": -0')
    assert "." not in allowed(parser) and "," in allowed(parser)  # "-0." was open to integers
    parser = feed(parser, ', "price": 1.')
    assert allowed(parser) == set("0123456789")
    parser = feed(parser, "5e")
    assert allowed(parser) == set("+-0123456789")
    assert feed(parser, "-3}").can_end()
