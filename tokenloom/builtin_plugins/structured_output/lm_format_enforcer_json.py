"""lm-format-enforcer's JSON-schema parser with its number and string rules made exact, so that
every output it allows is valid JSON that the schema accepts:

- numbers follow JSON's grammar, ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?``, and
  integers its integer part alone (its own rule admits ``1e-5`` and ``-0.5`` as integers and
  ``1.e5`` as a number);
- whitespace right after a string's opening quote is part of the string (its rule skips it, so
  ``maxLength`` did not count it, and an enum value or pattern starting with a space could
  repeat the space without end);
- ``minLength`` counts what the string decodes to (an escape ``\\uXXXX`` may be half of a
  surrogate pair, one character for two escapes), over the tokenizer's whole alphabet.

:class:`StrictJsonSchemaParser` wraps lm-format-enforcer's ``JsonSchemaParser``: after every
character it swaps the number and string states the library just pushed for the subclasses
below (the library builds them by class name deep inside, with no hook to pass others)."""

from __future__ import annotations

import sys
from collections.abc import Hashable
from typing import Any

from lmformatenforcer import CharacterLevelParser, JsonSchemaParser
from lmformatenforcer.characterlevelparser import CharacterLevelParserConfig, UnionParser
from lmformatenforcer.consts import BACKSLASH, WHITESPACE_CHARACTERS
from lmformatenforcer.jsonschemaparser import NumberParsingState, StringParsingState

DIGITS = "0123456789"
NONZERO_DIGITS = "123456789"

# positions in JSON's number grammar
_START, _MINUS, _ZERO, _INTEGER, _POINT, _FRACTION, _EXPONENT, _EXPONENT_SIGN, _EXPONENT_DIGITS, _TRAILING = range(10)
# where a number may end (a digit was last, or whitespace after one)
_CAN_END = frozenset({_ZERO, _INTEGER, _FRACTION, _EXPONENT_DIGITS, _TRAILING})


def _copy_as(cls: type, state: Any) -> Any:
    """``state`` (a library parsing state) as an instance of its subclass ``cls``, same fields."""
    copy = cls.__new__(cls)
    copy.__dict__.update(state.__dict__)
    return copy


class JsonNumberState(NumberParsingState):
    """A JSON number (an integer when ``allow_floating_point`` is False), exactly."""

    position: int = _START

    def _clone(self) -> JsonNumberState:
        return _copy_as(JsonNumberState, self)

    def add_character(self, new_character: str) -> CharacterLevelParser:
        if self.position == _START and new_character in WHITESPACE_CHARACTERS:
            return self  # whitespace before the value
        new = self._clone()
        new.position = _next_position(self.position, new_character)
        if new.position != _TRAILING:
            new.parsed_string = self.parsed_string + new_character
        return new

    def get_allowed_characters(self) -> str:
        floating = self.allow_floating_point
        allowed = {
            _START: "-" + DIGITS + WHITESPACE_CHARACTERS,
            _MINUS: DIGITS,
            _ZERO: (".eE" if floating else "") + WHITESPACE_CHARACTERS,
            _INTEGER: DIGITS + (".eE" if floating else "") + WHITESPACE_CHARACTERS,
            _POINT: DIGITS,
            _FRACTION: DIGITS + "eE" + WHITESPACE_CHARACTERS,
            _EXPONENT: "+-" + DIGITS,
            _EXPONENT_SIGN: DIGITS,
            _EXPONENT_DIGITS: DIGITS + WHITESPACE_CHARACTERS,
            _TRAILING: WHITESPACE_CHARACTERS,
        }[self.position]
        return allowed

    def can_end(self) -> bool:
        return self.position in _CAN_END


def _next_position(position: int, character: str) -> int:
    """The grammar position after ``character`` (one get_allowed_characters admitted)."""
    if character in WHITESPACE_CHARACTERS:
        return _TRAILING
    if position in (_START, _MINUS):
        if character == "-":
            return _MINUS
        return _ZERO if character == "0" else _INTEGER
    if character == ".":
        return _POINT
    if character in "eE":
        return _EXPONENT
    if position == _EXPONENT and character in "+-":
        return _EXPONENT_SIGN
    if position in (_EXPONENT, _EXPONENT_SIGN, _EXPONENT_DIGITS):
        return _EXPONENT_DIGITS
    if position in (_POINT, _FRACTION):
        return _FRACTION
    return _INTEGER


