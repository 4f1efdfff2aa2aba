"""The ``lm-format-enforcer`` guided-decoding backend: JSON schemas, any JSON object, regexes
and choices as lm-format-enforcer character-level parsers; each sequence owns a
``TokenEnforcer`` that walks the tokenizer's prefix tree (pure Python: the slowest backend
per token, but it needs no compile step). No grammars.

Tokens that are not whole UTF-8 text are left out of the vocabulary (lm-format-enforcer reads
each token as characters), and for JSON masks keep raw control characters out of strings,
which its string rule would admit. Its JSON number and string rules are replaced by exact ones
(lm_format_enforcer_json), so integers, numbers and ``maxLength`` are served."""

from __future__ import annotations

import threading
from typing import Any

from tokenloom.builtin_plugins.structured_output.common import (
    KEYWORDS_REGEX_BACKENDS_IGNORE,
    JsonControlByteFilter,
    decoder_kind,
    enumerate_integer_ranges,
    rewrite_schema,
    subschemas,
    token_bytes,
    unsupported_keywords_reason,
)
from tokenloom.core.structured_output import Matcher, StructuredOutputBackend, allocate_bitmask
from tokenloom.core.structured_output_constraints import Constraint

# what lm-format-enforcer's JSON parser does not enforce: outputs could break these (small
# integer ranges are enforced anyway, as enums)
UNSUPPORTED_JSON_KEYWORDS = KEYWORDS_REGEX_BACKENDS_IGNORE | {"oneOf", "prefixItems", "format"}


class LMFormatEnforcerMatcher(Matcher):
    def __init__(self, tokenizer_data: Any, compiled: tuple[Any, int | None, Any], eos_token_ids: list[int]):
        from lmformatenforcer import TokenEnforcer

        parser, max_whitespaces, self._json_filter = compiled
        self._enforcer = TokenEnforcer(tokenizer_data, parser)
        if max_whitespaces is not None:
            # TokenEnforcer just replaced the parser's config with its own
            parser.config.max_consecutive_whitespaces = max_whitespaces
        self._eos_token_ids = eos_token_ids
        # the enforcer is keyed by the whole token sequence and caches every prefix it saw
        self._token_ids: list[int] = []
        self._terminated = False

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row].copy_(self._enforcer.get_allowed_tokens(self._token_ids).allowed_tokens)
        if self._json_filter is not None:
            self._json_filter.apply(bitmask[row])

    def accept_token(self, token_id: int) -> bool:
        if not self._enforcer.get_allowed_tokens(self._token_ids).is_token_allowed(token_id):
            return False
        if token_id in self._eos_token_ids:
            state = self._enforcer.prefix_states.get(tuple(self._token_ids))
            if state is not None and not state.parser.can_end():
                # lm-format-enforcer answers an internal error with "only end-of-sequence" (and
                # a log line): ending here would pass off unfinished output as complete
                raise RuntimeError("lm-format-enforcer failed inside its parser and allowed only the end")
            self._terminated = True
        else:
            self._token_ids.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens > 0:
            del self._token_ids[-num_tokens:]

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._token_ids = []
        self._terminated = False


# Found by walking its masks at random and validating what came out (tests/builtin_plugins/
# structured_output): these schema shapes let invalid JSON through.
OPEN_OBJECT_REASON = (
    "lm-format-enforcer can close an object right after a comma when a property is optional "
    "or the object has no fixed properties; make every property required"
)
CONST_REASON = "lm-format-enforcer takes a const that is a string or a number only; use an enum, or xgrammar"


def _numeric_consts_as_enums(schema: Any) -> Any:
    """A copy of ``schema`` where ``const: 5`` is ``enum: [5]``: lm-format-enforcer's const rule
    reads its value as a string, and its enum rule writes numbers."""
    return rewrite_schema(schema, _numeric_const_as_enum)


def _numeric_const_as_enum(node: dict) -> dict:
    value = node.get("const")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        del node["const"]
        node["enum"] = [item for item in node.get("enum", [value]) if item == value and not isinstance(item, bool)]
    return node


def lm_format_enforcer_schema(schema: Any) -> Any:
    """The schema as handed to lm-format-enforcer (and checked against its limits)."""
    return _numeric_consts_as_enums(enumerate_integer_ranges(schema))


