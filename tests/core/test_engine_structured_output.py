"""Guided decoding through the real engine, with a tiny random Llama and the SmolLM2 tokenizer
(random weights: only the constraint makes the output valid): validity for every built-in
backend, identical greedy output under preemption with the matchers rebuilt, n > 1 with
seeds, compiles that do not stall other requests, and failures that stay with their request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.core import grammar_test_backends
from tokenloom import LLM, SamplingParams
from tokenloom.core.engine import AsyncLLM
from tokenloom.errors import InvalidRequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "size": {"enum": ["S", "M", "L"]},
        "fresh": {"type": "boolean"},
        "code": {"type": "string", "pattern": "^[a-z]{2}$"},
    },
    "required": ["size", "fresh", "code"],
}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["apple", "banana split", "cherry"]
GRAMMAR = 'start: WORD (" " WORD)* "."\nWORD: "red" | "green"\n'
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away", "1, 2, 3,"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", plugins=["tests.core.grammar_test_backends"])


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def constraint(kind: str, backend: str | None = None) -> dict:
    value = {"json": SCHEMA, "regex": REGEX, "choice": CHOICES}[kind]
    # random weights love whitespace: compact JSON keeps every output short
    options = {"disable_any_whitespace": True} if kind == "json" else {}
    return {kind: value, **options, **({"backend": backend} if backend else {})}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance", "outlines", "lm-format-enforcer"])
def test_every_backend_makes_random_weights_produce_valid_output(llm, backend):
    kinds = ["json", "regex", "choice"]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=constraint(kind, backend))
        for kind in kinds
        for seed in range(2)
    ]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    for output, kind in zip(outputs, [kind for kind in kinds for _ in range(2)]):
        assert output.outputs[0].finish_reason == "stop"
        check(kind, output.outputs[0].text)


@pytest.mark.parametrize(
    "flags", [["--guided-decoding-backend", "guidance"], ["--structured-outputs-config", '{"backend": "guidance"}']]
)
def test_guidance_as_the_server_default_from_either_flag(tiny_llama_dir, flags):
    from tokenloom.api.serve_args import check_plugin_choices, parse_serve_args
    from tokenloom.plugins.manager import load_plugins

    serve_args = parse_serve_args([tiny_llama_dir, *flags, "--dtype", "float32"], {})
    serve_args.plugins = load_plugins()
    check_plugin_choices(serve_args)  # the name is registered and its class imports
    engine_kwargs = {key: value for key, value in serve_args.engine_kwargs.items() if key.startswith("guided_")}
    llm = LLM(model=tiny_llama_dir, dtype="float32", **engine_kwargs)
    manager = llm.engine.structured_outputs
    assert manager.resolve({"regex": REGEX})[0] == "guidance"
    # what guidance cannot express falls back, in auto's order
    assert manager.resolve({"json": SCHEMA, "whitespace_pattern": " ?"})[0] == "outlines"
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs={"grammar": GRAMMAR})
    text = llm.generate([PROMPTS[0]], params)[0].outputs[0].text
    assert re.fullmatch(r"(red|green)( (red|green))*\.", text), text


def test_greedy_output_is_the_same_when_preemption_rebuilds_the_matchers(tiny_llama_dir, llm):
    kinds = ["json", "regex", "choice", "json"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint(kind)) for kind in kinds]
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    # 12 blocks of 4 tokens: the four sequences cannot all stay in the cache at once
    small = LLM(model=tiny_llama_dir, dtype="float32", block_size=4, num_gpu_blocks_override=12)
    texts = [o.outputs[0].text for o in small.generate(PROMPTS, params)]
    assert texts == expected
    for kind, text in zip(kinds, texts):
        check(kind, text)
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.structured_outputs.stats.matcher_resets > 0
    assert small.engine.structured_outputs.stats.replayed_tokens > 0


def test_n_sequences_each_get_their_own_matcher_and_seeds_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=60, structured_outputs=constraint("json"))
    first, again = llm.generate([PROMPTS[0]], params)[0], llm.generate([PROMPTS[0]], params)[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    for completion in first.outputs:
        check("json", completion.text)
    logprob_params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, logprobs=2, stop=["-"], structured_outputs=constraint("regex")
    )
    output = llm.generate([PROMPTS[1]], logprob_params)[0].outputs[0]
    assert output.text == re.match(r"[0-9]{3}", output.text).group(0)  # cut by the stop string
    assert len(output.logprobs) == len(output.token_ids)


def test_a_compiling_request_waits_outside_the_scheduler_without_stalling_others(llm):
    engine = llm.engine
    grammar_test_backends.COMPILE_GATE.clear()
    try:
        engine.add_request(
            "guided",
            PROMPTS[0],
            SamplingParams(
                temperature=0.0, max_tokens=30, structured_outputs={"regex": "[a-c]{4}", "backend": "gated"}
            ),
        )
        engine.add_request("free", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        finished = {}
        while "free" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.scheduler.get_sequence("guided") is None  # still compiling: never scheduled
        assert engine.has_unfinished_requests()
    finally:
        grammar_test_backends.COMPILE_GATE.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch("[a-c]{4}", finished["guided"].outputs[0].text)


def test_a_failed_deferred_compile_finishes_that_request_with_the_error(llm):
    grammar_test_backends.COMPILE_GATE.clear()
    try:
        llm.engine.add_request(
            "refused",
            PROMPTS[0],
            SamplingParams(max_tokens=5, structured_outputs={"regex": "refuse", "backend": "gated"}),
        )
    finally:
        grammar_test_backends.COMPILE_GATE.set()
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    [output] = outputs
    assert output.finished and output.outputs[0].finish_reason == "error"
    assert "refusing to compile on purpose" in output.outputs[0].stop_reason


def test_a_backend_failing_mid_generation_fails_only_its_request(llm):
    broken, healthy = llm.generate(
        PROMPTS[:2],
        [
            SamplingParams(
                temperature=0.0, max_tokens=30, structured_outputs={"regex": "[a-z]{9}", "backend": "breaking"}
            ),
            SamplingParams(temperature=0.0, max_tokens=30, structured_outputs={"regex": "[a-z]{9}"}),
        ],
    )
    assert broken.outputs[0].finish_reason == "error"
    assert "the matcher broke on purpose" in broken.outputs[0].stop_reason
    assert len(broken.outputs[0].token_ids) <= grammar_test_backends.BREAK_AFTER_TOKENS + 1
    assert re.fullmatch("[a-z]{9}", healthy.outputs[0].text) and healthy.outputs[0].finish_reason == "stop"
    assert not llm.engine.structured_outputs._sequences  # nothing left behind


def test_the_constraint_starts_after_the_reasoning_section(tiny_llama_dir):
    reasoning = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        plugins=["tests.core.grammar_test_backends"],
        reasoning_parser="first_tokens",
    )
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_outputs={"regex": "[0-9]{6}"})
    output = reasoning.generate([PROMPTS[2]], params)[0].outputs[0]
    thinking = grammar_test_backends.REASONING_TOKENS
    answer = reasoning.get_tokenizer().decode(output.token_ids[thinking:], skip_special_tokens=True)
    assert re.fullmatch("[0-9]{6}", answer) and output.finish_reason == "stop"
    free = reasoning.get_tokenizer().decode(output.token_ids[:thinking])
    assert not re.fullmatch("[0-9]*", free)  # random weights: the reasoning part was not constrained


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"regex": "a(b"}, "xgrammar cannot compile a regex"),
        ({"grammar": "root ::= missing", "backend": "xgrammar"}, 'Rule "missing" is not defined'),
        ({"grammar": 'root ::= "a"', "backend": "outlines"}, "outlines (outlines-core) compiles regular languages"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "xgrammar cannot compile"),
        ({"regex": "a", "backend": "grammarly"}, "unknown guided_decoding_backend 'grammarly'"),
    ],
)
def test_bad_constraints_fail_in_the_prepare_step(llm, bad, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        llm.engine.submit_structured_output(SamplingParams(structured_outputs=bad)).result()
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_async_generate_rejects_a_bad_constraint_before_queueing_it(llm):
    async_llm = AsyncLLM(llm.engine)
    try:
        with pytest.raises(InvalidRequestError, match="xgrammar cannot compile a regex"):
            async for _ in async_llm.generate(PROMPTS[0], SamplingParams(structured_outputs={"regex": "a(b"}), "bad"):
                pass
        assert async_llm._commands.empty()
        params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"choice": CHOICES})
        outputs = [output async for output in async_llm.generate(PROMPTS[0], params, "good")]
        assert outputs[-1].finished and outputs[-1].outputs[0].text in CHOICES
    finally:
        # stop the loop thread but keep the engine: the module's other tests share it
        async_llm._stopping = True
        async_llm._wakeup.set()
        if async_llm._thread is not None:
            async_llm._thread.join(30)
