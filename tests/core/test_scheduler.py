"""Scheduler: token budget and sequence cap, chunked prefill next to decodes, preemption and
exact resumption, priority and FCFS order, admission control, aborts, finished ids, and the
token-level stops. A fake worker below stands in for the model: it keeps per-request state
only from what SchedulerOutput tells it, writes token ids into a fake paged KV cache, and
samples a token from what it reads back, so wrong block tables or prefix hits change output."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import pytest

from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenloom.core.config import CacheConfig, SchedulerConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.sequence import EngineSequence, SequenceStatus
from tokenloom.core.step_budget import DEFAULT_MAX_NUM_BATCHED_TOKENS
from tokenloom.errors import ConfigError, ContextLengthError, InvalidRequestError, OverloadedError

EOS = 2


def hash_next_token(request_id: str, context: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole visible context."""
    recent = context[-5:]
    return 100 + (sum((i + 1) * t for i, t in enumerate(recent)) * 31 + len(context)) % 800


def expected_tokens(prompt: list[int], num_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(hash_next_token("", context))
    return context[len(prompt) :]


@dataclass
class WorkerRequestState:
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int


@dataclass
class FakeWorker:
    """Turns a SchedulerOutput into a ModelRunnerOutput the way a real worker would."""

    num_blocks: int
    block_size: int
    next_token: object = hash_next_token
    # request id -> scripted tokens to sample, in order (overrides next_token)
    scripts: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    logprobs: bool = False
    states: dict[str, WorkerRequestState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv_cache = [[None] * self.block_size for _ in range(self.num_blocks)]

    def slot(self, state: WorkerRequestState, position: int) -> tuple[int, int]:
        return state.block_table[position // self.block_size], position % self.block_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            assert new.req_id not in self.states
            self.states[new.req_id] = WorkerRequestState(
                list(new.prompt_token_ids) + list(new.output_token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_table.extend(cached.new_block_ids)
        scheduled_ids = {n.req_id for n in scheduler_output.scheduled_new_reqs} | {
            c.req_id for c in scheduler_output.scheduled_cached_reqs
        }
        assert scheduled_ids == set(scheduler_output.num_scheduled_tokens)
        owners = Counter(block_id for state in self.states.values() for block_id in state.block_table)

        output = ModelRunnerOutput()
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.states[req_id]
            start = state.num_computed_tokens
            assert num_tokens >= 1 and start + num_tokens <= len(state.token_ids)
            assert len(state.block_table) * self.block_size >= start + num_tokens
            for position in range(start, start + num_tokens):
                block_id, offset = self.slot(state, position)
                assert owners[block_id] == 1, "wrote into a block another request shares"
                self.kv_cache[block_id][offset] = state.token_ids[position]
            state.num_computed_tokens += num_tokens
            if req_id in self.errors:
                continue
            if state.num_computed_tokens < len(state.token_ids):
                output.sampled_token_ids[req_id] = []
                continue
            context = [self.kv_cache[b][o] for b, o in (self.slot(state, p) for p in range(len(state.token_ids)))]
            assert context == state.token_ids, f"{req_id}: the KV cache does not hold the sequence"
            script = self.scripts.get(req_id)
            token_id = script.pop(0) if script else self.next_token(req_id, context)
            state.token_ids.append(token_id)
            output.sampled_token_ids[req_id] = [token_id]
            if self.logprobs:
                output.logprobs[req_id] = [TokenLogprobs(token_ids=[token_id], logprobs=[-0.5], rank=1)]
        output.errors = {
            req_id: message
            for req_id, message in self.errors.items()
            if req_id in scheduler_output.num_scheduled_tokens
        }
        return output


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256, **scheduler_args) -> Scheduler:
    enable_prefix_caching = scheduler_args.pop("enable_prefix_caching", True)
    return Scheduler(
        SchedulerConfig(**scheduler_args),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )


def make_request(
    request_id: str, prompt, priority: int = 0, arrival_time: float | None = None, **sampling_args
) -> EngineSequence:
    sampling_args.setdefault("max_tokens", 8)
    extra = {} if arrival_time is None else {"arrival_time": arrival_time}
    return EngineSequence(
        seq_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**sampling_args),
        eos_token_ids={EOS},
        priority=priority,
        **extra,
    )


@dataclass
class Run:
    outputs: list[SchedulerOutput] = field(default_factory=list)
    finished: dict[str, EngineSequence] = field(default_factory=dict)


def run(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 500, run_log: Run | None = None) -> Run:
    run_log = run_log or Run()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_sequences():
            return run_log
        step(scheduler, worker, run_log)
    raise AssertionError("requests did not finish")


def step(scheduler: Scheduler, worker: FakeWorker, run_log: Run | None = None) -> SchedulerOutput:
    scheduler_output = scheduler.schedule()
    # the one exception: without chunked prefill, a prompt longer than the budget runs alone
    alone = not scheduler.enable_chunked_prefill and len(scheduler_output.num_scheduled_tokens) == 1
    assert alone or scheduler_output.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(scheduler_output.num_scheduled_tokens) <= scheduler.max_num_seqs
    changed = scheduler.update_from_output(scheduler_output, worker.execute(scheduler_output))
    if run_log is not None:
        run_log.outputs.append(scheduler_output)
        run_log.finished.update((r.seq_id, r) for r in changed if r.finished)
    return scheduler_output


def new_ids(scheduler_output: SchedulerOutput) -> list[str]:
    return [n.req_id for n in scheduler_output.scheduled_new_reqs]


# ---- budget, chunking -------------------------------------------------------------------------


def test_default_budget_is_a_named_constant():
    assert make_scheduler().max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048


def test_budget_and_sequence_cap_hold_every_step_and_outputs_are_exact():
    scheduler = make_scheduler(num_blocks=200, max_num_batched_tokens=32, max_num_seqs=3)
    worker = FakeWorker(200, 4)
    prompts = {f"r{i}": [(i * 7 + j) % 50 + 3 for j in range(1 + (i * 13) % 45)] for i in range(10)}
    for req_id, prompt in prompts.items():
        scheduler.add_sequence(make_request(req_id, prompt, max_tokens=3 + len(prompt) % 7, ignore_eos=True))
    result = run(scheduler, worker)
    assert any(o.total_num_scheduled_tokens == 32 for o in result.outputs)  # the budget was binding
    for req_id, prompt in prompts.items():
        request = result.finished[req_id]
        assert request.status is SequenceStatus.FINISHED_LENGTH
        assert request.output_token_ids == expected_tokens(prompt, 3 + len(prompt) % 7)
    assert scheduler.block_manager.num_free_blocks == 200


def test_long_prompt_is_chunked_while_another_request_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    worker = FakeWorker(64, 4)
    scheduler.add_sequence(make_request("short", range(10, 14), max_tokens=10, ignore_eos=True))
    first = step(scheduler, worker)
    assert first.num_scheduled_tokens == {"short": 4}

    long_prompt = [(5 * i) % 97 + 3 for i in range(40)]
    scheduler.add_sequence(make_request("long", long_prompt, max_tokens=3, ignore_eos=True))
    outputs = [step(scheduler, worker) for _ in range(4)]
    assert [o.num_scheduled_tokens for o in outputs] == [
        {"short": 1, "long": 15},
        {"short": 1, "long": 15},
        {"short": 1, "long": 10},
        {"short": 1, "long": 1},
    ]
    assert new_ids(outputs[0]) == ["long"]
    assert [c.num_computed_tokens for c in outputs[1].scheduled_cached_reqs if c.req_id == "long"] == [15]
    assert [c.num_computed_tokens for c in outputs[2].scheduled_cached_reqs if c.req_id == "long"] == [30]
    long_request = scheduler.get_sequence("long")
    assert long_request.num_computed_tokens == 41 and len(long_request.output_token_ids) == 2
    result = run(scheduler, worker)
    assert result.finished["long"].output_token_ids == expected_tokens(long_prompt, 3)
    assert result.finished["short"].output_token_ids == expected_tokens(list(range(10, 14)), 10)


def test_a_prompt_waits_while_an_earlier_prompt_takes_the_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = FakeWorker(64, 4)
    scheduler.add_sequence(make_request("long", range(3, 40), ignore_eos=True))
    scheduler.add_sequence(make_request("short", range(50, 52), ignore_eos=True))
    assert [step(scheduler, worker).num_scheduled_tokens for _ in range(3)] == [{"long": 8}] * 3
    scheduler.finish_sequences("long", SequenceStatus.FINISHED_ABORTED)
    assert step(scheduler, worker).num_scheduled_tokens == {"short": 2}


def test_partial_prefill_limit_and_long_prefill_threshold():
    for max_partial, expected in ((1, {"a": 8}), (2, {"a": 8, "b": 8})):
        scheduler = make_scheduler(
            max_num_batched_tokens=32, long_prefill_token_threshold=8, max_num_partial_prefills=max_partial
        )
        scheduler.add_sequence(make_request("a", range(3, 40)))
        scheduler.add_sequence(make_request("b", range(50, 90)))
        assert step(scheduler, FakeWorker(64, 4)).num_scheduled_tokens == expected


def test_without_chunked_prefill_prompts_wait_for_room_and_huge_ones_run_alone():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    worker = FakeWorker(64, 4)
    scheduler.add_sequence(make_request("a", range(3, 7), max_tokens=3, ignore_eos=True))
    scheduler.add_sequence(make_request("b", range(10, 18), max_tokens=2, ignore_eos=True))
    scheduler.add_sequence(make_request("huge", range(20, 40), max_tokens=2, ignore_eos=True))
    outputs = [step(scheduler, worker) for _ in range(6)]
    assert [o.num_scheduled_tokens for o in outputs] == [
        {"a": 4},
        {"a": 1},  # b (8 tokens) does not fit the 7 left: it waits rather than being split
        {"a": 1},
        {"b": 8},
        {"b": 1},
        {"huge": 20},  # longer than the whole budget: scheduled whole, alone
    ]
    result = run(scheduler, worker)
    assert result.finished["huge"].output_token_ids == expected_tokens(list(range(20, 40)), 2)


# ---- preemption -------------------------------------------------------------------------------


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preempted_requests_resume_and_match_an_unconstrained_run(enable_prefix_caching, caplog):
    prompts = {f"r{i}": [(11 * i + j) % 60 + 3 for j in range(6 + i)] for i in range(4)}
    # 10 blocks of 4 tokens: each request grows to 16-19 tokens (4-5 blocks), four cannot coexist
    scheduler = make_scheduler(num_blocks=10, block_size=4, enable_prefix_caching=enable_prefix_caching)
    worker = FakeWorker(10, 4)
    for req_id, prompt in prompts.items():
        scheduler.add_sequence(make_request(req_id, prompt, max_tokens=10, ignore_eos=True))
    with caplog.at_level(logging.WARNING, logger="tokenloom.core.scheduler"):
        result = run(scheduler, worker)

    for req_id, prompt in prompts.items():
        assert result.finished[req_id].output_token_ids == expected_tokens(prompt, 10)
    assert scheduler.num_preemptions > 0
    assert scheduler.stats().num_preemptions == scheduler.num_preemptions
    assert sum(r.num_preemptions for r in result.finished.values()) == scheduler.num_preemptions
    preempted = [r for r in result.finished.values() if r.num_preemptions]
    assert any(r.seq_id in caplog.text for r in preempted)
    assert "preempted" in caplog.text

    # a preemption is announced in that step's finished_req_ids, and the request comes back
    # later as a new request carrying the tokens it had generated
    resumed_with_output = False
    for index, output in enumerate(result.outputs):
        scheduled_now = set(output.num_scheduled_tokens)
        for req_id in output.finished_req_ids & set(prompts):
            later = [n for o in result.outputs[index + 1 :] for n in o.scheduled_new_reqs if n.req_id == req_id]
            if req_id not in scheduled_now and later:
                resumed_with_output |= bool(later[0].output_token_ids)
    assert resumed_with_output
    assert scheduler.block_manager.num_free_blocks == 10
    assert not scheduler.has_unfinished_sequences()


@pytest.mark.parametrize("policy, victim", [("fcfs", "late"), ("priority", "early-unimportant")])
def test_preemption_victim_is_the_latest_or_least_important(policy, victim):
    scheduler = make_scheduler(num_blocks=6, block_size=4, scheduling_policy=policy, enable_prefix_caching=False)
    worker = FakeWorker(6, 4)
    scheduler.add_sequence(make_request("early-unimportant", range(3, 11), priority=9, max_tokens=30, ignore_eos=True))
    scheduler.add_sequence(make_request("late", range(20, 28), priority=0, max_tokens=30, ignore_eos=True))
    first_preempted = None
    for _ in range(40):
        output = step(scheduler, worker)
        if output.finished_req_ids:
            first_preempted = sorted(output.finished_req_ids)
            break
    assert first_preempted == [victim]
    assert scheduler.get_sequence(victim).status is SequenceStatus.PREEMPTED
    assert scheduler.get_sequence(victim).num_computed_tokens == 0
    assert scheduler.num_waiting == 1


def test_a_preempted_request_goes_back_to_the_front_of_the_waiting_queue():
    scheduler = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    worker = FakeWorker(6, 4)
    scheduler.add_sequence(make_request("first", range(3, 11), max_tokens=12, ignore_eos=True))
    scheduler.add_sequence(make_request("second", range(20, 28), max_tokens=10, ignore_eos=True))
    result = Run()
    step(scheduler, worker, result)  # both prompts: 2 blocks each
    # needs 3 blocks: it waits, and the two running requests then outgrow the pool together
    scheduler.add_sequence(make_request("third", range(30, 39), max_tokens=2, ignore_eos=True))
    run(scheduler, worker, run_log=result)
    preempted_at = next(i for i, o in enumerate(result.outputs) if "second" in o.finished_req_ids)
    readmitted = [req_id for o in result.outputs[preempted_at:] for req_id in new_ids(o)]
    assert readmitted == ["second", "third"]
    assert result.finished["second"].num_preemptions == 1
    assert result.finished["second"].output_token_ids == expected_tokens(list(range(20, 28)), 10)


def test_a_request_that_outgrows_the_whole_cache_finishes_with_length():
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    worker = FakeWorker(2, 4)
    scheduler.add_sequence(make_request("greedy", [3, 4, 5], max_tokens=None, ignore_eos=True))
    result = run(scheduler, worker, max_steps=20)
    request = result.finished["greedy"]
    assert request.status is SequenceStatus.FINISHED_LENGTH
    assert request.num_tokens == 9  # 8 tokens fill both blocks; the 9th has nowhere to go
    assert request.num_preemptions == 0
    assert scheduler.block_manager.num_free_blocks == 2


# ---- order and fairness -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, expected_order",
    [
        ("priority", ["urgent", "urgent-later", "normal", "background"]),
        ("fcfs", ["background", "urgent", "normal", "urgent-later"]),
    ],
)
def test_waiting_order_by_policy(policy, expected_order):
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    worker = FakeWorker(64, 4)
    for req_id, priority, arrival in (
        ("background", 5, 1.0),
        ("urgent", 0, 2.0),
        ("normal", 1, 3.0),
        ("urgent-later", 0, 4.0),
    ):
        scheduler.add_sequence(make_request(req_id, range(3, 9), priority=priority, arrival_time=arrival, max_tokens=2))
    result = run(scheduler, worker)
    assert [req_id for o in result.outputs for req_id in new_ids(o)] == expected_order


def test_fcfs_head_of_line_blocks_later_requests_so_none_starves():
    scheduler = make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False)
    worker = FakeWorker(8, 4)
    scheduler.add_sequence(make_request("running", range(3, 15), max_tokens=6, ignore_eos=True))
    step(scheduler, worker)
    scheduler.add_sequence(make_request("big", range(20, 40), max_tokens=2, ignore_eos=True))  # 5 blocks
    scheduler.add_sequence(make_request("small", [50, 51], max_tokens=2, ignore_eos=True))  # 1 block
    result = run(scheduler, worker)
    first_step = {req_id: index for index, o in enumerate(result.outputs) for req_id in reversed(new_ids(o))}
    assert first_step["big"] <= first_step["small"]
    # small fit the pool all along, yet never jumped the queue
    assert first_step["big"] > 0


# ---- admission --------------------------------------------------------------------------------


def test_admission_rejects_prompts_too_long_for_the_model():
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(ContextLengthError, match="16 tokens.*maximum context length is 16 tokens"):
        scheduler.add_sequence(make_request("too-long", range(16)))
    scheduler.add_sequence(make_request("fits", range(15)))
    assert scheduler.num_waiting == 1


def test_admission_rejects_prompts_too_big_for_the_block_pool():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(InvalidRequestError, match="needs 3 KV-cache blocks.*only 2 blocks") as raised:
        scheduler.add_sequence(make_request("too-big", range(8)))
    assert not isinstance(raised.value, ContextLengthError)
    assert not scheduler.has_unfinished_sequences()
    scheduler.add_sequence(make_request("fits", range(7)))
    assert scheduler.num_waiting == 1


def test_admission_rejects_empty_prompts_duplicate_ids_and_a_full_queue():
    scheduler = make_scheduler(max_waiting_requests=2)
    with pytest.raises(InvalidRequestError, match="empty"):
        scheduler.add_sequence(make_request("empty", []))
    scheduler.add_sequence(make_request("a", [3]))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_sequence(make_request("a", [4]))
    scheduler.add_sequence(make_request("b", [3]))
    with pytest.raises(OverloadedError):
        scheduler.add_sequence(make_request("c", [3]))


def test_a_group_is_queued_whole_or_not_at_all():
    # the n sequences of one request: a refusal of any of them (id taken, too long, queue full)
    # leaves none of them queued
    scheduler = make_scheduler(num_blocks=8, max_model_len=64, max_waiting_requests=3)
    scheduler.add_sequence(make_request("q#1", [3, 4]))
    with pytest.raises(InvalidRequestError, match="'q#1' is already in use"):
        scheduler.add_sequences([make_request("q#0", [3, 4]), make_request("q#1", [3, 4])])
    with pytest.raises(InvalidRequestError, match="appears twice"):
        scheduler.add_sequences([make_request("d", [3]), make_request("d", [3])])
    with pytest.raises(InvalidRequestError, match="KV-cache blocks"):
        scheduler.add_sequences([make_request("fits", [3]), make_request("huge", [3] * 40)])
    assert [scheduler.get_sequence(i) for i in ("q#0", "d", "fits", "huge")] == [None] * 4
    assert scheduler.num_waiting == 1
    # below the limit a group is admitted whole, even past the limit; at the limit, not at all
    scheduler.add_sequences([make_request(f"r#{i}", [5]) for i in range(3)])
    assert scheduler.num_waiting == 4
    with pytest.raises(OverloadedError):
        scheduler.add_sequences([make_request("s#0", [5]), make_request("s#1", [5])])
    assert scheduler.get_sequence("s#0") is None and scheduler.num_waiting == 4
    worker = FakeWorker(num_blocks=8, block_size=4)
    finished = run(scheduler, worker).finished
    assert sorted(finished) == ["q#1", "r#0", "r#1", "r#2"]
    assert scheduler.block_manager.num_free_blocks == 8


def test_bad_scheduler_configuration_is_a_config_error():
    with pytest.raises(ConfigError, match="scheduling-policy"):
        make_scheduler(scheduling_policy="lifo")
    with pytest.raises(ConfigError, match="max_model_len"):
        make_scheduler(max_model_len=1)


# ---- finishing --------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once_and_reports_the_id_once():
    scheduler = make_scheduler(num_blocks=16)
    worker = FakeWorker(16, 4)
    scheduler.add_sequence(make_request("running", range(3, 12)))
    step(scheduler, worker)
    scheduler.add_sequence(make_request("waiting", range(3, 5)))
    assert scheduler.block_manager.num_free_blocks == 13

    finished = scheduler.finish_sequences(["running", "waiting", "unknown"], SequenceStatus.FINISHED_ABORTED)
    assert sorted(r.seq_id for r in finished) == ["running", "waiting"]
    assert all(r.status is SequenceStatus.FINISHED_ABORTED for r in finished)
    assert scheduler.block_manager.num_free_blocks == 16
    assert not scheduler.has_unfinished_sequences()
    assert scheduler.get_sequence("running") is None
    assert scheduler.schedule().finished_req_ids == {"running", "waiting"}
    assert scheduler.schedule().finished_req_ids == set()
    assert scheduler.finish_sequences("running", SequenceStatus.FINISHED_ABORTED) == []


def test_abort_between_schedule_and_update_is_ignored_by_the_update():
    scheduler = make_scheduler()
    worker = FakeWorker(64, 4)
    scheduler.add_sequence(make_request("a", range(3, 8)))
    scheduler.add_sequence(make_request("b", range(3, 8)))
    output = scheduler.schedule()
    runner_output = worker.execute(output)
    scheduler.finish_sequences("a", SequenceStatus.FINISHED_ABORTED)
    changed = scheduler.update_from_output(output, runner_output)
    assert [r.seq_id for r in changed] == ["b"]
    assert scheduler.num_running == 1


def test_finished_requests_are_listed_in_the_next_schedule():
    scheduler = make_scheduler()
    worker = FakeWorker(64, 4)
    scheduler.add_sequence(make_request("one-token", [3, 4], max_tokens=1))
    scheduler.add_sequence(make_request("two-tokens", [5, 6], max_tokens=2, ignore_eos=True))
    output = scheduler.schedule()
    changed = scheduler.update_from_output(output, worker.execute(output))
    assert {r.seq_id: r.finished for r in changed} == {"one-token": True, "two-tokens": False}
    second = step(scheduler, worker)
    assert second.finished_req_ids == {"one-token"}
    assert step(scheduler, worker).finished_req_ids == {"two-tokens"}


def test_worker_errors_finish_only_the_failing_request():
    scheduler = make_scheduler(num_blocks=16)
    worker = FakeWorker(16, 4, errors={"bad": "sampler exploded"})
    scheduler.add_sequence(make_request("bad", range(3, 9)))
    scheduler.add_sequence(make_request("good", range(3, 9), max_tokens=2, ignore_eos=True))
    output = scheduler.schedule()
    changed = scheduler.update_from_output(output, worker.execute(output))
    statuses = {r.seq_id: r.status for r in changed}
    assert statuses == {"good": SequenceStatus.RUNNING, "bad": SequenceStatus.FINISHED_ERROR}
    result = run(scheduler, worker)
    assert result.finished["good"].status is SequenceStatus.FINISHED_LENGTH
    assert scheduler.block_manager.num_free_blocks == 16


def scripted_run(tokens: list[int], max_model_len: int = 256, prompt=(3, 4, 5), **sampling_args) -> EngineSequence:
    scheduler = make_scheduler(max_model_len=max_model_len)
    worker = FakeWorker(64, 4, scripts={"r": list(tokens)})
    scheduler.add_sequence(make_request("r", prompt, **sampling_args))
    request = run(scheduler, worker).finished["r"]
    assert scheduler.block_manager.num_free_blocks == 64
    return request


def test_eos_stops_only_after_min_tokens():
    request = scripted_run([EOS, 50, 51, EOS, 52], min_tokens=3)
    assert request.output_token_ids == [EOS, 50, 51, EOS]
    assert request.status is SequenceStatus.FINISHED_STOPPED
    assert request.stop_reason is None


def test_eos_stops_at_once_without_min_tokens():
    request = scripted_run([50, EOS, 51])
    assert request.output_token_ids == [50, EOS]
    assert request.status is SequenceStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens():
    request = scripted_run([EOS, 50, EOS, 51, 52, 53], ignore_eos=True, max_tokens=5)
    assert request.output_token_ids == [EOS, 50, EOS, 51, 52]
    assert request.status is SequenceStatus.FINISHED_LENGTH


def test_stop_token_ids_set_the_stop_reason_and_respect_min_tokens():
    request = scripted_run([60, 61, 60, 62], stop_token_ids=[60], min_tokens=2)
    assert request.output_token_ids == [60, 61, 60]
    assert request.status is SequenceStatus.FINISHED_STOPPED
    assert request.stop_reason == 60


def test_a_stop_token_at_the_last_allowed_position_counts_as_stop():
    request = scripted_run([70, 71, 72], stop_token_ids=[71], max_tokens=2)
    assert request.status is SequenceStatus.FINISHED_STOPPED
    assert request.stop_reason == 71


def test_max_tokens_stops_with_length():
    request = scripted_run([80] * 10, max_tokens=4)
    assert request.output_token_ids == [80] * 4
    assert request.status is SequenceStatus.FINISHED_LENGTH
    assert request.stop_reason is None


def test_max_model_len_stops_with_length():
    request = scripted_run([90] * 20, max_model_len=10, prompt=range(3, 9), max_tokens=None)
    assert request.num_tokens == 10
    assert request.output_token_ids == [90] * 4
    assert request.status is SequenceStatus.FINISHED_LENGTH


def test_logprobs_and_prompt_logprobs_are_kept_as_token_logprobs():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    worker = FakeWorker(64, 4, logprobs=True)
    request = make_request("r", range(3, 9), max_tokens=2, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    scheduler.add_sequence(request)
    prompt_entries = {0: [TokenLogprobs([3], [-1.0], 1)] * 4, 1: [TokenLogprobs([7], [-2.0], 1)] * 2}
    for index in range(3):
        output = scheduler.schedule()
        runner_output = worker.execute(output)
        if index in prompt_entries:
            runner_output.prompt_logprobs["r"] = prompt_entries[index]
        scheduler.update_from_output(output, runner_output)
    assert request.prompt_logprobs == prompt_entries[0] + prompt_entries[1]
    assert len(request.logprobs) == 2
    assert all(isinstance(entry, TokenLogprobs) for entry in request.logprobs)
    assert request.logprobs[0].token_ids == [request.output_token_ids[0]]


# ---- prefix caching through the scheduler ------------------------------------------------------


def test_prefix_hit_sets_computed_tokens_before_the_first_chunk():
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    worker = FakeWorker(32, 4)
    prompt = [(3 * i) % 41 + 3 for i in range(18)]
    scheduler.add_sequence(make_request("first", prompt, max_tokens=2, ignore_eos=True))
    run(scheduler, worker)
    scheduler.add_sequence(make_request("second", prompt + [7, 8], max_tokens=3, ignore_eos=True))
    output = scheduler.schedule()
    assert [n.num_computed_tokens for n in output.scheduled_new_reqs] == [16]
    assert output.num_scheduled_tokens == {"second": 4}
    scheduler.update_from_output(output, worker.execute(output))
    result = run(scheduler, worker)
    second = result.finished["second"]
    assert second.num_cached_tokens == 16
    assert second.output_token_ids == expected_tokens(prompt + [7, 8], 3)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18 + 20, 16)


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    worker = FakeWorker(32, 4)
    scheduler.add_sequence(make_request("first", range(3, 15), max_tokens=1))
    run(scheduler, worker)
    scheduler.add_sequence(make_request("second", range(3, 15), max_tokens=1, prompt_logprobs=1))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"second": 12}
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0


