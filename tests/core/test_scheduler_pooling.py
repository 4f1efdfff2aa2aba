"""The scheduler with pooling requests: prefill-only, never chunked (a prompt over the
budget runs whole and alone), no prefix-cache hits, many short prompts per step under the
token budget and the sequence cap, finished and freed in the step that computed them."""

from __future__ import annotations

from tokenloom.core.batch import ModelRunnerOutput
from tokenloom.core.config import CacheConfig, SchedulerConfig
from tokenloom.core.sampling_params import PoolingParams, SamplingParams
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.sequence import EngineSequence, SequenceStatus


def make_scheduler(budget=32, max_num_seqs=8, num_blocks=64, max_model_len=40, prefix_caching=True):
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=4, enable_prefix_caching=prefix_caching),
        num_blocks,
        max_model_len,
    )


def pooling_request(request_id: str, num_tokens: int, first_token: int = 10) -> EngineSequence:
    return EngineSequence(
        seq_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + num_tokens)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=PoolingParams(),
    )


def pooled_output(scheduler_output, skip=()) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        pooled={req_id: [float(n)] for req_id, n in scheduler_output.num_scheduled_tokens.items() if req_id not in skip}
    )


def run_to_completion(scheduler) -> list[dict[str, int]]:
    steps = []
    while scheduler.has_unfinished_sequences():
        output = scheduler.schedule()
        steps.append(dict(output.num_scheduled_tokens))
        finished = scheduler.update_from_output(output, pooled_output(output))
        assert all(request.status is SequenceStatus.FINISHED_STOPPED for request in finished)
    return steps


def test_many_short_prompts_share_steps_under_the_budget_and_the_sequence_cap():
    scheduler = make_scheduler(budget=32, max_num_seqs=8)
    for index in range(40):
        scheduler.add_sequence(pooling_request(f"r{index}", 3 + index % 4))
    steps = run_to_completion(scheduler)
    assert sorted(req_id for step in steps for req_id in step) == sorted(f"r{index}" for index in range(40))
    for step in steps:
        assert sum(step.values()) <= 32 and len(step) <= 8
        # every prompt is scheduled whole
        assert all(num_tokens == 3 + int(req_id[1:]) % 4 for req_id, num_tokens in step.items())
    assert len(steps) <= 8  # batched, not one request per step
    assert scheduler.block_manager.num_free_blocks == 64


def test_pooling_prompts_are_never_chunked_and_a_long_one_runs_alone():
    scheduler = make_scheduler(budget=8)
    scheduler.add_sequence(pooling_request("short", 3))
    scheduler.add_sequence(pooling_request("long", 20))
    scheduler.add_sequence(pooling_request("after", 2))
    steps = run_to_completion(scheduler)
    assert steps == [{"short": 3}, {"long": 20}, {"after": 2}]


def test_a_pooling_prompt_may_fill_the_context():
    scheduler = make_scheduler(budget=64, max_model_len=40)
    scheduler.add_sequence(pooling_request("full", 40))
    assert run_to_completion(scheduler) == [{"full": 40}]


def test_pooling_requests_finish_and_free_their_blocks_in_the_step_that_computed_them():
    scheduler = make_scheduler()
    scheduler.add_sequence(pooling_request("a", 9))
    output = scheduler.schedule()
    assert output.scheduled_new_reqs[0].pooling_params == PoolingParams()
    assert scheduler.block_manager.num_free_blocks < 64
    finished = scheduler.update_from_output(output, pooled_output(output))
    assert [request.seq_id for request in finished] == ["a"]
    assert finished[0].status is SequenceStatus.FINISHED_STOPPED
    assert not scheduler.has_unfinished_sequences()
    assert scheduler.block_manager.num_free_blocks == 64
    assert scheduler.schedule().finished_req_ids == {"a"}  # the worker forgets it


def test_a_prompt_the_runner_did_not_pool_finishes_with_an_error():
    scheduler = make_scheduler()
    scheduler.add_sequence(pooling_request("a", 3))
    scheduler.add_sequence(pooling_request("b", 3))
    output = scheduler.schedule()
    finished = {r.seq_id: r for r in scheduler.update_from_output(output, pooled_output(output, skip={"b"}))}
    assert finished["a"].status is SequenceStatus.FINISHED_STOPPED
    assert finished["b"].status is SequenceStatus.FINISHED_ERROR
    assert "no pooled output" in finished["b"].stop_reason


def test_pooling_requests_take_no_prefix_cache_hits():
    scheduler = make_scheduler()
    scheduler.add_sequence(pooling_request("first", 12))
    run_to_completion(scheduler)
    scheduler.add_sequence(pooling_request("again", 12))  # the same tokens: its blocks are cached
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"again": 12}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0
