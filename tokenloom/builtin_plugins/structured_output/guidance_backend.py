"""The ``guidance`` guided-decoding backend (vLLM's name), on llguidance: JSON schemas, any JSON
object, regexes, choices, Lark or GBNF grammars and vLLM's structural tags (``structures`` /
``triggers``) become llguidance grammars; an Earley parser over a lazy lexer computes each
sequence's mask natively (``fill_next_token_bitmask``), with no compile step over the
vocabulary.

llguidance refuses the JSON-schema keywords it does not implement (``uniqueItems``, ``not``,
``if``/``then``, ``contains``, overlapping ``oneOf`` branches, unknown ``format`` names, ...)
instead of ignoring them, so asking it whether a schema compiles is exactly asking whether
every output will be valid; ``supports`` does that (a few milliseconds, no tokenizer)."""

from __future__ import annotations

import json
import threading
from typing import Any

from tokenloom.builtin_plugins.structured_output.common import rewrite_schema, schema_keywords
from tokenloom.core.structured_output import Matcher, StructuredOutputBackend
from tokenloom.core.structured_output_constraints import Constraint
from tokenloom.errors import InvalidRequestError

# at most this many whitespace characters between two JSON tokens, like xgrammar's bound:
# unbounded, small models at high temperature can emit whitespace until max_tokens. The
# lexer takes whitespace greedily, so one gap is one run of at most this many.
MAX_JSON_WHITESPACE = 32
_FLEXIBLE_WHITESPACE = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
_COMPACT = {"whitespace_flexible": False}
# a schema's own "x-guidance" options sit between llguidance's defaults and these overrides:
# never let a schema turn on leniency (ignoring keywords) or oneOf-as-anyOf, either of which
# would let invalid output through
_STRICT = {"lenient": False, "coerce_one_of": False}


def _listed_properties_only(schema: Any) -> Any:
    """A copy of ``schema`` where an object schema that lists ``properties`` and says nothing of
    ``additionalProperties`` gets ``false``: like xgrammar, generate only the properties the
    schema names (always valid, since extra properties are optional). llguidance would
    otherwise add properties of any name and value, and a small model sampling at high
    temperature can go on adding them until max_tokens. A bare ``{"type": "object"}`` stays
    open. vLLM's ``disable_additional_properties`` closes those too.

    A schema with ``allOf`` is left as it is: its branches' properties merge, and closing each
    branch would make them exclude each other."""
    if "allOf" in schema_keywords(schema):
        return schema
    return rewrite_schema(schema, _close_listed_object)


def _close_listed_object(node: dict) -> dict:
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def _json_options(constraint: Constraint) -> dict[str, Any]:
    return {**(_FLEXIBLE_WHITESPACE if constraint.any_whitespace else _COMPACT), **_STRICT}


def _one_line(messages: list[str]) -> str:
    """llguidance's messages on one line (they span several, pointing into the grammar)."""
    text = " ".join(" ".join(messages).split())
    return text[:500] or "rejected"


