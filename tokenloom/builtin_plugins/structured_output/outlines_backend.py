"""The ``outlines`` guided-decoding backend, on outlines-core: every constraint becomes a regex
(JSON schemas through ``build_regex_from_schema``), indexed once over the vocabulary's token
bytes into an ``Index``; each sequence walks it with a ``Guide``. Regular languages only:
context-free grammars need the xgrammar backend."""

from __future__ import annotations

import json
import threading
from typing import Any

from tokenloom.builtin_plugins.structured_output.common import (
    KEYWORDS_REGEX_BACKENDS_IGNORE,
    choice_regex,
    enumerate_integer_ranges,
    token_bytes,
    unsupported_keywords_reason,
)
from tokenloom.core.structured_output import Constraint, Matcher, StructuredOutputBackend

# what build_regex_from_schema ignores (numeric bounds among them): outputs could break these
UNSUPPORTED_JSON_KEYWORDS = KEYWORDS_REGEX_BACKENDS_IGNORE


class OutlinesMatcher(Matcher):
    def __init__(self, index: Any, eos_token_ids: list[int], index_eos_token_id: int):
        from outlines_core import Guide

        self._guide = Guide(index)
        self._eos_token_ids = eos_token_ids
        self._index_eos_token_id = index_eos_token_id
        self._terminated = False

    def fill_bitmask(self, bitmask, row: int) -> None:
        words = bitmask[row]
        self._guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())
        eos = self._index_eos_token_id
        if (int(words[eos // 32]) >> (eos % 32)) & 1:
            # the index knows one end token: allow every end token the model has
            for token_id in self._eos_token_ids:
                words[token_id // 32] |= _bit(token_id % 32)

    def accept_token(self, token_id: int) -> bool:
        if token_id in self._eos_token_ids:
            if not self._guide.is_finished():
                return False
            self._terminated = True
            return True
        if not self._guide.accepts_tokens([token_id]):
            return False
        self._guide.advance(token_id, return_tokens=False)
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._guide.reset()
        self._terminated = False


def _bit(position: int) -> int:
    # as a signed int32: bit 31 is the sign bit
    return (1 << position) - (1 << 32 if position == 31 else 0)


class OutlinesBackend(StructuredOutputBackend):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._vocabulary = None
        self._lock = threading.Lock()

    def supports(self, constraint: Constraint) -> str | None:
        if constraint.kind == "grammar":
            return "outlines (outlines-core) compiles regular languages only, not context-free grammars; use xgrammar"
        if constraint.kind == "structural_tag":
            return "outlines has no structural tags; use xgrammar"
        if constraint.kind == "json":
            return unsupported_keywords_reason(
                "outlines", enumerate_integer_ranges(constraint.spec), UNSUPPORTED_JSON_KEYWORDS
            )
        return None

    def vocabulary(self):
        with self._lock:
            if self._vocabulary is None:
                from outlines_core import Vocabulary

                tokens: dict[bytes, list[int]] = {}
                for token_id, text in enumerate(token_bytes(self.tokenizer, self.vocab_size)):
                    if text and token_id not in self.eos_token_ids:
                        tokens.setdefault(text, []).append(token_id)
                self._vocabulary = Vocabulary(self.eos_token_ids[0], tokens)
            return self._vocabulary

    def regex(self, constraint: Constraint) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        if constraint.kind in ("json", "json_object"):
            schema = enumerate_integer_ranges(constraint.spec) if constraint.kind == "json" else {"type": "object"}
            whitespace = constraint.whitespace_pattern
            if whitespace is None and not constraint.any_whitespace:
                whitespace = ""
            return build_regex_from_schema(json.dumps(schema), whitespace)
        if constraint.kind == "choice":
            return choice_regex(constraint.spec)
        return constraint.spec

    def compile(self, constraint: Constraint) -> Any:
        from outlines_core import Index

        return Index(self.regex(constraint), self.vocabulary())

    def new_matcher(self, compiled: Any) -> Matcher:
        return OutlinesMatcher(compiled, self.eos_token_ids, self.eos_token_ids[0])
