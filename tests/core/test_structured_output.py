"""The guided-decoding core without a model (constraint parsing is in
test_structured_output_constraints.py): bitmask packing, and the StructuredOutputManager with fake backends — backend choice and fallback,
the compile cache, per-step masks, advancing matchers, failures, preemption (reset and
replay) and reasoning sections."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tokenloom.core.batch import SchedulerOutput
from tokenloom.core.config import StructuredOutputConfig
from tokenloom.core.sampler import unpack_bitmask
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import EngineSequence
from tokenloom.core.structured_output import StructuredOutputManager, clean_error
from tokenloom.core.structured_output_backend import (
    Matcher,
    StructuredOutputBackend,
    allocate_bitmask,
    set_allowed_tokens,
)
from tokenloom.errors import ConfigError, InvalidRequestError, UnknownNameError
from tokenloom.plugins.registry import Registry

VOCAB_SIZE = 40
EOS = 2


class FakeTokenizer:
    def get_vocab(self):
        return {f"t{i}": i for i in range(VOCAB_SIZE)}

    def decode(self, token_ids):
        return "".join(f"<{t}>" for t in token_ids)


class SequenceMatcher(Matcher):
    """Allows exactly ``target`` (token ids), then EOS; counts resets."""

    def __init__(self, target: tuple[int, ...], fail_at: int | None = None):
        self.target = target
        self.position = 0
        self.terminated = False
        self.resets = 0
        self.accepted: list[int] = []
        self.fail_at = fail_at

    def allowed_token_ids(self):
        if self.fail_at is not None and self.position >= self.fail_at:
            raise RuntimeError("the fake backend broke")
        return [self.target[self.position]] if self.position < len(self.target) else [EOS]

    def accept_token(self, token_id):
        if self.position == len(self.target) and token_id == EOS:
            self.terminated = True
            return True
        if self.position >= len(self.target) or token_id != self.target[self.position]:
            return False
        self.position += 1
        self.accepted.append(token_id)
        return True

    def is_terminated(self):
        return self.terminated

    def reset(self):
        self.resets += 1
        self.position = 0
        self.terminated = False
        self.accepted = []


class DigitsBackend(StructuredOutputBackend):
    """Regexes of space-separated token ids ("5 6 7"); choices are not supported."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled_specs: list[str] = []
        self.matchers: list[SequenceMatcher] = []
        self.fail_at: int | None = None

    def supports(self, constraint):
        return None if constraint.kind == "regex" else "digits takes regexes only"

    def compile(self, constraint):
        self.compiled_specs.append(constraint.spec)
        try:
            return tuple(int(part) for part in constraint.spec.split())
        except ValueError:
            raise InvalidRequestError(f"not token ids: {constraint.spec!r}") from None

    def new_matcher(self, compiled):
        matcher = SequenceMatcher(compiled, self.fail_at)
        self.matchers.append(matcher)
        return matcher


class ChoiceBackend(DigitsBackend):
    """Like DigitsBackend but for choices (each choice a token id)."""

    def supports(self, constraint):
        return None if constraint.kind in ("regex", "choice") else "choices and regexes only"

    def compile(self, constraint):
        if constraint.kind == "choice":
            return (int(constraint.spec[0]),)
        return super().compile(constraint)