def _unsupported_node(node: dict) -> str | None:
    types = node.get("type")
    if isinstance(types, list) and set(node) - {"type", "title", "description"}:
        return "lm-format-enforcer drops the other keywords of a schema whose type is a list; use anyOf"
    types = set(types) if isinstance(types, list) else {types}
    if "const" in node and not isinstance(node["const"], str):  # numeric ones are enums by now
        return CONST_REASON
    if "array" in types and not isinstance(node.get("items"), dict):
        return "lm-format-enforcer needs a schema for array items"
    if "object" in types or "properties" in node:
        properties = node.get("properties")
        if not isinstance(properties, dict) or set(properties) - set(node.get("required") or []):
            return OPEN_OBJECT_REASON
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        return "lm-format-enforcer cannot combine a string pattern with minLength or maxLength"
    if "enum" in node:
        values = node["enum"]
        if not values:
            return "the schema allows no value here (an empty enum, or a const outside the enum)"
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if not (numbers or all(isinstance(v, str) for v in values)):
            return "lm-format-enforcer needs enum values that are all strings or all numbers"
    return None


class LMFormatEnforcerBackend(StructuredOutputBackend):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._tokenizer_data = None
        self._json_filter = None
        self._lock = threading.Lock()

    def supports(self, constraint: Constraint) -> str | None:
        if constraint.kind in ("grammar", "structural_tag"):
            return f"lm-format-enforcer has no {constraint.kind.replace('_', ' ')}s; use xgrammar"
        if constraint.kind == "json_object":
            return OPEN_OBJECT_REASON
        if constraint.whitespace_pattern is not None:
            return "lm-format-enforcer takes no whitespace pattern (use outlines)"
        if constraint.kind == "json":
            schema = lm_format_enforcer_schema(constraint.spec)
            return unsupported_keywords_reason("lm-format-enforcer", schema, UNSUPPORTED_JSON_KEYWORDS) or next(
                filter(None, map(_unsupported_node, subschemas(schema))), None
            )
        return None

    def tokenizer_data(self):
        """lm-format-enforcer's prefix tree of the vocabulary (built once, a few seconds)."""
        with self._lock:
            if self._tokenizer_data is None:
                from lmformatenforcer import TokenEnforcerTokenizerData

                # what lm-format-enforcer's transformers integration computes, from token bytes (its
                # own helper imports a module transformers 5 no longer has)
                starts_words = decoder_kind(self.tokenizer) == "sentencepiece"
                regular_tokens = []
                for token_id, text in enumerate(token_bytes(self.tokenizer, self.vocab_size)):
                    if text is None or token_id in self.eos_token_ids:
                        continue
                    try:
                        string = text.decode("utf-8")
                    except UnicodeDecodeError:
                        continue
                    regular_tokens.append((token_id, string, starts_words and string.startswith(" ")))
                tokenizer = self.tokenizer

                def decode(token_ids: list[int]) -> str:
                    return tokenizer.decode(token_ids).rstrip("\ufffd")

                self._tokenizer_data = TokenEnforcerTokenizerData(
                    regular_tokens, decode, list(self.eos_token_ids), True, self.vocab_size
                )
                self._json_filter = JsonControlByteFilter(self.tokenizer, self.vocab_size)
            return self._tokenizer_data

    def compile(self, constraint: Constraint) -> tuple[Any, int | None, Any]:
        """(parser, the maximum run of whitespace in JSON or None for the default, the JSON
        control-byte filter or None)."""
        from lmformatenforcer import RegexParser, StringParser, UnionParser

        from tokenloom.builtin_plugins.structured_output.lm_format_enforcer_json import StrictJsonSchemaParser

        kind = constraint.kind
        max_whitespaces = None
        if kind in ("json", "json_object"):
            schema = lm_format_enforcer_schema(constraint.spec) if kind == "json" else {"type": "object"}
            parser = StrictJsonSchemaParser.for_schema(schema)
            max_whitespaces = None if constraint.any_whitespace else 0
        elif kind == "regex":
            parser = RegexParser(constraint.spec)
        else:
            parser = UnionParser([StringParser(choice) for choice in constraint.spec])
        self.tokenizer_data()
        compiled = (parser, max_whitespaces, self._json_filter if kind in ("json", "json_object") else None)
        # the first step's allowed tokens: schema and regex errors surface now, not mid-request
        self.new_matcher(compiled).fill_bitmask(allocate_bitmask(1, self.vocab_size), 0)
        return compiled

    def new_matcher(self, compiled: tuple[Any, int | None, Any]) -> Matcher:
        return LMFormatEnforcerMatcher(self.tokenizer_data(), compiled, self.eos_token_ids)
