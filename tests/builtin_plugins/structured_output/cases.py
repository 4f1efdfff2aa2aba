"""Constraints shared by the backend tests and the end-to-end test: varied JSON schemas
(nested objects, bounded arrays, enums, numeric ranges, required/optional, $ref/$defs,
patterns, a pydantic model), regexes and choices. Strings, numbers and arrays are bounded so
that a small model at temperature 1 always finishes within a modest ``max_tokens``."""

from __future__ import annotations

import enum

import pydantic

# bounded by a pattern, not maxLength: every backend enforces patterns
NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}
SHORT = {"type": "string", "pattern": "^[a-z]{1,8}$"}
# numbers are bounded too: unbounded, a model at temperature 1 may write digits until max_tokens
SMALL_INT = {"type": "integer", "minimum": -50, "maximum": 50}


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[A-Z][a-z]{1,9}$")
    kind: Colour
    legs: int = pydantic.Field(ge=0, le=8)


class Owner(pydantic.BaseModel):
    owner: str = pydantic.Field(pattern="^[A-Z][a-z]{1,9}$")
    pets: list[Pet] = pydantic.Field(max_length=2)
    verified: bool


SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "city_population": {
        "type": "object",
        "properties": {"city": NAME, "population": {"type": "integer", "minimum": 1000, "maximum": 40000000}},
        "required": ["city", "population"],
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "string_array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "top_level_bool_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    "colour_enum": {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"],
    },
    "integer_enum": {
        "type": "object",
        "properties": {"level": {"type": "integer", "enum": [1, 2, 3, 5, 8]}},
        "required": ["level"],
    },
    "mixed_enum": {"type": "object", "properties": {"value": {"enum": ["low", 7, True, None]}}, "required": ["value"]},
    "probability": {
        "type": "object",
        "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["p"],
    },
    "exclusive_range": {
        "type": "object",
        "properties": {"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["score"],
    },
    "booleans_and_null": {
        "type": "object",
        "properties": {"active": {"type": "boolean"}, "deleted": {"type": "null"}},
        "required": ["active", "deleted"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 200},
            "nickname": SHORT,
            "admin": {"type": "boolean"},
        },
        "required": ["id"],
    },
    "all_optional": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}},
    "refs_and_defs": {
        "$defs": {"point": {"type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT}, "required": ["x", "y"]}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "definitions_ref": {
        "definitions": {"colour": {"enum": ["cyan", "magenta"]}},
        "type": "object",
        "properties": {"fg": {"$ref": "#/definitions/colour"}, "bg": {"$ref": "#/definitions/colour"}},
        "required": ["fg", "bg"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "object", "properties": {"sku": SHORT, "qty": SMALL_INT}, "required": ["sku", "qty"]},
            }
        },
        "required": ["items"],
    },
    "const_field": {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
    },
    "any_of": {
        "type": "object",
        "properties": {"id": {"anyOf": [SHORT, {"type": "boolean"}, {"type": "null"}]}},
        "required": ["id"],
    },
    "nullable_type_list": {
        "type": "object",
        "properties": {"middle": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["middle"],
    },
    "pattern_code": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "string_length_bounds": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}},
        "required": ["word"],
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            }
        },
        "required": ["rows"],
    },
    "deep_nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {
                            "c": {"type": "object", "properties": {"d": {"type": "boolean"}}, "required": ["d"]}
                        },
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "no_additional_properties": {
        "type": "object",
        "properties": {"k": SHORT},
        "required": ["k"],
        "additionalProperties": False,
    },
    "many_types": {
        "type": "object",
        "properties": {
            "title": SHORT,
            "count": SMALL_INT,
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "flag": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        },
        "required": ["title", "count", "ratio", "flag", "tags"],
    },
    "pydantic_owner": Owner.model_json_schema(),
    "date_format": {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    "max_length_text": {
        "type": "object",
        "properties": {"note": {"type": "string", "maxLength": 12}},
        "required": ["note"],
    },
    "uuid_format": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    "one_of": {
        "type": "object",
        "properties": {
            "shape": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"circle": SMALL_INT},
                        "required": ["circle"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"square": {"type": "boolean"}},
                        "required": ["square"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    "prefix_items": {
        "type": "array",
        "prefixItems": [SMALL_INT, {"type": "boolean"}],
        "minItems": 2,
        "maxItems": 2,
        "items": False,
    },
}

# all properties required, no numbers: shapes every backend (lm-format-enforcer too) enforces
SCHEMAS.update(
    {
        "profile": {
            "type": "object",
            "properties": {"first": NAME, "last": NAME, "colour": {"enum": ["red", "blue"]}},
            "required": ["first", "last", "colour"],
        },
        "flags": {
            "type": "object",
            "properties": {"read": {"type": "boolean"}, "write": {"type": "boolean"}, "exec": {"type": "boolean"}},
            "required": ["read", "write", "exec"],
        },
        "status_list": {
            "type": "array",
            "items": {"enum": ["open", "closed", "pending"]},
            "minItems": 1,
            "maxItems": 4,
        },
        "book": {
            "type": "object",
            "properties": {
                "title": NAME,
                "isbn": {"type": "string", "pattern": "^97[89]-[0-9]{10}$"},
                "authors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2},
            },
            "required": ["title", "isbn", "authors"],
        },
        "event": {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^2024-(0[1-9]|1[0-2])-[0-2][0-9]$"},
                "public": {"type": "boolean"},
                "venue": {"$ref": "#/$defs/venue"},
            },
            "required": ["date", "public", "venue"],
            "$defs": {
                "venue": {
                    "type": "object",
                    "properties": {"city": NAME, "indoor": {"type": "boolean"}},
                    "required": ["city", "indoor"],
                }
            },
        },
        "numeric_enum_rating": {
            "type": "object",
            "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}, "would_recommend": {"type": "boolean"}},
            "required": ["stars", "would_recommend"],
        },
        "nested_lists": {
            "type": "object",
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 2},
                }
            },
            "required": ["groups"],
        },
    }
)