def test_introspection():
    scheduler = make_scheduler(num_blocks=10, max_num_seqs=1)
    worker = FakeWorker(10, 4)
    scheduler.add_sequence(make_request("a", range(3, 10)))
    scheduler.add_sequence(make_request("b", range(3, 10)))
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 2)
    step(scheduler, worker)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(0.2)
    assert scheduler.get_sequence("a").first_scheduled_time is not None
    assert scheduler.get_sequence("a").first_token_time is not None
    assert scheduler.get_sequence("b").first_scheduled_time is None
    assert scheduler.get_sequence("missing") is None
    assert scheduler.has_unfinished_sequences()


# ---- batches in flight (pipeline parallelism's batch queue) ------------------------------------


def run_pipelined(scheduler: Scheduler, worker: FakeWorker, depth: int, max_steps: int = 3000) -> tuple[Run, int]:
    """Keep up to ``depth`` batches in flight, as the engine's batch queue does: the worker runs
    each batch when it is scheduled (stages run in order), its result is applied later, oldest
    first. Returns the run and the most batches that were in flight at once."""
    from collections import deque

    run_log, queue, most_in_flight = Run(), deque(), 0
    for _ in range(max_steps):
        if not scheduler.has_unfinished_sequences() and not queue:
            return run_log, most_in_flight
        if len(queue) < depth:
            scheduler_output = scheduler.schedule()
            if not scheduler_output.is_empty or scheduler_output.finished_req_ids:
                in_flight = {req_id for batch, _ in queue for req_id in batch.num_scheduled_tokens}
                assert not in_flight & set(scheduler_output.num_scheduled_tokens), "a request in two batches"
                assert scheduler.num_sequences_in_flight == len(in_flight | set(scheduler_output.num_scheduled_tokens))
                queue.append((scheduler_output, worker.execute(scheduler_output)))
                most_in_flight = max(most_in_flight, len(queue))
                run_log.outputs.append(scheduler_output)
                if len(queue) < depth:
                    continue
            else:
                changed = scheduler.update_from_output(scheduler_output, ModelRunnerOutput())
                run_log.finished.update((r.seq_id, r) for r in changed if r.finished)
        if queue:
            batch, result = queue.popleft()
            changed = scheduler.update_from_output(batch, result)
            run_log.finished.update((r.seq_id, r) for r in changed if r.finished)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("num_blocks", [200, 24], ids=["roomy", "preempting"])
