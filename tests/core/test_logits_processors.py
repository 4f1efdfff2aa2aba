"""Logits processors: the plugin kind (hook, registry, built-in ``no_repeat_ngram``), the checks
a request's ``logits_processors`` pass (registered names, ``--logits-processor-pattern``), and
their exact effect in the sampler, row by row, including a failing processor."""

from __future__ import annotations

import pytest
import torch

from tokenloom.core.logits_processors import (
    LogitsProcessor,
    LogitsProcessorResolver,
    LogitsProcessorSpec,
    build_processor,
    resolve_engine_processors,
)
from tokenloom.core.sampler import Sampler, SamplingMetadata, SamplingState
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.errors import ConfigError, InvalidRequestError
from tokenloom.plugins.manager import load_plugins
from tokenloom.plugins.registry import Registry

MODULE = "tests.core.test_logits_processors"  # importable by this name from the repository root
BUILTIN_MODULE = "tokenloom.builtin_plugins.logits_processors"


class BanTokens(LogitsProcessor):
    """Bans the given token ids (module level: importable by qualified name)."""

    def __init__(self, *token_ids):
        self.token_ids = list(token_ids)

    def __call__(self, prompt_token_ids, output_token_ids, logits):
        logits[self.token_ids] = float("-inf")
        return logits


def boost_last_output_token(output_token_ids, logits):
    """vLLM's older two-argument form, as a plain function."""
    if output_token_ids:
        logits[output_token_ids[-1]] += 100.0
    return logits


def force_token_five(prompt_token_ids, output_token_ids, logits):
    logits[:5] = float("-inf")
    logits[6:] = float("-inf")
    return logits


def broken_processor(prompt_token_ids, output_token_ids, logits):
    raise ValueError("boom")


def registry_with(**targets) -> Registry:
    registry = Registry("logits_processor", "--logits-processors")
    for name, target in targets.items():
        registry.register(name, target, plugin_name="test")
    return registry


# -- the plugin kind ----------------------------------------------------------------------------


@pytest.mark.hook("register_logits_processors")
def test_the_builtin_plugin_registers_no_repeat_ngram_through_the_hook():
    plugins = load_plugins(modules=[BUILTIN_MODULE], entry_points=False)
    registry = plugins.registry("logits_processor")
    assert "no_repeat_ngram" in registry
    assert registry.entry("no_repeat_ngram").plugin_name == BUILTIN_MODULE
    # plain data for workers, like every other kind
    assert plugins.to_plain()["logits_processor"]["no_repeat_ngram"]["target"].endswith(":NoRepeatNGramLogitsProcessor")
    processor = registry.get("no_repeat_ngram")(ngram_size=2)
    assert isinstance(processor, LogitsProcessor)


def test_no_repeat_ngram_bans_exactly_the_tokens_that_would_repeat_a_bigram():
    processor = build_processor(
        LogitsProcessorSpec(
            "no_repeat_ngram",
            "tokenloom.builtin_plugins.logits_processors.no_repeat_ngram:NoRepeatNGramLogitsProcessor",
            kwargs={"ngram_size": 2},
        )
    )
    # prompt 1 2 3 1: the bigrams (1,2) (2,3) (3,1) were seen; the last token is 1, so 2 is banned
    logits = processor([1, 2, 3, 1], [], torch.zeros(6))
    assert torch.isinf(logits).nonzero().flatten().tolist() == [2]
    # one step later (output 5): (1,5) is new; last token 5 was never followed by anything
    logits = processor([1, 2, 3, 1], [5], torch.zeros(6))
    assert not torch.isinf(logits).any()
    # output 5 1: after 1 come 2 (prompt) and 5 (output)
    logits = processor([1, 2, 3, 1], [5, 1], torch.zeros(6))
    assert torch.isinf(logits).nonzero().flatten().tolist() == [2, 5]


def test_no_repeat_ngram_refuses_a_bad_size():
    with pytest.raises(ValueError, match="ngram_size"):
        build_processor(
            LogitsProcessorSpec(
                "n",
                "tokenloom.builtin_plugins.logits_processors.no_repeat_ngram:NoRepeatNGramLogitsProcessor",
                kwargs={"ngram_size": 0},
            )
        )


# -- what a request may name ----------------------------------------------------------------------


