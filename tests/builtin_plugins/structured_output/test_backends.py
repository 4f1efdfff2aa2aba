"""The built-in guided-decoding backends with SmolLM2's real tokenizer, no model: random walks
over each backend's masks (any allowed token, ending when allowed) must give output that parses
and validates, for every case a backend says it supports; what it refuses it refuses with a
reason. Also grammars, whitespace options, rollback and reset, and the plugin registration."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time

import jsonschema
import numpy as np
import pytest
import torch

from tests.builtin_plugins.structured_output.cases import (
    CHOICES,
    GRAMMAR_EBNF,
    GRAMMAR_LARK,
    REGEXES,
    SCHEMAS,
)
from tokenloom.builtin_plugins.structured_output.common import (
    JsonControlByteFilter,
    choice_regex,
    enumerate_integer_ranges,
    escape_regex,
    token_bytes,
)
from tokenloom.builtin_plugins.structured_output.guidance_backend import GuidanceBackend
from tokenloom.builtin_plugins.structured_output.lm_format_enforcer_backend import LMFormatEnforcerBackend
from tokenloom.builtin_plugins.structured_output.outlines_backend import OutlinesBackend
from tokenloom.builtin_plugins.structured_output.xgrammar_backend import XGrammarBackend
from tokenloom.core.sampler import unpack_bitmask
from tokenloom.core.structured_output_backend import allocate_bitmask, set_allowed_tokens
from tokenloom.core.structured_output_constraints import BackendOptions, Constraint

BACKENDS = {
    "xgrammar": XGrammarBackend,
    "guidance": GuidanceBackend,
    "outlines": OutlinesBackend,
    "lm-format-enforcer": LMFormatEnforcerBackend,
}
VOCAB_SIZE = 49152
EOS = 2
# the pure-Python backend is slow per token: fewer walks keep the suite quick
WALKS = {"xgrammar": 3, "guidance": 3, "outlines": 3, "lm-format-enforcer": 2}
CASES = (
    [("json", name) for name in SCHEMAS]
    + [("regex", name) for name in REGEXES]
    + [("choice", name) for name in CHOICES]
)
SPECS = {"json": SCHEMAS, "regex": REGEXES, "choice": CHOICES}

# exactly what each backend refuses (anything else refused is a regression, anything here
# accepted a claim it cannot keep)
EXPECTED_REFUSALS = {
    "xgrammar": set(),
    "guidance": set(),
    "outlines": {"city_population", "probability", "many_types"},  # big integer ranges, number bounds
    "lm-format-enforcer": {
        "city_population",
        "probability",
        "many_types",
        "mixed_enum",
        "optional_fields",
        "all_optional",
        "nullable_type_list",
        "date_format",
        "uuid_format",
        "one_of",
        "prefix_items",
    },
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    # the server's own loader (identical to transformers', see
    # tests/builtin_plugins/loaders/test_gguf_real_models.py; transformers' takes tens of seconds)
    from tokenloom.builtin_plugins.loaders.gguf_format import GGUFLoadFormat

    return GGUFLoadFormat().load_tokenizer(smollm2_gguf, None)


# lm-format-enforcer walks its masks in Python, about two thirds of this module's time: its
# tests are a work unit of their own under `make test` (tests/helpers/xdist_scheduling.py), so
# the other worker runs the rest meanwhile
ALONE_IN_A_WORKER = pytest.mark.xdist_group("structured-output-backends-lm-format-enforcer")


def backend_params(names) -> list:
    return [pytest.param(name, marks=ALONE_IN_A_WORKER) if name == "lm-format-enforcer" else name for name in names]


@pytest.fixture(scope="module")
def backends(tokenizer):
    return {name: cls(tokenizer, VOCAB_SIZE, [EOS], BackendOptions()) for name, cls in BACKENDS.items()}


def allowed_mask(matcher) -> np.ndarray:
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, VOCAB_SIZE)[0].numpy()


def allowed_tokens(matcher) -> list[int]:
    return np.flatnonzero(allowed_mask(matcher)).tolist()


def random_walk(backend, compiled, rng: random.Random, max_tokens: int = 120) -> list[int] | None:
    """Tokens of one walk to EOS (taken half the time it is allowed); None when it ran out."""
    matcher = backend.new_matcher(compiled)
    token_ids: list[int] = []
    for _ in range(max_tokens):
        mask = allowed_mask(matcher)
        allowed = np.flatnonzero(mask)
        assert allowed.size, f"dead end after {token_ids}"
        if mask[EOS] and (allowed.size == 1 or rng.random() < 0.5):
            assert matcher.accept_token(EOS) and matcher.is_terminated()
            return token_ids
        token_id = EOS
        while token_id == EOS:
            token_id = int(allowed[rng.randrange(allowed.size)])
        assert matcher.accept_token(token_id)
        token_ids.append(token_id)
    return None


def check_output(kind: str, spec, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "regex":
        assert re.fullmatch(spec, text), f"{text!r} does not match {spec!r}"
    else:
        assert text in spec, f"{text!r} is not one of {spec}"


def constraint_for(kind: str, spec, **options) -> Constraint:
    return Constraint(kind, tuple(spec) if kind == "choice" else spec, **options)


@pytest.mark.parametrize("backend_name", backend_params(BACKENDS))
@pytest.mark.parametrize("kind, case", CASES)
def test_random_walks_over_the_masks_satisfy_the_constraint(backends, tokenizer, backend_name, kind, case):
    backend, spec = backends[backend_name], SPECS[kind][case]
    constraint = constraint_for(kind, spec)
    reason = backend.supports(constraint)
    assert (reason is not None) == (case in EXPECTED_REFUSALS[backend_name]), reason
    if reason is not None:
        assert backend_name in reason and len(reason) > 30  # a reason the user can act on
        return
    compiled = backend.compile(constraint)
    rng = random.Random(f"{backend_name}/{case}")
    finished = 0
    for _ in range(WALKS[backend_name]):
        token_ids = random_walk(backend, compiled, rng)
        if token_ids is not None:
            finished += 1
            check_output(kind, spec, tokenizer.decode(token_ids))
    assert finished or kind == "json"  # regexes and choices here are short: a walk always ends


@pytest.mark.parametrize("backend_name", ["xgrammar", "guidance"])
def test_grammars_ebnf_and_lark(backends, tokenizer, backend_name):
    backend = backends[backend_name]
    rng = random.Random(0)
    sentence = re.compile(r"(The cat|A dog|My friend) (sees|likes|chases) (the ball|a bird|the moon)\.")
    expression = re.compile(r"[1-9][0-9]?[+-][1-9][0-9]?=[1-9][0-9]?")
    for grammar, pattern in ((GRAMMAR_EBNF, sentence), (GRAMMAR_LARK, expression)):
        compiled = backend.compile(Constraint("grammar", grammar))
        for _ in range(5):
            token_ids = random_walk(backend, compiled, rng, max_tokens=400)
            assert token_ids is not None and pattern.fullmatch(tokenizer.decode(token_ids))


@pytest.mark.parametrize("backend_name", ["xgrammar", "guidance"])
def test_structural_tags_constrain_only_inside_the_tag(backends, tokenizer, backend_name):
    backend = backends[backend_name]
    tag = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<call>",
                "schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]},
                "end": "</call>",
            }
        ],
        "triggers": ["<call>"],
    }
    matcher = backend.new_matcher(backend.compile(Constraint("structural_tag", tag)))
    assert len(allowed_tokens(matcher)) > 40000  # free text before the trigger
    for token_id in tokenizer.encode("Sure. <call>", add_special_tokens=False):
        assert matcher.accept_token(token_id)
    inside = {tokenizer.decode([t]) for t in allowed_tokens(matcher)}
    assert inside and all(text.strip() == "" or text.lstrip().startswith("{") for text in inside)
    assert not matcher.accept_token(tokenizer.encode("Paris", add_special_tokens=False)[0])
    for token_id in tokenizer.encode('{"city": "Rome"}</call> Done.', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    assert len(allowed_tokens(matcher)) > 40000  # free text again after the tag


@pytest.mark.parametrize("backend_name", backend_params(BACKENDS))
def test_compact_json_has_no_whitespace_between_tokens(backends, tokenizer, backend_name):
    backend, spec = backends[backend_name], SCHEMAS["profile"]
    compiled = backend.compile(Constraint("json", spec, any_whitespace=False))
    rng = random.Random(1)
    for _ in range(WALKS[backend_name]):
        text = tokenizer.decode(random_walk(backend, compiled, rng))
        assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


def test_outlines_takes_a_whitespace_pattern_and_the_others_refuse_it(backends, tokenizer):
    constraint = Constraint("json", SCHEMAS["flags"], whitespace_pattern="[ ]{2}")
    assert "whitespace pattern" in backends["xgrammar"].supports(constraint)
    assert "whitespace pattern" in backends["lm-format-enforcer"].supports(constraint)
    assert "whitespace pattern" in backends["guidance"].supports(constraint)
    compiled = backends["outlines"].compile(constraint)
    text = tokenizer.decode(random_walk(backends["outlines"], compiled, random.Random(2)))
    assert re.fullmatch(
        r'\{  "read"  :  (true|false)  ,  "write"  :  (true|false)  ,  "exec"  :  (true|false)  \}', text
    ), text


def test_what_each_backend_cannot_express_is_refused_with_the_reason(backends):
    grammar = Constraint("grammar", GRAMMAR_EBNF)
    assert backends["xgrammar"].supports(grammar) is None
    assert "regular languages only" in backends["outlines"].supports(grammar)
    assert "no grammars" in backends["lm-format-enforcer"].supports(grammar)
    assert backends["guidance"].supports(grammar) is None
    unique = Constraint("json", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    assert 'Unimplemented keys: ["uniqueItems"]' in backends["guidance"].supports(unique)
    overlapping = Constraint("json", {"oneOf": [{"type": "integer"}, {"type": "number"}]})
    assert "oneOf" in backends["guidance"].supports(overlapping)
    # a schema cannot switch llguidance to ignoring what it does not implement
    lenient = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True, "coerce_one_of": True}}
    assert "uniqueItems" in backends["guidance"].supports(Constraint("json", lenient))
    assert (
        "unknown format"
        in backends["guidance"].supports(Constraint("json", {"type": "string", "format": "colour"})).lower()
    )
    other_tag_form = Constraint("structural_tag", {"type": "structural_tag", "format": {"type": "const_string"}})
    assert "structures and triggers" in backends["guidance"].supports(other_tag_form)
    assert "maximum, minimum" in backends["outlines"].supports(Constraint("json", SCHEMAS["probability"]))
    assert backends["outlines"].supports(Constraint("json", SCHEMAS["person"])) is None  # 0..120: an enum
    assert "uniqueItems" in backends["xgrammar"].supports(
        Constraint("json", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
    )
    assert "optional" in backends["lm-format-enforcer"].supports(Constraint("json", SCHEMAS["optional_fields"]))
    unbounded = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert backends["lm-format-enforcer"].supports(Constraint("json", unbounded)) is None  # exact number rule
    flag = {"type": "object", "properties": {"on": {"const": True}}, "required": ["on"]}
    assert "string or a number" in backends["lm-format-enforcer"].supports(Constraint("json", flag))
    coded = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}
    assert "pattern with minLength or maxLength" in backends["lm-format-enforcer"].supports(Constraint("json", coded))
    assert "no fixed properties" in backends["lm-format-enforcer"].supports(Constraint("json_object", None))


@pytest.mark.parametrize("backend_name", backend_params(BACKENDS))
def test_reset_and_rollback_return_to_earlier_masks(backends, tokenizer, backend_name):
    backend = backends[backend_name]
    matcher = backend.new_matcher(backend.compile(Constraint("regex", REGEXES["email"])))
    start = allowed_tokens(matcher)
    token_ids = tokenizer.encode("abc@xyz.c", add_special_tokens=False)
    masks = []
    for token_id in token_ids:
        masks.append(allowed_tokens(matcher))
        assert matcher.accept_token(token_id)
    assert not matcher.accept_token(tokenizer.encode("@", add_special_tokens=False)[0])  # refused, state kept
    try:
        matcher.rollback(2)
    except NotImplementedError:  # the engine resets and replays instead
        assert backend_name == "outlines"
    else:
        assert allowed_tokens(matcher) == masks[-2]
    matcher.reset()
    assert allowed_tokens(matcher) == start and not matcher.is_terminated()


def test_guidance_generates_only_the_listed_properties_unless_the_schema_opens_the_object(backends, tokenizer):
    backend = backends["guidance"]

    def another_property_may_follow(schema: dict) -> bool:
        matcher = backend.new_matcher(backend.compile(Constraint("json", schema, any_whitespace=False)))
        for token_id in tokenizer.encode('{"a":true', add_special_tokens=False):
            assert matcher.accept_token(token_id)
        return any(tokenizer.decode([token_id]).startswith(",") for token_id in allowed_tokens(matcher))

    listed = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    assert not another_property_may_follow(listed)
    assert another_property_may_follow({**listed, "additionalProperties": True})
    # allOf branches merge: closing each would leave no object that has both properties
    merged = {"allOf": [listed, {"properties": {"b": {"type": "null"}}, "required": ["b"]}]}
    assert backend.supports(Constraint("json", merged)) is None
    assert another_property_may_follow(merged)


@pytest.mark.parametrize("backend_name", backend_params(["xgrammar", "guidance", "lm-format-enforcer"]))
def test_rollback_over_the_end_of_sequence_token_undoes_it_alone(backends, tokenizer, backend_name):
    backend = backends[backend_name]
    # "yes" may end or go on; after "yes" alone the grammar is complete (llguidance has stopped)
    for choices, only_the_end in ((("yes", "yes please"), False), (("yes",), True)):
        matcher = backend.new_matcher(backend.compile(Constraint("choice", choices)))
        for token_id in tokenizer.encode("yes", add_special_tokens=False):
            assert matcher.accept_token(token_id)
        after_yes = allowed_tokens(matcher)
        assert EOS in after_yes and (len(after_yes) == 1) == only_the_end
        assert matcher.accept_token(EOS) and matcher.is_terminated()
        matcher.rollback(1)
        assert not matcher.is_terminated() and allowed_tokens(matcher) == after_yes


def test_lm_format_enforcer_internal_errors_fail_the_request_instead_of_ending_it(backends):
    from lmformatenforcer import CharacterLevelParser

    class BrokenParser(CharacterLevelParser):
        def add_character(self, new_character):
            return self

        def get_allowed_characters(self):
            raise KeyError("a bug inside the parser")

        def can_end(self):
            return False

    backend = backends["lm-format-enforcer"]
    backend.tokenizer_data()
    matcher = backend.new_matcher((BrokenParser(), None, None))
    assert allowed_tokens(matcher) == [EOS]  # the library's answer to its own errors
    with pytest.raises(RuntimeError, match="failed inside its parser"):
        matcher.accept_token(EOS)


def test_token_bytes_of_a_byte_level_vocabulary(tokenizer):
    table = token_bytes(tokenizer, VOCAB_SIZE + 8)
    assert table[EOS] is None and table[VOCAB_SIZE + 3] is None  # special, and past the tokenizer
    for text in ("hello", " world", "é", "日本", "\n\n"):
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(table[t] for t in token_ids) == text.encode()


def test_the_json_control_byte_filter_reads_where_a_row_is(tokenizer):
    control_filter = JsonControlByteFilter(tokenizer, VOCAB_SIZE)
    newline, tab_ish, letter = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ("\n", "\t", "a"))
    sentinel = next(t for t, b in enumerate(token_bytes(tokenizer, VOCAB_SIZE)) if b == b"\x01")
    row = allocate_bitmask(1, VOCAB_SIZE)[0]
    set_allowed_tokens(row, [newline, tab_ish, letter, sentinel])
    between_tokens = row.clone()
    set_allowed_tokens(between_tokens, [newline, tab_ish, letter])
    control_filter.apply(between_tokens)  # no sentinel: outside a string, whitespace stays
    assert unpack_bitmask(between_tokens[None], VOCAB_SIZE)[0].nonzero().flatten().tolist() == sorted(
        [newline, tab_ish, letter]
    )
    control_filter.apply(row)  # the sentinel was allowed: inside a string, no control byte at all
    assert unpack_bitmask(row[None], VOCAB_SIZE)[0].nonzero().flatten().tolist() == [letter]


def test_small_integer_ranges_become_enums_for_backends_without_bounds():
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 3, "description": "years"},
            "odd": {"type": "integer", "exclusiveMinimum": 0.5, "exclusiveMaximum": 7, "multipleOf": 2},
            "picked": {"type": "integer", "minimum": 1, "maximum": 9, "enum": [2, 5, 12]},
            "huge": {"type": "integer", "minimum": 0, "maximum": 100000},
            "half_open": {"type": "integer", "minimum": 0},
            "real": {"type": "number", "minimum": 0, "maximum": 1},
            "values": {"enum": [{"type": "integer", "minimum": 0, "maximum": 1}]},
        },
    }
    converted = enumerate_integer_ranges(schema)["properties"]
    assert converted["age"] == {"type": "integer", "description": "years", "enum": [0, 1, 2, 3]}
    assert converted["odd"]["enum"] == [2, 4, 6]
    assert converted["picked"]["enum"] == [2, 5]
    for unchanged in ("huge", "half_open", "real", "values"):
        assert converted[unchanged] == schema["properties"][unchanged]


def test_choice_regexes_escape_every_special_character():
    tricky = ["C++", "a.b", "(x|y)", "[z]", "{1}", "^$", "back\\slash", "tab\there", "-&~#"]
    pattern = choice_regex(tricky)
    assert all(re.fullmatch(pattern, text) for text in tricky)
    assert not re.fullmatch(pattern, "C") and not re.fullmatch(pattern, "axb")
    assert escape_regex("new\nline") == "new\\nline"


@pytest.mark.hook("register_structured_output_backends")
def test_the_entry_point_module_registers_the_backends_lazily():
    script = (
        "import sys\n"
        "import tokenloom.builtin_plugins.structured_output as plugin\n"
        "registered = []\n"
        "plugin.register_structured_output_backends(register=lambda name, target: registered.append((name, target)))\n"
        "heavy = [m for m in ('torch', 'xgrammar', 'llguidance', 'outlines_core', 'lmformatenforcer') if m in sys.modules]\n"
        "print(registered, heavy)\n"
    )
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    registered, heavy = output.strip().rsplit(" ", 1)[0], output.strip().rsplit(" ", 1)[1]
    assert heavy == "[]", f"importing the entry point pulled in {heavy}"
    assert registered.startswith("[('xgrammar', 'tokenloom.builtin_plugins.structured_output.xgrammar_backend:")
    assert "('guidance', " in registered and "('outlines', " in registered and "('lm-format-enforcer', " in registered


@pytest.mark.hook("register_structured_output_backends")
def test_the_installed_entry_point_fills_the_registry_in_preference_order():
    from tokenloom.plugins.manager import load_plugins

    registry = load_plugins().registry("structured_output_backend")
    # vLLM's auto tries xgrammar, then guidance
    assert registry.names()[:4] == ["xgrammar", "guidance", "outlines", "lm-format-enforcer"]
    assert registry.get("outlines") is OutlinesBackend


def test_bitmask_rows_do_not_bleed_between_rows(backends):
    backend = backends["xgrammar"]
    first = backend.new_matcher(backend.compile(Constraint("choice", ("yes",))))
    second = backend.new_matcher(backend.compile(Constraint("choice", ("no",))))
    bitmask = allocate_bitmask(2, VOCAB_SIZE)
    bitmask.fill_(-1)
    first.fill_bitmask(bitmask, 0)
    second.fill_bitmask(bitmask, 1)
    rows = unpack_bitmask(bitmask, VOCAB_SIZE)
    assert not (rows[0] & rows[1]).any() and rows[0].any() and rows[1].any()
    assert torch.equal(rows[0], unpack_bitmask(bitmask[:1], VOCAB_SIZE)[0])


# -- outlines: index builds in child processes that can be stopped ------------------------------


def test_outlines_builds_indexes_in_a_reused_child_process(tokenizer):
    backend = OutlinesBackend(tokenizer, VOCAB_SIZE, [EOS], BackendOptions())
    first = backend.compile(Constraint("regex", "[0-9]{3}"))
    (worker,) = backend._idle_workers
    second = backend.compile(Constraint("json", {"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert backend._idle_workers == [worker]  # the same child built both
    assert random_walk(backend, first, random.Random(0)) is not None
    assert random_walk(backend, second, random.Random(0)) is not None
    with pytest.raises(ValueError, match="Error"):  # what outlines refuses is the request's error
        backend.compile(Constraint("regex", "(unbalanced"))
    assert backend._idle_workers == [worker]
    worker.close()


def test_an_outlines_compile_past_the_limit_is_stopped_not_left_running(tokenizer):
    """(a|b)*a(a|b){15}: a DFA of 2**16 states, minutes of CPU. The compile's request gets its
    400 at the limit and the child building the index is killed: no runaway thread remains,
    and asking again answers the same 400 at once from the cache."""
    from tokenloom.core.config import StructuredOutputConfig
    from tokenloom.core.structured_output import StructuredOutputManager
    from tokenloom.errors import InvalidRequestError
    from tokenloom.plugins.registry import Registry

    registry = Registry("structured_output_backend", "--guided-decoding-backend")
    registry.register("outlines", OutlinesBackend, plugin_name="test")
    manager = StructuredOutputManager(
        StructuredOutputConfig(backend="outlines", compile_timeout=2), registry, tokenizer, VOCAB_SIZE, [EOS]
    )
    try:
        backend = manager.backend("outlines")
        backend.vocabulary()  # built before the clock starts
        exponential = {"regex": "(a|b)*a(a|b){15}"}
        future = manager.submit(*manager.resolve(exponential), client="a")
        with pytest.raises(InvalidRequestError, match="took longer than the server's limit of 2s"):
            future.result(timeout=30)
        deadline = time.monotonic() + 10
        while manager._pool.num_runaway and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager._pool.num_runaway == 0
        assert backend._idle_workers == []  # the child was killed, not kept
        again = manager.submit(*manager.resolve(exponential), client="a")
        assert again is future and manager.stats.compiles == 1
        assert manager.submit(*manager.resolve({"regex": "[ab]{3}"}), client="a").result(timeout=30)
    finally:
        manager.shutdown()