class GuidanceMatcher(Matcher):
    def __init__(self, matcher: Any, eos_token_ids: list[int]):
        self._matcher = matcher
        self._eos_token_ids = eos_token_ids
        # end-of-sequence tokens stay outside llguidance: once its grammar has stopped it takes
        # one without recording it, so its rollback would then undo a real token instead
        self._terminated = False

    def fill_bitmask(self, bitmask, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, bitmask, row)
        if self._matcher.is_error():  # a parser limit hit mid-way: fail this request, loudly
            raise RuntimeError(self._matcher.get_error())

    def accept_token(self, token_id: int) -> bool:
        if token_id in self._eos_token_ids:
            if self._terminated or not (self._matcher.is_accepting() or self._matcher.is_stopped()):
                return False
            self._terminated = True
            return True
        # consuming a token the grammar refuses would put the matcher in a permanent error
        # state; the contract is "refused, state unchanged", so ask first
        if self._terminated or self._matcher.validate_tokens([token_id]) != 1:
            return False
        return bool(self._matcher.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if self._terminated and num_tokens > 0:
            self._terminated = False
            num_tokens -= 1
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._matcher.reset()
        self._terminated = False


class GuidanceBackend(StructuredOutputBackend):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def supports(self, constraint: Constraint) -> str | None:
        if constraint.whitespace_pattern is not None:
            # llguidance skips its whitespace pattern zero or more times between tokens, not
            # exactly once as outlines does, so a pattern such as "[ ]{2}" would mean another thing
            return "guidance takes no whitespace pattern (set disable_any_whitespace, or use outlines)"
        if self.tokenizer is not None and getattr(self.tokenizer, "backend_tokenizer", None) is None:
            return "guidance needs a fast (Hugging Face tokenizers) tokenizer"
        if constraint.kind == "structural_tag" and "structures" not in constraint.spec:
            return "guidance takes structural tags in vLLM's form (structures and triggers) only; use xgrammar"
        if constraint.kind == "json":
            from llguidance import LLMatcher

            try:
                grammar = LLMatcher.grammar_from_json_schema(
                    json.dumps(_listed_properties_only(constraint.spec)), overrides=_json_options(constraint)
                )
            except ValueError as exc:
                return f"guidance cannot read the JSON schema: {exc}"
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
            if is_error:
                return f"guidance cannot enforce this JSON schema: {_one_line(messages)}"
        return None

    def ll_tokenizer(self):
        """llguidance's view of the vocabulary (built once, about half a second)."""
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance.hf import from_tokenizer

                self._ll_tokenizer = from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
                )
            return self._ll_tokenizer

    def grammar(self, constraint: Constraint) -> str:
        """The llguidance grammar (a string) for ``constraint``."""
        from llguidance import LLMatcher, StructTag, grammar_from

        kind, spec = constraint.kind, constraint.spec
        if kind in ("json", "json_object"):
            schema = _listed_properties_only(spec) if kind == "json" else {"type": "object"}
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_json_options(constraint))
        if kind == "regex":
            return grammar_from("regex", spec)
        if kind == "choice":
            return grammar_from("choice", json.dumps(list(spec)))
        if kind == "grammar":
            # GBNF ("root ::= ...") is converted to Lark; Lark is taken as it is
            return grammar_from("grammar", spec)
        if kind == "structural_tag":
            return self._structural_tag_grammar(spec, StructTag)
        raise InvalidRequestError(f"guidance does not know the constraint kind {kind!r}", param="structured_outputs")

    def _structural_tag_grammar(self, spec: dict, struct_tag: Any) -> str:
        triggers = spec.get("triggers") or []
        structures = spec.get("structures") or []
        if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
            raise InvalidRequestError(
                "structural_tag.triggers must be a list of non-empty strings", param="structural_tag"
            )
        if not isinstance(structures, list) or not structures:
            raise InvalidRequestError("structural_tag.structures must be a non-empty list", param="structural_tag")
        tags = []
        for index, item in enumerate(structures):
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("begin"), str)
                or not isinstance(item.get("end"), str)
            ):
                raise InvalidRequestError(
                    f"structural_tag.structures[{index}] needs begin and end strings", param="structural_tag"
                )
            trigger = next((t for t in triggers if item["begin"].startswith(t)), None)
            if trigger is None:
                raise InvalidRequestError(
                    f"structural_tag.structures[{index}].begin {item['begin']!r} starts with none of the triggers "
                    f"{triggers}",
                    param="structural_tag",
                )
            schema = item.get("schema", {})
            if not isinstance(schema, dict):
                raise InvalidRequestError(
                    f"structural_tag.structures[{index}].schema must be a JSON schema object", param="structural_tag"
                )
            # the same whitespace bound and strictness as a top-level JSON schema
            schema = _listed_properties_only(schema)
            schema = {**schema, "x-guidance": {**(schema.get("x-guidance") or {}), **_FLEXIBLE_WHITESPACE, **_STRICT}}
            tags.append(struct_tag(trigger=trigger, begin=item["begin"], grammar=schema, end=item["end"]))
        # a trigger that is one special token of the vocabulary is matched as that token;
        # others (plain text such as "<call>" in most vocabularies) as text
        special = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        special.update(
            token.content
            for token in (getattr(self.tokenizer, "added_tokens_decoder", {}) or {}).values()
            if getattr(token, "special", False)
        )
        return struct_tag.to_grammar(tags, assume_special=all(trigger in special for trigger in triggers))

    def compile(self, constraint: Constraint) -> Any:
        """A pristine llguidance matcher at the start of the grammar; sequences get deep copies
        (building an LLMatcher re-compiles the grammar, copying one does not)."""
        from llguidance import LLMatcher

        grammar = self.grammar(constraint)
        tokenizer = self.ll_tokenizer()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidRequestError(
                f"guidance cannot compile {constraint.describe()}: {_one_line(messages)}", param="structured_outputs"
            )
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"guidance cannot compile {constraint.describe()}: {_one_line([matcher.get_error()])}",
                param="structured_outputs",
            )
        return matcher

    def new_matcher(self, compiled: Any) -> Matcher:
        return GuidanceMatcher(compiled.deep_copy(), self.eos_token_ids)
