"""A guided-decoding constraint as a request gives it and as a backend compiles it: the
:class:`Constraint`, the server's :class:`BackendOptions` (``--guided-decoding-backend``'s option
syntax), and :func:`parse_constraint`, which checks a request's ``structured_outputs`` dict
against the size and depth limits (before anything recursive reads it) and the JSON-schema
meta-schema, and normalises it into one :class:`Constraint`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import ConfigError, InvalidRequestError

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
CONSTRAINT_OPTIONS = (
    "backend",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)
# backend option words of vLLM's syntax, "xgrammar:disable-any-whitespace,no-fallback"
BACKEND_OPTION_WORDS = {
    "no-fallback": "disable_fallback",
    "disable-fallback": "disable_fallback",
    "disable-any-whitespace": "disable_any_whitespace",
    "no-additional-properties": "disable_additional_properties",
    "disable-additional-properties": "disable_additional_properties",
}
AUTO = "auto"
# a constraint's text (schema, regex, grammar, ...) longer than this is refused unread
MAX_CONSTRAINT_CHARS = 256 * 1024
# JSON nesting (objects and arrays, the outermost one counts 1) of a schema or structural
# tag: deeper is a 400 before any recursive walk (jsonschema's check, the backends' compilers)
# can run out of stack; OpenAI allows 10 levels of object nesting, which is 20 or so here
MAX_CONSTRAINT_DEPTH = 64


@dataclass(frozen=True)
class Constraint:
    """One request's constraint, normalised. ``spec`` holds, by ``kind``: ``json`` a schema
    dict, ``json_object`` None, ``regex`` and ``grammar`` a string, ``choice`` a tuple of
    strings, ``structural_tag`` a dict (xgrammar's structural-tag format)."""

    kind: str
    spec: Any
    any_whitespace: bool = True
    # a regex for the whitespace between JSON tokens (outlines' guided_whitespace_pattern)
    whitespace_pattern: str | None = None

    @functools.cached_property
    def key(self) -> str:
        """Canonical text: equal constraints have equal keys (the compile cache's key). Cached:
        first read when the constraint is checked, in the compile pool, never on the loop."""
        spec = list(self.spec) if isinstance(self.spec, tuple) else self.spec
        return json.dumps([self.kind, spec, self.any_whitespace, self.whitespace_pattern], sort_keys=True)

    def describe(self) -> str:
        return {
            "json": "a JSON schema",
            "json_object": "any JSON object",
            "regex": "a regex",
            "choice": "a choice",
            "grammar": "a grammar",
            "structural_tag": "a structural tag",
        }[self.kind]


@dataclass(frozen=True)
class BackendOptions:
    """Settings from ``--guided-decoding-*`` (and the backend's option syntax)."""

    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


def parse_backend_option(value: str) -> tuple[str, BackendOptions]:
    """``"xgrammar:disable-any-whitespace,no-fallback"`` -> ("xgrammar", options)."""
    name, _, words = (value or AUTO).partition(":")
    settings: dict[str, bool] = {}
    for word in filter(None, (w.strip() for w in words.split(","))):
        if word not in BACKEND_OPTION_WORDS:
            raise ConfigError(
                f"--guided-decoding-backend: unknown option {word!r} in {value!r}; known: "
                + ", ".join(BACKEND_OPTION_WORDS),
                param="guided-decoding-backend",
            )
        settings[BACKEND_OPTION_WORDS[word]] = True
    return name.strip() or AUTO, BackendOptions(**settings)


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="structured_outputs")


def check_size_and_depth(value: Any, what: str) -> None:
    """A 400 when ``value`` (JSON-like data, or a string) would be longer than
    MAX_CONSTRAINT_CHARS as JSON text or nests deeper than MAX_CONSTRAINT_DEPTH. Iterative, and
    it stops as soon as a limit is passed, so a huge or deep value costs no more than a small
    one; what it counts is a lower bound of the JSON text's length."""
    num_chars = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            depth += 1
            if depth > MAX_CONSTRAINT_DEPTH:
                raise _bad(
                    f"{what} nests deeper than {MAX_CONSTRAINT_DEPTH} levels of objects and arrays; "
                    "flatten it (for example with $defs and $ref)"
                )
            if isinstance(node, dict):
                num_chars += 2 + 4 * len(node)  # braces, and each key's quotes, colon and comma
                for key, child in node.items():
                    num_chars += len(key) if isinstance(key, str) else 1
                    stack.append((child, depth))
            else:
                num_chars += 2 + len(node)
                stack.extend((child, depth) for child in node)
        elif isinstance(node, str):
            num_chars += len(node)
        else:
            num_chars += 1
        if num_chars > MAX_CONSTRAINT_CHARS:
            raise _bad(f"{what} is longer than {MAX_CONSTRAINT_CHARS} characters of JSON; send a smaller one")