def test_batches_in_flight_never_share_a_request_and_outputs_stay_exact(depth, num_blocks):
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=8, max_num_partial_prefills=4)
    worker = FakeWorker(num_blocks, 4)
    prompts = {f"r{i}": [(i * 7 + j) % 50 + 3 for j in range(1 + (i * 13) % 30)] for i in range(8)}
    for req_id, prompt in prompts.items():
        scheduler.add_sequence(make_request(req_id, prompt, max_tokens=4 + len(prompt) % 5, ignore_eos=True))
    result, most_in_flight = run_pipelined(scheduler, worker, depth)
    assert most_in_flight == depth
    for req_id, prompt in prompts.items():
        assert result.finished[req_id].output_token_ids == expected_tokens(prompt, 4 + len(prompt) % 5)
    assert (scheduler.num_preemptions > 0) == (num_blocks == 24)
    assert scheduler.block_manager.num_free_blocks == num_blocks and scheduler.num_sequences_in_flight == 0


def test_a_request_in_flight_is_neither_scheduled_again_nor_preempted():
    # two blocks of 4 tokens, two 4-token prompts: after their prefill the cache is full
    scheduler = make_scheduler(num_blocks=2, max_num_batched_tokens=4, scheduling_policy="priority")
    worker = FakeWorker(2, 4)
    scheduler.add_sequence(make_request("low", [3, 4, 5, 6], priority=1, max_tokens=4, ignore_eos=True))
    scheduler.add_sequence(make_request("vip", [7, 8, 9, 10], priority=0, max_tokens=4, ignore_eos=True))
    vip_prefill = scheduler.schedule()
    assert vip_prefill.num_scheduled_tokens == {"vip": 4}
    low_prefill = scheduler.schedule()  # "vip" is in flight: the next batch is "low"'s
    assert low_prefill.num_scheduled_tokens == {"low": 4}
    assert scheduler.schedule().is_empty  # both in flight
    vip_result, low_result = worker.execute(vip_prefill), worker.execute(low_prefill)
    scheduler.update_from_output(vip_prefill, vip_result)
    # "vip" needs a third block; the natural victim, "low", has its batch in flight: "vip" waits
    waiting = scheduler.schedule()
    assert waiting.is_empty and scheduler.num_preemptions == 0
    assert scheduler.get_sequence("low").status is SequenceStatus.RUNNING
    scheduler.update_from_output(waiting, ModelRunnerOutput())
    scheduler.update_from_output(low_prefill, low_result)
    # with "low"'s result applied it can give its block up
    decode = scheduler.schedule()
    assert decode.num_scheduled_tokens == {"vip": 1} and decode.preempted_req_ids == {"low"}
    scheduler.update_from_output(decode, worker.execute(decode))


