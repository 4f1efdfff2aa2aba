"""The ``xgrammar`` guided-decoding backend: JSON schemas, any JSON object, regexes, choices,
EBNF (GBNF-style) or Lark grammars and structural tags, compiled by xgrammar's
``GrammarCompiler``; matchers fill the bitmask natively (``fill_next_token_bitmask``).

For JSON: at most ``MAX_JSON_WHITESPACE`` whitespace characters between two tokens (unbounded,
small models at high temperature can emit whitespace until max_tokens), and masks keep raw
control characters out of strings (xgrammar's length-bounded string rule admits them)."""

from __future__ import annotations

import json
import threading
from typing import Any

from tokenloom.builtin_plugins.structured_output.common import (
    KEYWORDS_NO_BACKEND_ENFORCES,
    JsonControlByteFilter,
    ebnf_string,
    unsupported_keywords_reason,
)
from tokenloom.core.structured_output import Matcher, StructuredOutputBackend
from tokenloom.core.structured_output_constraints import Constraint
from tokenloom.errors import InvalidRequestError

MAX_JSON_WHITESPACE = 32
# without optional whitespace, JSON as compact as json.dumps(separators=(",", ":")), like the
# other backends (xgrammar's own default would keep one space after "," and ":")
COMPACT = (",", ":")

# JSON-schema keywords xgrammar ignores: outputs could break them, so such schemas go elsewhere
UNSUPPORTED_JSON_KEYWORDS = KEYWORDS_NO_BACKEND_ENFORCES


class XGrammarMatcher(Matcher):
    def __init__(self, grammar: Any, json_filter: JsonControlByteFilter | None = None):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(grammar)
        self._json_filter = json_filter

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._json_filter is not None:
            self._json_filter.apply(bitmask[row])

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def reset(self) -> None:
        self._matcher.reset()


class XGrammarBackend(StructuredOutputBackend):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._compiler = None
        self._json_filter = None
        self._lock = threading.Lock()

    def supports(self, constraint: Constraint) -> str | None:
        if constraint.whitespace_pattern is not None:
            return "xgrammar takes no whitespace pattern (set disable_any_whitespace, or use outlines)"
        if constraint.kind == "json":
            return unsupported_keywords_reason("xgrammar", constraint.spec, UNSUPPORTED_JSON_KEYWORDS)
        return None

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
                self._json_filter = JsonControlByteFilter(self.tokenizer, self.vocab_size)
            return self._compiler

    def compile(self, constraint: Constraint) -> tuple[Any, Any]:
        """(xgrammar's CompiledGrammar, the JSON control-byte filter or None)."""
        grammar = self._compile_grammar(constraint)
        return grammar, self._json_filter if constraint.kind in ("json", "json_object") else None

    def _compile_grammar(self, constraint: Constraint) -> Any:
        compiler = self.compiler()
        kind, spec = constraint.kind, constraint.spec
        if kind == "json":
            return compiler.compile_json_schema(
                json.dumps(spec),
                any_whitespace=constraint.any_whitespace,
                max_whitespace_cnt=MAX_JSON_WHITESPACE,
                separators=None if constraint.any_whitespace else COMPACT,
            )
        if kind == "json_object":
            # not strict: "an object" must admit any properties
            return compiler.compile_json_schema(
                '{"type": "object"}',
                any_whitespace=constraint.any_whitespace,
                strict_mode=False,
                max_whitespace_cnt=MAX_JSON_WHITESPACE,
                separators=None if constraint.any_whitespace else COMPACT,
            )
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(ebnf_string(choice) for choice in spec))
        if kind == "grammar":
            if "::=" in spec:
                return compiler.compile_grammar(spec)
            return compiler.compile_lark(spec)
        if kind == "structural_tag":
            return self._compile_structural_tag(compiler, spec)
        raise InvalidRequestError(f"xgrammar does not know the constraint kind {kind!r}", param="structured_outputs")

    @staticmethod
    def _compile_structural_tag(compiler, spec: dict) -> Any:
        import xgrammar

        if "structures" in spec:  # vLLM's first format: begin/schema/end items plus triggers
            tags = [
                xgrammar.StructuralTagItem(
                    begin=item["begin"], schema=json.dumps(item.get("schema", {})), end=item["end"]
                )
                for item in spec["structures"]
            ]
            return compiler.compile_structural_tag(tags, spec.get("triggers") or [])
        return compiler.compile_structural_tag(json.dumps(spec))

    def new_matcher(self, compiled: tuple[Any, Any]) -> Matcher:
        return XGrammarMatcher(*compiled)