# unbounded integers and numbers, and a maxLength: lm-format-enforcer takes these through
# tokenloom's exact number and string rules (its own admit 1e-5 as an integer, and leading
# spaces past maxLength)
SCHEMAS.update(
    {
        "measurement": {
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "price": {"type": "number"},
                "label": {"type": "string", "maxLength": 8},
            },
            "required": ["count", "price", "label"],
        },
        "readings": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
        "short_words": {
            "type": "object",
            "properties": {
                "first": {"type": "string", "minLength": 2, "maxLength": 4},
                "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
            },
            "required": ["first", "ids"],
        },
    }
)

REGEXES: dict[str, str] = {
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "email": r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)",
    "iso_date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])",
    "hex_colour": r"#[0-9a-f]{6}",
    "yes_no": r"(yes|no)",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    "word_list": r"[a-z]{1,6}(, [a-z]{1,6}){0,3}",
    "signed_decimal": r"-?(0|[1-9][0-9]{0,4})\.[0-9]{1,3}",
    "time": r"([01][0-9]|2[0-3]):[0-5][0-9]",
    "version": r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}",
}

CHOICES: dict[str, list[str]] = {
    "sentiment": ["positive", "negative", "neutral"],
    "yes_no": ["yes", "no"],
    "prefixes": ["a", "ab", "abc"],
    "special_chars": ["C++", "C#", "a.b", "(x|y)", 'say "hi"'],
    "unicode": ["café", "naïve", "日本"],
    "spaces": ["New York", "Los Angeles", " leading"],
}

GRAMMAR_EBNF = r"""
root ::= sentence
sentence ::= subject " " verb " " object "."
subject ::= "The cat" | "A dog" | "My friend"
verb ::= "sees" | "likes" | "chases"
object ::= "the ball" | "a bird" | "the moon"
"""
GRAMMAR_LARK = r"""
start: NUMBER OP NUMBER "=" NUMBER
OP: "+" | "-"
NUMBER: /[1-9][0-9]?/
"""
