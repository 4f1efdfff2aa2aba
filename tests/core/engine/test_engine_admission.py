"""Issue 20 item 3 at the engine: a request's n sequences are admitted all or none. A refusal
part-way (an id collision with a live sequence, a full waiting queue, a grammar that cannot
take the request) leaves nothing queued, no KV blocks held and nothing to abort."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.errors import InvalidRequestError, OverloadedError

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=4, max_waiting_requests=2)


def run_to_completion(engine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_blocks
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_a_sequence_id_collision_queues_nothing_of_the_new_request(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("q#1", PROMPT, params)
    # request "q" with n=2 would hold sequences q#0 and q#1: the second is taken
    with pytest.raises(InvalidRequestError, match="'q#1' is already in use") as refused:
        engine.add_request("q", PROMPT, params.clone(n=2))
    assert refused.value.param == "request_id"
    assert engine.scheduler.get_sequence("q#0") is None and "q" not in engine.requests
    # and the other way round: a request named like a live request's sequence
    engine.add_request("r", PROMPT, params.clone(n=2))
    with pytest.raises(InvalidRequestError, match="'r#0' is already in use"):
        engine.add_request("r#0", PROMPT, params)
    assert sorted(run_to_completion(engine)) == ["q#1", "r"]
    assert_idle(engine)


def test_a_full_waiting_queue_refuses_the_whole_request(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    engine.add_request("b", PROMPT, params)  # two waiting: the limit
    with pytest.raises(OverloadedError, match="--max-waiting-requests 2"):
        engine.add_request("c", PROMPT, params.clone(n=3))
    assert [engine.scheduler.get_sequence(f"c#{i}") for i in range(3)] == [None] * 3
    assert engine.stats().num_waiting == 2 and "c" not in engine.requests
    # the id is free again: the same request is admitted whole once there is room
    assert sorted(run_to_completion(engine)) == ["a", "b"]
    engine.add_request("c", PROMPT, params.clone(n=3))
    [output] = run_to_completion(engine).values()
    assert [completion.finish_reason for completion in output.outputs] == ["length"] * 3
    assert_idle(engine)


def test_a_constrained_request_refused_after_its_compile_leaves_no_matcher(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    engine.add_request("b", PROMPT, params)
    guided = params.clone(n=2, structured_outputs={"choice": ["yes", "no"]})
    engine.submit_structured_output(guided).result()  # compiled: admission is decided at once
    with pytest.raises(OverloadedError):
        engine.add_request("g", PROMPT, guided)
    assert not engine.structured_outputs._sequences and "g" not in engine.requests
    assert sorted(run_to_completion(engine)) == ["a", "b"]
    assert_idle(engine)
