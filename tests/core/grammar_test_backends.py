"""Plugins for the engine tests, loaded as a ``--plugin`` module: xgrammar whose compile waits
for the test's signal (``gated``), xgrammar whose matchers break after a few tokens
(``breaking``), xgrammar whose compile of a schema titled "stall" takes a minute (``stalling``:
a stand-in for a pathological schema, whose compile time depends on the machine), and a
reasoning parser whose reasoning is the first three tokens."""

from __future__ import annotations

import json
import threading

from tokenloom.builtin_plugins.structured_output.xgrammar_backend import XGrammarBackend
from tokenloom.core.structured_output_backend import Matcher
from tokenloom.plugin_api import ReasoningParser, hookimpl

# cleared by a test to hold compiles back, set to let them finish
COMPILE_GATE = threading.Event()
COMPILE_GATE.set()
BREAK_AFTER_TOKENS = 2
REASONING_TOKENS = 3


class GatedXGrammarBackend(XGrammarBackend):
    def compile(self, constraint):
        if not COMPILE_GATE.wait(60):
            raise TimeoutError("the test never opened the compile gate")
        if constraint.kind == "regex" and constraint.spec == "refuse":
            raise ValueError("refusing to compile on purpose")
        return super().compile(constraint)


class StallingXGrammarBackend(XGrammarBackend):
    def compile(self, constraint):
        if constraint.kind == "json":
            schema = json.loads(constraint.spec) if isinstance(constraint.spec, str) else constraint.spec
            if isinstance(schema, dict) and schema.get("title") == "stall":
                threading.Event().wait(60)
        return super().compile(constraint)


class BreakingMatcher(Matcher):
    def __init__(self, inner: Matcher):
        self.inner = inner
        self.num_accepted = 0

    def fill_bitmask(self, bitmask, row):
        if self.num_accepted >= BREAK_AFTER_TOKENS:
            raise RuntimeError("the matcher broke on purpose")
        self.inner.fill_bitmask(bitmask, row)

    def accept_token(self, token_id):
        self.num_accepted += 1
        return self.inner.accept_token(token_id)

    def is_terminated(self):
        return self.inner.is_terminated()

    def reset(self):
        self.num_accepted = 0
        self.inner.reset()


class BreakingXGrammarBackend(XGrammarBackend):
    def new_matcher(self, compiled):
        return BreakingMatcher(super().new_matcher(compiled))


@hookimpl
def register_structured_output_backends(register):
    register("gated", "tests.core.grammar_test_backends:GatedXGrammarBackend")
    register("breaking", "tests.core.grammar_test_backends:BreakingXGrammarBackend")
    register("stalling", "tests.core.grammar_test_backends:StallingXGrammarBackend")


class FirstTokensReasoningParser(ReasoningParser):
    def is_reasoning_end(self, token_ids):
        return len(token_ids) >= REASONING_TOKENS


@hookimpl
def register_reasoning_parsers(register):
    register("first_tokens", "tests.core.grammar_test_backends:FirstTokensReasoningParser")