def test_an_aborted_request_s_result_in_flight_is_dropped():
    scheduler = make_scheduler()
    worker = FakeWorker(64, 4)
    scheduler.add_sequence(make_request("gone", [5, 6, 7], max_tokens=4, ignore_eos=True))
    scheduler.add_sequence(make_request("kept", [8, 9], max_tokens=4, ignore_eos=True))
    first = scheduler.schedule()
    first_result = worker.execute(first)
    scheduler.finish_sequences("gone", SequenceStatus.FINISHED_ABORTED)
    assert scheduler.schedule().finished_req_ids == {"gone"}  # "kept" is still in flight
    changed = scheduler.update_from_output(first, first_result)
    assert [r.seq_id for r in changed] == ["kept"] and scheduler.num_sequences_in_flight == 0
    assert scheduler.block_manager.num_free_blocks == 64 - 1


def test_step_token_ids_are_sent_only_for_stages_that_do_not_sample():
    for send_token_ids in (False, True):
        scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=3),
            CacheConfig(block_size=4),
            num_blocks=16,
            max_model_len=64,
            send_token_ids=send_token_ids,
        )
        worker = FakeWorker(16, 4)
        scheduler.add_sequence(make_request("r", [5, 6, 7, 8, 9], max_tokens=3, ignore_eos=True))
        windows = []
        while scheduler.has_unfinished_sequences():
            scheduler_output = scheduler.schedule()
            windows += [cached.new_token_ids for cached in scheduler_output.scheduled_cached_reqs]
            scheduler.update_from_output(scheduler_output, worker.execute(scheduler_output))
        sampled = expected_tokens([5, 6, 7, 8, 9], 3)
        # the prompt's second chunk, then each decode step's one pending (sampled) token
        expected = [[8, 9], [sampled[0]], [sampled[1]]] if send_token_ids else [[], [], []]
        assert windows == expected


