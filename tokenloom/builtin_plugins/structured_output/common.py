"""What the built-in guided-decoding backends share: which JSON-schema keywords a schema
uses, regexes for a list of choices, and each token's bytes (the vocabulary that
regex-automaton backends index)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from tokenloom.plugin_api import bytes_to_unicode

# keywords whose values are subschemas (or maps / lists of them)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)


def schema_keywords(schema: Any) -> set[str]:
    """Every keyword used anywhere in ``schema`` (property names are not keywords)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            found.add(key)
            if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
                for child in value.values():
                    walk(child)
            elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
                for child in value:
                    walk(child)
            elif key in _SUBSCHEMAS:
                for child in value if isinstance(value, list) else [value]:
                    walk(child)

    walk(schema)
    return found


# JSON-schema keywords that no built-in backend enforces (xgrammar ignores exactly these)
KEYWORDS_NO_BACKEND_ENFORCES = frozenset(
    {
        "multipleOf",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
        "unevaluatedItems",
        "propertyNames",
    }
)
# ...and what schema-to-regex/parser enforcement (outlines, lm-format-enforcer) ignores too;
# small integer ranges are enforced anyway, as enums
KEYWORDS_REGEX_BACKENDS_IGNORE = KEYWORDS_NO_BACKEND_ENFORCES | {
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "patternProperties",
    "minProperties",
    "maxProperties",
    "allOf",
}


def unsupported_keywords_reason(backend: str, schema: Any, unsupported: set[str]) -> str | None:
    used = sorted(schema_keywords(schema) & unsupported)
    if not used:
        return None
    return f"{backend} cannot enforce the JSON-schema keyword(s) {', '.join(used)}"