def _json_object(value: Any, what: str) -> dict[str, Any]:
    """``value`` (a dict, or a string of JSON) as a dict; a 400 naming ``what`` otherwise."""
    if isinstance(value, str):
        check_size_and_depth(value, what)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _bad(f"{what} is not valid JSON: {exc}") from None
        except RecursionError:
            raise _bad(f"{what} nests deeper than {MAX_CONSTRAINT_DEPTH} levels of objects and arrays") from None
        check_size_and_depth(value, what)  # its depth (the text's length was checked)
    if not isinstance(value, dict):
        raise _bad(f"{what} must be a JSON object, got {type(value).__name__}")
    return dict(value)


def _json_schema(value: Any) -> dict[str, Any]:
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        value = value.model_json_schema()  # a pydantic model class
    schema = _json_object(value, "the JSON schema")
    try:
        import jsonschema
    except ImportError:  # the backends still reject what they cannot compile
        return schema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        raise _bad(f"invalid JSON schema{' at ' + where if where else ''}: {exc.message}") from None
    except RecursionError:  # within MAX_CONSTRAINT_DEPTH this does not happen; never a 500
        raise _bad("the JSON schema nests too deeply to check; flatten it (for example with $defs and $ref)") from None
    return schema


def forbid_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``additionalProperties: false`` (``--guided-decoding-disable-additional-properties``)."""
    if isinstance(schema, list):
        return [forbid_additional_properties(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    copy = {
        key: forbid_additional_properties(value) if key not in ("enum", "const", "default", "examples") else value
        for key, value in schema.items()
    }
    if (copy.get("type") == "object" or "properties" in copy) and "additionalProperties" not in copy:
        copy["additionalProperties"] = False
    return copy


def parse_constraint(request: dict[str, Any], defaults: BackendOptions) -> tuple[Constraint, str | None, bool]:
    """A ``SamplingParams.structured_outputs`` dict -> (constraint, requested backend or None,
    fallback disabled). Raises InvalidRequestError naming what to change."""
    if not isinstance(request, dict):
        raise _bad(f"structured_outputs must be an object, got {type(request).__name__}")
    unknown = sorted(set(request) - set(CONSTRAINT_KINDS) - set(CONSTRAINT_OPTIONS))
    if unknown:
        raise _bad(
            f"unknown structured_outputs key(s) {', '.join(unknown)}; known: "
            + ", ".join(CONSTRAINT_KINDS + CONSTRAINT_OPTIONS)
        )
    given = [kind for kind in CONSTRAINT_KINDS if request.get(kind) not in (None, False)]
    if len(given) != 1:
        raise _bad(
            "give exactly one constraint ("
            + " | ".join(CONSTRAINT_KINDS)
            + "), got "
            + (", ".join(given) if given else "none")
        )
    kind = given[0]
    value = request[kind]
    if isinstance(value, (str, dict, list, tuple)):
        # before anything else reads it: a huge or deep value is refused at the cost of a small one
        check_size_and_depth(value, f"the {kind} constraint")
    whitespace_pattern = request.get("whitespace_pattern")
    if whitespace_pattern is not None and not isinstance(whitespace_pattern, str):
        raise _bad("whitespace_pattern must be a string (a regex)")
    any_whitespace = not (request.get("disable_any_whitespace") or defaults.disable_any_whitespace)
    if kind == "json":
        value = _json_schema(value)
        if request.get("disable_additional_properties") or defaults.disable_additional_properties:
            value = forbid_additional_properties(value)
    elif kind == "json_object":
        value = None
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise _bad(f"{kind} must be a non-empty string")
    elif kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
            raise _bad("choice must be a non-empty list of strings")
        value = tuple(value)
    elif kind == "structural_tag":
        value = _json_object(value, "structural_tag")
    if kind not in ("json", "json_object"):
        whitespace_pattern = None  # only JSON has optional whitespace
    backend = request.get("backend")
    if backend is not None and not isinstance(backend, str):
        raise _bad("backend must be a string")
    constraint = Constraint(kind, value, any_whitespace=any_whitespace, whitespace_pattern=whitespace_pattern)
    if len(constraint.key) > MAX_CONSTRAINT_CHARS:
        raise _bad(
            f"the {kind} constraint is {len(constraint.key)} characters long; at most "
            f"{MAX_CONSTRAINT_CHARS} are allowed"
        )
    return constraint, backend or None, bool(request.get("disable_fallback"))


__all__ = [
    "BackendOptions",
    "Constraint",
    "check_size_and_depth",
    "forbid_additional_properties",
    "parse_backend_option",
    "parse_constraint",
]
