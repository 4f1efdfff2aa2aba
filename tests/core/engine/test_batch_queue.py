"""The engine's batch queue (vLLM V1's, for pipeline parallelism): with an executor that keeps
``max_concurrent_batches`` batches in flight the engine schedules the next batch from the
requests with none in flight while the queue has room, and applies results oldest first.

The executor here wraps the real one-process worker (a tiny random Llama): each batch's
future resolves only when the engine asks for its result, so batches really are in flight
together, and the wrapper checks that no request is ever in two of them."""

from __future__ import annotations

import concurrent.futures

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.core.batch import ModelRunnerOutput, SchedulerOutput

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4,",
    "Roses are red,",
]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


class LazyFuture(concurrent.futures.Future):
    """Resolved by running its step when the engine first asks for the result."""

    def __init__(self, run):
        super().__init__()
        self._run = run

    def result(self, timeout=None):
        if not self.done():
            self._run(self)
        return super().result(timeout)


class QueueingExecutor:
    """Holds up to ``max_concurrent_batches`` batches in flight around a real executor; the
    worker runs them strictly in submission order (as pipeline stages do)."""

    def __init__(self, inner, max_concurrent_batches: int):
        self.inner = inner
        self.max_concurrent_batches = max_concurrent_batches
        self.pending: list[tuple[SchedulerOutput, LazyFuture]] = []
        self.submitted: list[SchedulerOutput] = []
        self.resolved: list[SchedulerOutput] = []
        self.max_in_flight = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise AssertionError("with a batch queue the engine calls execute_async")

    def execute_async(self, scheduler_output: SchedulerOutput) -> concurrent.futures.Future:
        in_flight = {req_id for batch, _ in self.pending for req_id in batch.num_scheduled_tokens}
        assert not in_flight & set(scheduler_output.num_scheduled_tokens), "a request is in two batches"
        future = LazyFuture(self._run_through)
        self.pending.append((scheduler_output, future))
        self.submitted.append(scheduler_output)
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        assert len(self.pending) <= self.max_concurrent_batches
        return future

    def _run_through(self, future: LazyFuture) -> None:
        # every batch up to this one runs, in order: a later batch never overtakes an earlier
        while self.pending:
            batch, pending_future = self.pending.pop(0)
            pending_future.set_result(self.inner.execute(batch))
            self.resolved.append(batch)
            if pending_future is future:
                return

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=4)
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


def queued_llm(model_dir, max_concurrent_batches: int = 2, **engine_args) -> tuple[LLM, QueueingExecutor]:
    llm = LLM(model=model_dir, dtype="float32", block_size=4, **engine_args)
    executor = QueueingExecutor(llm.engine.executor, max_concurrent_batches)
    llm.engine.executor = executor
    return llm, executor


def test_two_batches_in_flight_give_the_same_greedy_tokens(tiny_llama_dir, reference):
    # a small token budget splits the requests over several batches per round
    llm, executor = queued_llm(tiny_llama_dir, max_num_batched_tokens=16)
    tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]
    assert tokens == reference
    assert executor.max_in_flight == 2
    # generate() returns once every request finished; the batch telling the worker to forget
    # the last ones may still be in flight, and the engine counts it as unfinished work
    while llm.engine.has_unfinished_requests():
        assert llm.engine.step() == []
    # results were applied in the order the batches were submitted
    assert [id(batch) for batch in executor.resolved] == [id(batch) for batch in executor.submitted]
    assert not llm.engine._batch_queue and not executor.inner.worker.runner.requests


def test_batches_in_flight_under_preemption(tiny_llama_dir, reference):
    llm, executor = queued_llm(tiny_llama_dir, max_num_batched_tokens=16, num_gpu_blocks_override=14)
    tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]
    assert tokens == reference
    assert llm.engine.stats().num_preemptions > 0 and executor.max_in_flight == 2
    assert llm.engine.scheduler.block_manager.num_free_blocks == 14


def test_three_batches_in_flight(tiny_llama_dir, reference):
    # two tokens per batch: five requests fill three batches (several may prefill at once: a
    # request mid-prefill with its batch in flight still counts as a partial prefill)
    llm, executor = queued_llm(
        tiny_llama_dir, max_concurrent_batches=3, max_num_batched_tokens=2, max_num_partial_prefills=5
    )
    tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]
    assert tokens == reference
    assert executor.max_in_flight == 3


def test_abort_with_its_batch_in_flight(tiny_llama_dir, reference):
    llm, executor = queued_llm(tiny_llama_dir, max_num_batched_tokens=16)
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"req-{index}", prompt, GREEDY)
    outputs = engine.step()  # the first batch is in flight: nothing is applied yet
    assert outputs == [] and len(engine._batch_queue) == 1
    in_flight = set(executor.pending[0][0].num_scheduled_tokens)
    assert "req-0" in in_flight
    engine.abort_request("req-0")
    finished: dict[str, list[int]] = {}
    seen_ids: set[str] = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen_ids.add(output.request_id)
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert "req-0" not in seen_ids  # its in-flight result was dropped
    assert finished == {"req-1": reference[1], "req-2": reference[2]}
    # the worker was told to forget it, and every block came back
    assert "req-0" not in engine.executor.inner.worker.runner.requests
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_blocks


def test_an_aborted_id_reused_while_its_batch_is_in_flight_gets_only_its_own_tokens(tiny_llama_dir, reference):
    llm, executor = queued_llm(tiny_llama_dir, max_num_batched_tokens=64)
    engine = llm.engine
    engine.add_request("same", PROMPTS[0], GREEDY)
    engine.step()
    assert len(engine._batch_queue) == 1
    engine.abort_request("same")
    engine.add_request("same", PROMPTS[3], GREEDY)
    tokens = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = output.outputs[0].token_ids
    assert tokens == reference[3]


def test_one_batch_at_a_time_keeps_todays_loop(tiny_llama_dir, reference):
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=4, max_num_batched_tokens=16)
    calls = []
    inner_execute = llm.engine.executor.execute

    def execute(scheduler_output):
        calls.append(scheduler_output)
        return inner_execute(scheduler_output)

    llm.engine.executor.execute = execute
    llm.engine.executor.execute_async = None  # never used at max_concurrent_batches == 1
    assert llm.engine.executor.max_concurrent_batches == 1
    tokens = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]
    assert tokens == reference and calls and not llm.engine._batch_queue