def test_a_registered_name_is_allowed_without_a_pattern_and_gets_its_arguments():
    resolver = LogitsProcessorResolver(registry_with(ban=f"{MODULE}:BanTokens"), pattern=None)
    [spec] = resolver.resolve([{"qualname": "ban", "args": [3, 4]}])
    assert spec == LogitsProcessorSpec("ban", f"{MODULE}:BanTokens", (3, 4), {})
    assert resolver.resolve(["ban"])[0].args == ()


def test_a_qualified_name_needs_the_pattern():
    resolver = LogitsProcessorResolver(registry_with(), pattern=None)
    with pytest.raises(InvalidRequestError, match="--logits-processor-pattern") as refused:
        resolver.resolve([f"{MODULE}.BanTokens"])
    assert refused.value.param == "logits_processors"


def test_a_qualified_name_matching_the_pattern_is_imported_and_one_that_does_not_is_refused():
    resolver = LogitsProcessorResolver(registry_with(), pattern=r"tests\.core\..*")
    [function_spec, class_spec] = resolver.resolve(
        [f"{MODULE}.boost_last_output_token", {"qualname": f"{MODULE}.BanTokens", "args": [1]}]
    )
    assert function_spec.target == f"{MODULE}:boost_last_output_token" and not function_spec.construct
    assert class_spec.target == f"{MODULE}:BanTokens" and class_spec.construct
    with pytest.raises(InvalidRequestError, match="does not match --logits-processor-pattern"):
        resolver.resolve(["os.system"])
    with pytest.raises(InvalidRequestError, match="could not be resolved"):
        resolver.resolve([f"{MODULE}.NoSuchThing"])


def test_the_pattern_must_match_the_whole_name():
    resolver = LogitsProcessorResolver(registry_with(), pattern=r"tests\.core")  # a prefix of MODULE
    with pytest.raises(InvalidRequestError, match="the whole name must match"):
        resolver.resolve([f"{MODULE}.BanTokens"])


@pytest.mark.parametrize(
    "qualname",
    [
        # the audit's: one allowed module, then an attribute walk out of it to os.system
        f"{BUILTIN_MODULE}.no_repeat_ngram:torch.os.system",
        f"{BUILTIN_MODULE}.no_repeat_ngram.torch.os.system",
        f"{BUILTIN_MODULE}.no_repeat_ngram:torch",  # a module the allowed one imported
        f"{BUILTIN_MODULE}.no_repeat_ngram:LogitsProcessor",  # a class it imported, defined elsewhere
        f"{BUILTIN_MODULE}.no_repeat_ngram:__builtins__",
        "/tmp/processor.py:Processor",  # a file path
        f"{BUILTIN_MODULE}.no_repeat_ngram:",
    ],
)
def test_a_request_reaches_only_classes_and_functions_defined_in_the_module_it_names(qualname, tmp_path):
    marker = tmp_path / "pwned"
    resolver = LogitsProcessorResolver(registry_with(), pattern=BUILTIN_MODULE.replace(".", r"\.") + r"\..*")
    with pytest.raises(InvalidRequestError) as refused:
        resolver.resolve([{"qualname": qualname, "args": [f"touch {marker}"]}])
    assert refused.value.param == "logits_processors"
    assert not marker.exists()


def test_a_class_defined_in_an_allowed_module_is_built_with_its_arguments():
    resolver = LogitsProcessorResolver(registry_with(), pattern=BUILTIN_MODULE.replace(".", r"\.") + r"\..*")
    [spec] = resolver.resolve(
        [{"qualname": f"{BUILTIN_MODULE}.no_repeat_ngram.NoRepeatNGramLogitsProcessor", "kwargs": {"ngram_size": 3}}]
    )
    assert spec.target == f"{BUILTIN_MODULE}.no_repeat_ngram:NoRepeatNGramLogitsProcessor" and spec.construct


def test_bad_entries_and_bad_arguments_are_the_requests_400():
    resolver = LogitsProcessorResolver(
        registry_with(ngram="tokenloom.builtin_plugins.logits_processors.no_repeat_ngram:NoRepeatNGramLogitsProcessor"),
        None,
    )
    with pytest.raises(InvalidRequestError, match="could not be built: ValueError: ngram_size"):
        resolver.resolve([{"qualname": "ngram", "kwargs": {"ngram_size": -1}}])
    with pytest.raises(InvalidRequestError, match="qualname"):
        resolver.resolve([{"name": "ngram"}])
    with pytest.raises(InvalidRequestError, match="at most"):
        resolver.resolve(["ngram"] * 17)