def subschemas(schema: Any):
    """Every schema object in ``schema``, the root included."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            for child in value.values():
                yield from subschemas(child)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            for child in value:
                yield from subschemas(child)
        elif key in _SUBSCHEMAS:
            for child in value if isinstance(value, list) else [value]:
                yield from subschemas(child)


# an integer schema bounded on both sides with at most this many values becomes an enum, which
# backends without numeric bounds (outlines, lm-format-enforcer) enforce
MAX_ENUMERATED_INTEGERS = 256
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# keywords whose values are data, not schemas
_DATA_KEYWORDS = ("enum", "const", "default", "examples")


def rewrite_schema(schema: Any, rewrite: Callable[[dict], dict]) -> Any:
    """A copy of ``schema`` with ``rewrite`` applied to every object in it, innermost first (an
    object's children are rewritten before it); the values of data keywords (``enum``,
    ``const``, ``default``, ``examples``) are copied as they are. ``rewrite`` gets a copy of
    each object, which it may change in place."""
    if isinstance(schema, list):
        return [rewrite_schema(item, rewrite) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return rewrite(
        {key: value if key in _DATA_KEYWORDS else rewrite_schema(value, rewrite) for key, value in schema.items()}
    )


def enumerate_integer_ranges(schema: Any) -> Any:
    """A copy of ``schema`` where each small bounded integer range is an ``enum`` of its values
    (``{"type": "integer", "minimum": 1, "maximum": 5}`` -> ``enum [1, 2, 3, 4, 5]``)."""
    return rewrite_schema(schema, _enumerate_integer_range)


def _enumerate_integer_range(node: dict) -> dict:
    values = _integer_range(node)
    if values is None:
        return node
    if "enum" in node:
        values = [value for value in node["enum"] if value in values]
    bounded = {key: value for key, value in node.items() if key not in _BOUNDS}
    bounded["enum"] = values
    return bounded


def _integer_range(node: dict) -> list[int] | None:
    if node.get("type") != "integer" or not any(key in node for key in _BOUNDS[:4]):
        return None
    bounds = [node.get(key) for key in _BOUNDS]
    if not all(value is None or isinstance(value, (int, float)) and not isinstance(value, bool) for value in bounds):
        return None
    low = [math.ceil(node["minimum"])] if "minimum" in node else []
    low += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
    high = [math.floor(node["maximum"])] if "maximum" in node else []
    high += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
    if not low or not high or not 0 < min(high) - max(low) + 1 <= MAX_ENUMERATED_INTEGERS:
        return None
    step = node.get("multipleOf")
    values = [value for value in range(max(low), min(high) + 1) if not step or value % step == 0]
    return values or None


_REGEX_SPECIAL = set("\\.^$|?*+()[]{}-&~#")


def escape_regex(text: str) -> str:
    """``text`` as a regex matching exactly itself, in the syntax that Python's ``re``, Rust's
    ``regex`` (outlines-core) and interegular (lm-format-enforcer) all read the same way."""
    parts = []
    for char in text:
        if char in _REGEX_SPECIAL:
            parts.append("\\" + char)
        elif char == "\n":
            parts.append("\\n")
        elif char == "\t":
            parts.append("\\t")
        elif char == "\r":
            parts.append("\\r")
        else:
            parts.append(char)
    return "".join(parts)


def choice_regex(choices: tuple[str, ...] | list[str]) -> str:
    return "(" + "|".join(escape_regex(choice) for choice in choices) + ")"


def ebnf_string(text: str) -> str:
    """A GBNF/xgrammar EBNF string literal for ``text``."""
    return json.dumps(text, ensure_ascii=False)


# -- token bytes ---------------------------------------------------------------------------


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each printable character stands for."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def decoder_kind(tokenizer: Any) -> str:
    """ "byte_level" (GPT-2 style), "sentencepiece" (▁ for spaces, <0xNN> byte tokens) or "raw"."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
        except Exception:
            decoder = {}
        text = json.dumps(decoder)
        if '"ByteLevel"' in text:
            return "byte_level"
        if '"ByteFallback"' in text or '"Metaspace"' in text or "\u2581" in text:
            return "sentencepiece"
        return "raw"
    vocab = tokenizer.get_vocab()
    if any(token.startswith("\u2581") for token in list(vocab)[:2000]):
        return "sentencepiece"
    return "raw"


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id stands for in generated text; None for special tokens and ids
    the tokenizer does not have (they are never allowed under a constraint)."""
    kind = decoder_kind(tokenizer)
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special_ids.update(token_id for token_id, token in added.items() if getattr(token, "special", False))
    byte_decoder = _gpt2_byte_decoder() if kind == "byte_level" else {}
    result: list[bytes | None] = [None] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if not 0 <= token_id < vocab_size or token_id in special_ids:
            continue
        if kind == "byte_level":
            try:
                result[token_id] = bytes(byte_decoder[char] for char in token)
            except KeyError:  # an added token kept as plain text
                result[token_id] = token.encode("utf-8")
        elif kind == "sentencepiece":
            match = _BYTE_FALLBACK.match(token)
            result[token_id] = bytes([int(match.group(1), 16)]) if match else token.replace("\u2581", " ").encode()
        else:
            result[token_id] = tokenizer.convert_tokens_to_string([token]).encode("utf-8")
    return result


class JsonControlByteFilter:
    """Keeps raw control characters out of JSON that xgrammar and lm-format-enforcer would let
    into some strings (xgrammar's length-bounded strings, every lm-format-enforcer string),
    where JSON parsers reject them.

    Outside strings a JSON whitespace token (``\\n``, ``\\t``, ``\\r``) is fine; no other
    control byte ever is. Inside a string none is. Whether a mask row is inside such a string
    shows in the row itself: it then admits a token that is a single non-whitespace control
    byte (a "sentinel"), which JSON allows nowhere else.
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        import torch

        from tokenloom.plugin_api import allocate_bitmask, set_allowed_tokens

        whitespace = {0x09, 0x0A, 0x0D}
        never, inside_only, sentinels = set(), set(), []
        for token_id, text in enumerate(token_bytes(tokenizer, vocab_size)):
            if text is None:
                continue
            controls = {byte for byte in text if byte < 0x20}
            if controls - whitespace:
                never.add(token_id)
                if len(text) == 1:
                    sentinels.append(token_id)
            elif controls:
                inside_only.add(token_id)
        words = allocate_bitmask(2, vocab_size)
        set_allowed_tokens(words[0], (t for t in range(vocab_size) if t not in never))
        set_allowed_tokens(words[1], (t for t in range(vocab_size) if t not in never and t not in inside_only))
        self._outside_string, self._inside_string = words[0], words[1]
        self._sentinel_words = torch.tensor([t // 32 for t in sentinels], dtype=torch.long)
        self._sentinel_bits = torch.tensor([1 << (t % 32) for t in sentinels], dtype=torch.int64)

    def apply(self, bitmask_row) -> None:
        """Restrict one filled mask row in place."""
        import torch

        inside = bool(self._sentinel_words.numel()) and bool(
            (bitmask_row.index_select(0, self._sentinel_words).to(torch.int64) & self._sentinel_bits).any()
        )
        bitmask_row.bitwise_and_(self._inside_string if inside else self._outside_string)