class ThinkParser:
    """Reasoning ends with token 30."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def is_reasoning_end(self, token_ids):
        return 30 in token_ids


def make_manager(backend="auto", reasoning_parser_class=None, **config) -> StructuredOutputManager:
    registry = Registry("structured_output_backend", "--guided-decoding-backend")
    registry.register("digits", DigitsBackend, plugin_name="test")
    registry.register("choices", ChoiceBackend, plugin_name="test")
    return StructuredOutputManager(
        StructuredOutputConfig(backend=backend, **config),
        registry,
        FakeTokenizer(),
        VOCAB_SIZE,
        [EOS],
        reasoning_parser_class,
    )


def make_request(request_id="r", prompt=(1, 3), output=()) -> EngineSequence:
    request = EngineSequence(seq_id=request_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams())
    request.output_token_ids = list(output)
    return request


def allowed_ids(masks, row=0) -> list[int]:
    bitmask = torch.from_numpy(masks.bitmask)
    return unpack_bitmask(bitmask, VOCAB_SIZE)[row].nonzero().flatten().tolist()


def decode_step(request: EngineSequence, num_scheduled: int = 1) -> SchedulerOutput:
    return SchedulerOutput(num_scheduled_tokens={request.seq_id: num_scheduled})


# -- errors, bitmasks ---------------------------------------------------------------------


def test_clean_error_drops_native_location_prefixes():
    assert (
        clean_error(RuntimeError("[02:15:01] /project/cpp/regex.cc:83: Regex parsing error\nmore"))
        == "Regex parsing error"
    )
    assert clean_error(ValueError("")) == "ValueError"


def test_bitmask_packing_round_trips_through_the_sampler_unpacker():
    bitmask = allocate_bitmask(2, 70)
    assert bitmask.shape == (2, 3) and bitmask.dtype == torch.int32
    set_allowed_tokens(bitmask[0], [0, 31, 32, 63, 69, 500])  # 500 is out of range: ignored
    set_allowed_tokens(bitmask[1], [])
    unpacked = unpack_bitmask(bitmask, 70)
    assert unpacked[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 69]
    assert not unpacked[1].any()
    # a logits row wider than the mask: the extra tokens are not allowed
    assert unpack_bitmask(bitmask, 100)[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 69]


# -- choosing a backend ----------------------------------------------------------------------


def test_auto_picks_the_first_backend_that_can_express_the_constraint():
    manager = make_manager()
    assert manager.resolve({"regex": "5"})[0] == "digits"
    assert manager.resolve({"choice": ["5"]})[0] == "choices"


def test_a_backend_named_in_the_request_is_used_or_the_request_fails():
    manager = make_manager()
    with pytest.raises(InvalidRequestError, match="digits: digits takes regexes only"):
        manager.resolve({"choice": ["5"], "backend": "digits"})
    with pytest.raises(
        InvalidRequestError, match="unknown guided_decoding_backend 'nope'; available: digits, choices"
    ) as error:
        manager.resolve({"regex": "5", "backend": "nope"})
    assert error.value.param == "guided_decoding_backend"


def test_the_server_default_falls_back_unless_fallback_is_disabled():
    assert make_manager("digits").resolve({"choice": ["5"]})[0] == "choices"
    with pytest.raises(InvalidRequestError, match="no guided-decoding backend can express a choice"):
        make_manager("digits", disable_fallback=True).resolve({"choice": ["5"]})
    with pytest.raises(InvalidRequestError):
        make_manager("digits:no-fallback").resolve({"choice": ["5"]})
    with pytest.raises(InvalidRequestError):
        make_manager("digits").resolve({"choice": ["5"], "disable_fallback": True})
    # auto without fallback: only the first backend
    with pytest.raises(InvalidRequestError, match="digits takes regexes only"):
        make_manager("auto", disable_fallback=True).resolve({"choice": ["5"]})


def test_an_unknown_default_backend_fails_at_start_up():
    with pytest.raises(UnknownNameError, match="unknown structured_output_backend 'xgrammer'"):
        make_manager("xgrammer")


# -- compiling -------------------------------------------------------------------------------


def test_compiles_are_cached_by_backend_and_constraint():
    manager = make_manager()
    first = manager.submit(*manager.resolve({"regex": "5 6"}))
    again = manager.submit(*manager.resolve({"regex": "5  6".replace("  ", " ")}))
    other = manager.submit(*manager.resolve({"regex": "7"}))
    assert first is again and first.result().compiled == (5, 6) and other.result().compiled == (7,)
    assert (manager.stats.compiles, manager.stats.cache_hits) == (2, 1)
    assert sorted(manager.backend("digits").compiled_specs) == ["5 6", "7"]  # two compile threads
    manager.shutdown()


def test_the_cache_is_bounded_and_least_recently_used_goes_first():
    manager = make_manager()
    manager.cache_size = 2
    for spec in ("1", "3", "1", "4"):  # "3" is the least recently used when "4" arrives
        manager.submit(*manager.resolve({"regex": spec})).result()
    manager.submit(*manager.resolve({"regex": "1"})).result()
    manager.submit(*manager.resolve({"regex": "3"})).result()
    assert manager.backend("digits").compiled_specs == ["1", "3", "4", "3"]


def test_compile_errors_come_out_of_the_future_and_are_cached_as_failures():
    manager = make_manager()
    future = manager.submit(*manager.resolve({"regex": "five"}))
    with pytest.raises(InvalidRequestError, match="not token ids: 'five'"):
        future.result()
    # the same constraint gets the same 400 at once, without compiling again
    again = manager.submit(*manager.resolve({"regex": "five"}))
    assert again.done() and "not token ids: 'five'" in str(again.exception())
    assert manager.backend("digits").compiled_specs == ["five"]
    assert manager.stats.cache_hits == 1


def test_compile_runs_off_the_calling_thread():
    manager = make_manager()
    release = threading.Event()
    backend = manager.backend("digits")
    original = backend.compile

    def slow_compile(constraint):
        release.wait(5)
        return original(constraint)

    backend.compile = slow_compile
    future = manager.submit(*manager.resolve({"regex": "9"}))
    assert not future.done()  # submit did not wait for it
    release.set()
    assert future.result(5).compiled == (9,)


# -- sequences -------------------------------------------------------------------------------


def compiled_for(manager, spec="5 6 7", backend=None):
    request = {"regex": spec} if backend is None else {"regex": spec, "backend": backend}
    return manager.submit(*manager.resolve(request)).result()


def test_masks_only_for_constrained_rows_that_sample_and_tokens_advance_the_matcher():
    manager = make_manager()
    constrained, free, chunking = make_request("c"), make_request("free"), make_request("chunk", prompt=(1, 3, 4, 8))
    manager.add_sequence(constrained, compiled_for(manager))
    manager.add_sequence(chunking, compiled_for(manager))
    step = SchedulerOutput(num_scheduled_tokens={"c": 2, "free": 2, "chunk": 2})  # chunk: 2 of 4 prompt tokens
    requests = {r.seq_id: r for r in (constrained, free, chunking)}
    masks = manager.grammar_bitmask(step, requests.get)
    assert masks.req_ids == ["c"] and allowed_ids(masks) == [5]
    constrained.num_computed_tokens = 2
    for token in (5, 6, 7):
        constrained.output_token_ids.append(token)
        assert manager.advance(constrained) is None
        masks = manager.grammar_bitmask(decode_step(constrained), requests.get)
        constrained.num_computed_tokens += 1
    assert allowed_ids(masks) == [EOS]  # the constraint is complete: only the end may follow
    constrained.output_token_ids.append(EOS)
    assert manager.advance(constrained) is None
    # ignore_eos keeps sampling: still only EOS, and the matcher is not fed past its end
    assert allowed_ids(manager.grammar_bitmask(decode_step(constrained), requests.get)) == [EOS]
    constrained.output_token_ids.append(EOS)
    assert manager.advance(constrained) is None
    manager.remove_sequences(["c", "chunk"])
    assert not manager.is_constrained("c") and manager.grammar_bitmask(step, requests.get) is None


def test_a_rejected_token_or_a_backend_failure_fails_that_sequence_only():
    manager = make_manager()
    rejected, broken, healthy = make_request("rejected"), make_request("broken"), make_request("healthy")
    manager.add_sequence(rejected, compiled_for(manager))
    manager.add_sequence(healthy, compiled_for(manager))
    manager.backend("digits").fail_at = 0
    manager.add_sequence(broken, compiled_for(manager))
    rejected.output_token_ids.append(9)
    assert "the digits grammar rejected the sampled token 9 ('<9>')" in manager.advance(rejected)
    step = SchedulerOutput(num_scheduled_tokens={"broken": 2, "healthy": 2})
    masks = manager.grammar_bitmask(step, {"broken": broken, "healthy": healthy}.get)
    assert allowed_ids(masks, 0) == [EOS]  # the broken row may only end
    assert allowed_ids(masks, 1) == [5]
    assert "digits failed computing the allowed tokens: the fake backend broke" in manager.advance(broken)
    healthy.output_token_ids.append(5)
    assert manager.advance(healthy) is None


def test_preemption_resets_the_matcher_and_replays_the_kept_tokens():
    manager = make_manager()
    request = make_request()
    manager.add_sequence(request, compiled_for(manager))
    matcher = manager.backend("digits").matchers[-1]
    request.output_token_ids += [5, 6]
    manager.advance(request)
    assert matcher.accepted == [5, 6]
    # the scheduler preempted it: the worker recomputes prompt + the two kept tokens
    request.num_preemptions += 1
    request.num_computed_tokens = 0
    masks = manager.grammar_bitmask(decode_step(request, num_scheduled=4), {"r": request}.get)
    assert matcher.resets == 1 and matcher.accepted == [5, 6]
    assert allowed_ids(masks) == [7]
    assert (manager.stats.matcher_resets, manager.stats.replayed_tokens) == (1, 2)


def test_tokens_taken_back_roll_the_matcher_back_or_replay():
    manager = make_manager()
    request = make_request()
    manager.add_sequence(request, compiled_for(manager))
    matcher = manager.backend("digits").matchers[-1]
    request.output_token_ids += [5, 6]
    manager.advance(request)
    del request.output_token_ids[-1]  # SequenceMatcher cannot roll back: reset and replay
    assert manager.advance(request) is None
    assert matcher.resets == 1 and matcher.accepted == [5]


def test_the_constraint_starts_after_the_reasoning_section():
    manager = make_manager(reasoning_parser_class=ThinkParser)
    thinking = make_request("thinking")
    manager.add_sequence(thinking, compiled_for(manager))
    assert manager.grammar_bitmask(decode_step(thinking, 2), {"thinking": thinking}.get) is None  # free text
    thinking.output_token_ids += [11, 12, 30]  # 30 closes the reasoning section
    thinking.num_computed_tokens = 4
    assert manager.advance(thinking) is None
    masks = manager.grammar_bitmask(decode_step(thinking), {"thinking": thinking}.get)
    assert allowed_ids(masks) == [5]
    thinking.output_token_ids += [5]
    assert manager.advance(thinking) is None
    assert manager.backend("digits").matchers[-1].accepted == [5]
    # the parser judges generated tokens only: a 30 in the prompt does not end anything
    prompted = make_request("prompted", prompt=(1, 30))
    manager.add_sequence(prompted, compiled_for(manager))
    assert manager.grammar_bitmask(decode_step(prompted, 2), {"prompted": prompted}.get) is None


class NoReasoningParser(ThinkParser):
    def is_reasoning_end(self, token_ids):
        return True  # this model never reasons: the output is all answer


def test_a_parser_that_sees_no_reasoning_section_constrains_from_the_first_token():
    manager = make_manager(reasoning_parser_class=NoReasoningParser)
    request = make_request()
    manager.add_sequence(request, compiled_for(manager))
    assert allowed_ids(manager.grammar_bitmask(decode_step(request, 2), {"r": request}.get)) == [5]


# -- the compile time bound ------------------------------------------------------------------


class SlowBackend(DigitsBackend):
    """Compiles a regex starting with "0" only when ``release`` is set (a compile that never
    ends, as far as the request is concerned); other regexes at once."""

    release = threading.Event()

    def compile(self, constraint):
        if constraint.spec.startswith("0"):
            self.release.wait(30)
        return super().compile(constraint)


def make_slow_manager(compile_timeout: float) -> StructuredOutputManager:
    registry = Registry("structured_output_backend", "--guided-decoding-backend")
    registry.register("slow", SlowBackend, plugin_name="test")
    SlowBackend.release = threading.Event()
    return StructuredOutputManager(
        StructuredOutputConfig(backend="slow", compile_timeout=compile_timeout),
        registry,
        FakeTokenizer(),
        VOCAB_SIZE,
        [EOS],
    )


def test_a_compile_past_the_time_limit_is_a_400_and_the_pool_goes_on():
    manager = make_slow_manager(compile_timeout=0.3)
    try:
        # both compile threads get a compile that does not end
        stuck = [manager.submit(*manager.resolve({"regex": spec})) for spec in ("0", "0 1")]
        for future in stuck:
            with pytest.raises(InvalidRequestError, match="took longer than the server's limit of 0.3s") as error:
                future.result(timeout=10)
            assert error.value.param == "structured_outputs"
        # fresh threads took their places: an ordinary constraint compiles at once
        assert manager.submit(*manager.resolve({"regex": "5 6"})).result(timeout=10).compiled == (5, 6)
        # a constraint that overran stays failed: asked again, it is the same 400 at once and
        # no second thread starts burning on it
        again = manager.submit(*manager.resolve({"regex": "0"}))
        assert again is stuck[0] and manager.stats.compiles == 3
    finally:
        SlowBackend.release.set()


def test_runaway_compiles_are_bounded():
    from tokenloom.core.structured_output_compile import MAX_RUNAWAY_COMPILES
    from tokenloom.errors import OverloadedError

    manager = make_slow_manager(compile_timeout=0.2)
    try:
        futures = [manager.submit(*manager.resolve({"regex": f"0 {index}"})) for index in range(MAX_RUNAWAY_COMPILES)]
        for future in futures:
            with pytest.raises(InvalidRequestError):
                future.result(timeout=10)
        with pytest.raises(OverloadedError, match="overran"):
            manager.submit(*manager.resolve({"regex": "7"}))
        SlowBackend.release.set()  # the runaway compiles end: new ones are taken again
        deadline = time.monotonic() + 10
        while manager._pool.num_runaway and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager.submit(*manager.resolve({"regex": "7"})).result(timeout=10).compiled == (7,)
    finally:
        SlowBackend.release.set()


def test_an_oversized_constraint_is_refused_unread():
    manager = make_manager()
    with pytest.raises(InvalidRequestError, match="longer than 262144 characters") as error:
        manager.resolve({"regex": "5" * (300 * 1024)})
    assert error.value.param == "structured_outputs"


class SlowCheckBackend(DigitsBackend):
    """Takes ``delay`` seconds to say whether it supports a constraint (a stand-in for a schema
    whose check is slow)."""

    delay = 0.0

    def supports(self, constraint):
        time.sleep(self.delay)
        return super().supports(constraint)


def test_a_constraint_is_checked_in_the_pool_within_the_time_limit():
    registry = Registry("structured_output_backend", "--guided-decoding-backend")
    registry.register("slowcheck", SlowCheckBackend, plugin_name="test")
    manager = StructuredOutputManager(
        StructuredOutputConfig(compile_timeout=0.3), registry, FakeTokenizer(), VOCAB_SIZE, [EOS]
    )
    try:
        SlowCheckBackend.delay = 0.0
        checking = manager.check({"regex": "5 6"}, client="a")
        assert checking.result(timeout=10) == ("slowcheck", manager.resolve({"regex": "5 6"})[1])
        with pytest.raises(InvalidRequestError, match="not token ids"):  # request errors come out of the Future
            manager.submit(*manager.check({"regex": "five"}).result(timeout=10)).result(timeout=10)
        bad = manager.check({"regex": 5})
        with pytest.raises(InvalidRequestError, match="non-empty string"):
            bad.result(timeout=10)
        SlowCheckBackend.delay = 1.0
        with pytest.raises(InvalidRequestError, match="checking the guided-decoding constraint took longer") as error:
            manager.check({"regex": "7"}, client="a").result(timeout=10)
        assert error.value.param == "structured_outputs"
    finally:
        SlowCheckBackend.delay = 0.0
        manager.shutdown()


def test_one_client_cannot_hold_every_runaway_slot():
    from tokenloom.core.structured_output_compile import MAX_RUNAWAY_COMPILES, MAX_RUNAWAY_PER_CLIENT
    from tokenloom.errors import OverloadedError

    assert MAX_RUNAWAY_PER_CLIENT < MAX_RUNAWAY_COMPILES
    manager = make_slow_manager(compile_timeout=0.2)
    try:
        stuck = [manager.submit(*manager.resolve({"regex": f"0 {i}"}), client="greedy") for i in range(3)]
        for future in stuck[:MAX_RUNAWAY_PER_CLIENT]:
            with pytest.raises(InvalidRequestError, match="took longer"):
                future.result(timeout=10)
        # the third waited in line behind the client's own compiles; when they had run away it
        # got the client's 429 instead of becoming one more
        with pytest.raises(OverloadedError, match="2 of your constraints are still compiling"):
            stuck[2].result(timeout=10)
        with pytest.raises(OverloadedError, match="of your constraints are still compiling"):
            manager.submit(*manager.resolve({"regex": "0 9"}), client="greedy")
        assert manager._pool.num_runaway == MAX_RUNAWAY_PER_CLIENT
        # another client still compiles, and so does a request without a client (offline)
        assert manager.submit(*manager.resolve({"regex": "5"}), client="polite").result(timeout=10).compiled == (5,)
        assert manager.submit(*manager.resolve({"regex": "6"})).result(timeout=10).compiled == (6,)
        # the refused compile was not remembered as a failure: once the runaways end it compiles
        SlowBackend.release.set()
        deadline = time.monotonic() + 10
        while manager._pool.num_runaway and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager._pool.num_runaway_of("greedy") == 0
        assert manager.submit(*manager.resolve({"regex": "0 2"}), client="greedy").result(timeout=10).compiled == (0, 2)
    finally:
        SlowBackend.release.set()
        manager.shutdown()


def test_a_clients_jobs_run_one_at_a_time_and_the_others_are_not_held_up():
    manager = make_slow_manager(compile_timeout=30)
    try:
        held = manager.submit(*manager.resolve({"regex": "0 1"}), client="a")
        waiting = manager.submit(*manager.resolve({"regex": "4"}), client="a")
        # the second thread is free for another client while a's second compile waits in line
        assert manager.submit(*manager.resolve({"regex": "5"}), client="b").result(timeout=10).compiled == (5,)
        assert not waiting.done()
        SlowBackend.release.set()
        assert waiting.result(timeout=10).compiled == (4,)
        assert held.result(timeout=10).compiled == (0, 1)
    finally:
        SlowBackend.release.set()
        manager.shutdown()


class CancellableBackend(DigitsBackend):
    """Works until told it overran, as a backend with a killable child process does."""

    def compile(self, constraint):
        from tokenloom.core.structured_output_compile import compile_cancelled

        if constraint.spec.startswith("0"):
            while not compile_cancelled():
                time.sleep(0.01)
            raise TimeoutError("stopped")
        return super().compile(constraint)


def test_a_backend_that_watches_compile_cancelled_frees_its_thread():
    registry = Registry("structured_output_backend", "--guided-decoding-backend")
    registry.register("cancellable", CancellableBackend, plugin_name="test")
    manager = StructuredOutputManager(
        StructuredOutputConfig(compile_timeout=0.2), registry, FakeTokenizer(), VOCAB_SIZE, [EOS]
    )
    try:
        future = manager.submit(*manager.resolve({"regex": "0"}), client="a")
        with pytest.raises(InvalidRequestError, match="took longer"):
            future.result(timeout=10)
        deadline = time.monotonic() + 5
        while manager._pool.num_runaway and time.monotonic() < deadline:
            time.sleep(0.02)
        assert manager._pool.num_runaway == 0 and manager._pool.num_runaway_of("a") == 0
        # the overrun is what the cache remembers, not the backend's own error
        again = manager.submit(*manager.resolve({"regex": "0"}), client="a")
        assert "took longer" in str(again.exception(timeout=1))
    finally:
        manager.shutdown()


# -- which backends a request may choose -----------------------------------------------------


def test_request_backends_any_is_the_default():
    manager = make_manager(backend="digits")
    assert manager.resolve({"choice": ["5"], "backend": "choices"})[0] == "choices"


def test_request_backends_none_refuses_another_backend_like_vllm():
    manager = make_manager(backend="digits", request_backends="none")
    assert manager.resolve({"regex": "5", "backend": "digits"})[0] == "digits"  # the server's own
    assert manager.resolve({"regex": "5"})[0] == "digits"
    with pytest.raises(
        InvalidRequestError, match="does not let a request choose the guided-decoding backend 'choices'"
    ) as error:
        manager.resolve({"choice": ["5"], "backend": "choices"})
    assert error.value.param == "guided_decoding_backend"
    assert "remove backend" in str(error.value)


def test_request_backends_lists_the_ones_a_request_may_name():
    manager = make_manager(request_backends="choices")
    assert manager.resolve({"choice": ["5"], "backend": "choices"})[0] == "choices"
    with pytest.raises(InvalidRequestError, match="may also name choices"):
        manager.resolve({"regex": "5", "backend": "digits"})
    assert manager.resolve({"regex": "5"})[0] == "digits"  # auto still picks freely


def test_request_backends_with_an_unknown_name_fails_at_start_up():
    with pytest.raises(ConfigError, match="unknown backend.*outlinez.*digits, choices"):
        make_manager(request_backends="digits,outlinez")