# ---- speculative decoding: lookahead slots for a proposer's own KV ---------------------------


def lookahead_scheduler(num_blocks: int, num_lookahead_tokens: int = 3, **speculative) -> Scheduler:
    from tokenloom.core.config import SpeculativeConfig

    return Scheduler(
        SchedulerConfig(),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_blocks=num_blocks,
        max_model_len=256,
        speculative=SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=3, **speculative),
        num_lookahead_tokens=num_lookahead_tokens,
    )


def test_lookahead_slots_are_allocated_past_the_scheduled_tokens():
    scheduler = lookahead_scheduler(num_blocks=16)
    scheduler.add_sequence(make_request("a", range(10, 18)))  # 8 tokens: two whole blocks
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 8}
    # positions 8..10 (the drafts' KV written after the step) get a third block
    assert len(scheduler.block_manager.get_block_table("a")) == 3


def test_lookahead_slots_are_dropped_rather_than_preempting():
    scheduler = lookahead_scheduler(num_blocks=2)
    scheduler.add_sequence(make_request("a", range(10, 17)))  # 7 tokens and the first output fit 2 blocks
    assert scheduler.schedule().num_scheduled_tokens == {"a": 7}
    assert len(scheduler.block_manager.get_block_table("a")) == 2  # 7 + 3 slots would need 3


def test_no_lookahead_slots_while_speculation_is_off():
    scheduler = lookahead_scheduler(num_blocks=16, disable_by_batch_size=1)
    scheduler.add_sequences([make_request("a", range(10, 18)), make_request("b", range(20, 28))])
    scheduler.schedule()  # two requests queued: above disable_by_batch_size
    assert len(scheduler.block_manager.get_block_table("a")) == 2