def test_engine_processors_come_from_the_registry_or_an_import_path():
    specs = resolve_engine_processors(
        ["ban", f"{MODULE}.boost_last_output_token"], registry_with(ban=f"{MODULE}:BanTokens")
    )
    assert [(spec.name, spec.construct) for spec in specs] == [
        ("ban", True),
        (f"{MODULE}.boost_last_output_token", False),
    ]
    with pytest.raises(ConfigError, match="--logits-processors: 'no.such.Processor'") as refused:
        resolve_engine_processors(["no.such.Processor"], registry_with())
    assert refused.value.param == "logits-processors"


# -- in the sampler -------------------------------------------------------------------------------


def state_with(processors, engine_processors=(), output=()) -> SamplingState:
    return SamplingState(
        SamplingParams(temperature=0.0, logits_processors=processors),
        [7],
        list(output),
        engine_logits_processors=list(engine_processors),
    )


def test_processors_apply_to_their_own_row_only():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [0.0, 5.0, 1.0, 0.0], [0.0, 5.0, 1.0, 0.0]])
    ban_one = LogitsProcessorSpec("ban", f"{MODULE}:BanTokens", (1,))
    states = [
        state_with([ban_one]),
        state_with(None),
        state_with([boost_last_output_token], output=[3]),
    ]
    output = Sampler()(logits, SamplingMetadata.build(states, 4))
    assert output.token_ids == [2, 1, 3]
    assert output.errors == {}


def test_engine_wide_processors_run_before_the_requests_own():
    ban_one = LogitsProcessorSpec("ban", f"{MODULE}:BanTokens", (1,))
    ban_two = LogitsProcessorSpec("ban", f"{MODULE}:BanTokens", (2,))
    state = state_with([ban_two], engine_processors=[ban_one])
    output = Sampler()(torch.tensor([[0.0, 5.0, 4.0, 3.0]]), SamplingMetadata.build([state], 4))
    assert output.token_ids == [3]


def test_a_failing_processor_fails_its_row_and_not_the_others():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    states = [state_with([broken_processor]), state_with(None)]
    output = Sampler()(logits, SamplingMetadata.build(states, 3))
    assert output.token_ids == [-1, 1]
    assert "ValueError: boom" in output.errors[0] and 1 not in output.errors


def test_a_processor_returning_the_wrong_shape_fails_its_row():
    state = state_with([lambda prompt, output, logits: logits[:2]])
    output = Sampler()(torch.tensor([[0.0, 5.0, 1.0]]), SamplingMetadata.build([state], 3))
    assert output.token_ids == [-1] and "shape" in output.errors[0]


def test_raw_logprobs_are_taken_before_the_processor_and_processed_after():
    ban_one = LogitsProcessorSpec("ban", f"{MODULE}:BanTokens", (1,))
    logits = torch.tensor([[0.0, 5.0, 1.0]])

    def chosen_logprob(mode):
        state = SamplingState(SamplingParams(temperature=0.0, logprobs=0, logits_processors=[ban_one]), [7], [])
        return Sampler(mode)(logits, SamplingMetadata.build([state], 3)).logprobs[0]

    raw, processed = chosen_logprob("raw_logits"), chosen_logprob("processed_logits")
    assert raw.token_ids == [2] and raw.logprobs == [1.0] and raw.rank == 2
    assert processed.token_ids == [2] and processed.rank == 1


# -- through the engine ----------------------------------------------------------------------------


def test_engine_logits_processors_apply_to_every_request_and_request_ones_offline(tiny_llama_dir):
    from tokenloom import LLM

    llm = LLM(model=tiny_llama_dir, dtype="float32", logits_processors=[f"{MODULE}.force_token_five"])
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True))
    assert [output.outputs[0].token_ids for output in outputs] == [[5] * 4, [5] * 4]
    # offline, a request may hand its own callables to the in-process worker
    plain = LLM(model=tiny_llama_dir, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logits_processors=[force_token_five])
    assert plain.generate(["Hello"], params)[0].outputs[0].token_ids == [5, 5, 5]


def test_a_failing_processor_ends_its_request_with_an_error_and_spares_the_others(tiny_llama_dir):
    from tokenloom import LLM

    llm = LLM(model=tiny_llama_dir, dtype="float32")
    failing = SamplingParams(temperature=0.0, max_tokens=3, logits_processors=[broken_processor])
    healthy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = llm.engine
    engine.add_request("bad", "Hello", failing)
    engine.add_request("good", "Hello", healthy)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert len(finished["good"].outputs[0].token_ids) == 3