class JsonStringState(StringParsingState):
    """A string whose leading whitespace is content and whose minLength counts decoded characters."""

    def _clone(self) -> JsonStringState:
        return _copy_as(JsonStringState, self)

    def _inside_quotes(self) -> bool:
        return self.require_opening_quote and self.seen_opening_quote and not self.seen_closing_quote

    def add_character(self, new_character: str):
        if new_character in WHITESPACE_CHARACTERS and not self.parsed_string and self._inside_quotes():
            # the library skips whitespace before a value, and inside the quotes it still looks
            # like the start: record it as the content it is
            new = self._clone()
            new.parsed_string = new_character
            if new.regex_parser is not None:
                new.regex_parser = new.regex_parser.add_character(new_character)
            return new
        return super().add_character(new_character)

    def min_decoded_length(self) -> int:
        """At least this many characters, decoded: ``parsed_string`` holds each escape as its
        backslash (the escape's letters go to another parser), and two escapes may be one
        surrogate pair."""
        num_escapes = self.parsed_string.count(BACKSLASH)
        return len(self.parsed_string) - num_escapes + (num_escapes + 1) // 2

    def get_allowed_characters(self) -> str:
        free_text = self._inside_quotes() and not self.regex_parser and not self.allowed_strings
        if free_text and self.min_length is not None and self.min_decoded_length() < self.min_length:
            # the alphabet in force (the tokenizer's, set by TokenEnforcer); the library's
            # alphabet_without_quotes is the default one from before, so a character outside it
            # ended the string unclosed
            return self.root.config.alphabet.replace('"', "") + BACKSLASH
        # otherwise the library's rule, which reads len(parsed_string) as the length: at least
        # the decoded length (each escape decodes to at most one character), so maxLength holds
        return super().get_allowed_characters()


def _tighten_state(state: CharacterLevelParser) -> CharacterLevelParser:
    if type(state) is NumberParsingState:
        number = _copy_as(JsonNumberState, state)
        number.position = _START
        for character in state.parsed_string:  # pushed this very step: empty in practice
            number = number.add_character(character)
        return number
    if type(state) is StringParsingState:
        return _copy_as(JsonStringState, state)
    if type(state) is UnionParser:
        options = [_tighten_state(option) for option in state.parsers]
        if all(new is old for new, old in zip(options, state.parsers)):
            return state
        return UnionParser(options)
    return state


def _tighten(parser: CharacterLevelParser) -> CharacterLevelParser:
    """``parser`` with every library number and string state on its stacks swapped for ours."""
    if isinstance(parser, JsonSchemaParser):
        # a fresh stack list per step (the library slices it), so replacing it is safe
        parser.object_stack = [_tighten_state(state) for state in parser.object_stack]
        return parser
    if isinstance(parser, UnionParser):
        return UnionParser([_tighten(option) for option in parser.parsers])
    return parser


def _free_text_key(parser: JsonSchemaParser) -> Hashable | None:
    """The library's shortcut for free text in a string (take the precomputed list of tokens
    that fit, by their length), made safe: its lengths are raw characters, and an escape
    inside a token that closes the string decodes to fewer, so while ``minLength`` is not met
    it must offer no token that closes the string."""
    key = parser.shortcut_key()
    if key is None:
        return None
    state = parser.object_stack[-1]
    kind, current_length, min_length, max_length = key
    if isinstance(state, JsonStringState) and state.min_length and state.min_decoded_length() < state.min_length:
        min_length = sys.maxsize  # no closing-quote token from the shortcut list
    return (kind, current_length, min_length, max_length)


class StrictJsonSchemaParser(CharacterLevelParser):
    """lm-format-enforcer's ``JsonSchemaParser`` with exact number and string rules."""

    def __init__(self, inner: CharacterLevelParser, config: CharacterLevelParserConfig | None = None):
        self.inner = _tighten(inner)
        self._config = config or getattr(inner, "config", None) or CharacterLevelParserConfig()

    @classmethod
    def for_schema(cls, schema: dict) -> StrictJsonSchemaParser:
        return cls(JsonSchemaParser(schema))

    @property
    def config(self) -> CharacterLevelParserConfig:
        return self._config

    @config.setter
    def config(self, new_config: CharacterLevelParserConfig) -> None:
        # TokenEnforcer sets its own on the root parser; the library's parser passes it on
        self._config = new_config
        self.inner.config = new_config

    def add_character(self, new_character: str) -> CharacterLevelParser:
        return StrictJsonSchemaParser(self.inner.add_character(new_character), self._config)

    def get_allowed_characters(self) -> str:
        return self.inner.get_allowed_characters()

    def can_end(self) -> bool:
        return self.inner.can_end()

    def shortcut_key(self) -> Hashable | None:
        if isinstance(self.inner, JsonSchemaParser):
            return _free_text_key(self.inner)
        if isinstance(self.inner, UnionParser) and all(isinstance(p, JsonSchemaParser) for p in self.inner.parsers):
            keys = {_free_text_key(option) for option in self.inner.parsers}
            return keys.pop() if len(keys) == 1 else None
        return None
