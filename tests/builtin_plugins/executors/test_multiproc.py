"""The ``mp`` executor on a tiny random Llama: two real worker processes give the greedy ids of
``uni`` (each rank still computes the whole model until tensor-parallel layers shard it), steps
sent without waiting come back in order and equal to one-at-a-time steps, a killed worker kills
the engine (check_health, the failed step, the server's streams), so does a stopped one once the
step timeout passes (naming it, and killing the workers), and nothing outlives shutdown."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing
import os
import signal
import time

import psutil
import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.executors.multiproc import WorkerProcessGroup, _Call
from tokenloom.core.batch import NewRequestData, SchedulerOutput
from tokenloom.core.engine import AsyncLLM
from tokenloom.errors import EngineDeadError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def greedy_ids(llm: LLM) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
        assert time.monotonic() < deadline, f"worker processes outlived shutdown: {pids}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def uni_llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32")


@pytest.fixture(scope="module")
def mp_llm(tiny_llama_dir):
    # no --distributed-executor-backend: mp is the default for tp * pp > 1
    llm = LLM(model=tiny_llama_dir, dtype="float32", tensor_parallel_size=2)
    yield llm
    pids = llm.engine.executor.worker_pids
    llm.engine.shutdown()
    llm.engine.shutdown()  # idempotent
    assert_gone(pids)
    assert not [child for child in multiprocessing.active_children() if child.pid in pids]


def test_two_worker_processes_give_the_greedy_ids_of_uni(mp_llm, uni_llm):
    executor = mp_llm.engine.executor
    assert type(executor).__name__ == "MultiprocExecutor" and executor.max_concurrent_batches == 1
    pids = executor.worker_pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(psutil.Process(pid).is_running() for pid in pids)
    assert mp_llm.engine.num_blocks == uni_llm.engine.num_blocks  # the minimum over identical workers
    assert greedy_ids(mp_llm) == greedy_ids(uni_llm)
    # both workers map never-used KV blocks (the same share each; one worker's bytes reported)
    assert 0 < executor.prefault_kv_cache(1 << 20) <= 1 << 20


def prefill_steps(llm: LLM) -> list[SchedulerOutput]:
    """One new request per step (its own KV block), each forgetting the one before: steps that
    do not depend on each other's results, as the engine may have several of in flight."""
    steps = []
    for index, prompt in enumerate(PROMPTS):
        token_ids = llm.engine.tokenizer.encode(prompt)
        req_id = f"r{index}"
        steps.append(
            SchedulerOutput(
                scheduled_new_reqs=[
                    NewRequestData(req_id, token_ids, [], SamplingParams(temperature=0.0), [index + 1, 9 + index], 0)
                ],
                num_scheduled_tokens={req_id: len(token_ids)},
                finished_req_ids={f"r{index - 1}"} if index else set(),
            )
        )
    return steps


def test_steps_in_flight_come_back_in_order_and_equal_to_one_at_a_time(mp_llm, uni_llm):
    steps = prefill_steps(mp_llm)
    futures = [mp_llm.engine.executor.execute_async(step) for step in steps]  # none awaited yet
    results = []
    for index, future in enumerate(futures):
        results.append(future.result(timeout=60))
        assert all(earlier.done() for earlier in futures[:index])  # FIFO
    expected = [uni_llm.engine.executor.execute(step) for step in prefill_steps(uni_llm)]
    # the default execute_async of the base class: a done future of execute's result
    cleanup = SchedulerOutput(finished_req_ids={f"r{len(PROMPTS) - 1}"})
    assert uni_llm.engine.executor.execute_async(cleanup).done()
    mp_llm.engine.executor.execute(cleanup)
    assert [r.sampled_token_ids for r in results] == [e.sampled_token_ids for e in expected]
    assert all(len(r.sampled_token_ids[f"r{i}"]) == 1 for i, r in enumerate(results))


def test_a_killed_worker_kills_the_engine_and_shutdown_leaves_no_process(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp")
    engine = llm.engine
    pids = engine.executor.worker_pids
    async_llm = AsyncLLM(engine)

    async def run() -> tuple[BaseException | None, BaseException | None]:
        await async_llm.start()
        stream_error = None
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        try:
            async for output in async_llm.generate("Once upon a time", params, "long"):
                if len(output.outputs[0].token_ids) == 2:
                    os.kill(pids[1], signal.SIGKILL)
        except EngineDeadError as exc:
            stream_error = exc
        await asyncio.sleep(0.2)
        refused = None
        try:
            async for _ in async_llm.generate("hello", GREEDY, "after"):
                pass
        except EngineDeadError as exc:
            refused = exc
        await async_llm.shutdown()
        return stream_error, refused

    try:
        stream_error, refused = asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        engine.shutdown()
    # the open stream ended with the cause; the engine is dead and says so to new requests
    assert stream_error is not None and "worker 1" in str(stream_error) and "SIGKILL" in str(stream_error)
    assert refused is not None and "dead" in str(refused)
    assert async_llm.errored and not async_llm.is_running
    assert_gone(pids)
    assert not [child for child in multiprocessing.active_children() if child.pid in pids]


def test_a_stopped_worker_fails_the_step_after_the_step_timeout_naming_it_and_is_killed(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3")
    llm = LLM(model=tiny_llama_dir, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp")
    engine = llm.engine
    pids = engine.executor.worker_pids
    try:
        assert engine.executor.execute_timeout == 3.0
        engine.add_request("warm", "hello", GREEDY)
        while engine.has_unfinished_requests():
            engine.step()  # healthy steps are far inside the timeout
        os.kill(pids[1], signal.SIGSTOP)
        engine.add_request("r", "hello", GREEDY)
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as failure:
            while engine.has_unfinished_requests():
                engine.step()
        waited = time.monotonic() - started
        # the stopped worker first; its peer, waiting for it in the all-reduce, is named too
        assert f"worker 1 (pid {pids[1]}, stopped by a signal)" in str(failure.value)
        assert "did not answer execute within 3s (TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS" in str(failure.value)
        assert 3 <= waited < 3 + 10
        with pytest.raises(EngineDeadError, match="worker 1"):
            engine.check_health()
        assert_gone(pids)  # both killed at once, the stopped one too: nothing waits for them
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        engine.shutdown()
    assert_gone(pids)


def test_a_call_is_timed_from_when_the_worker_answered_the_one_before():
    """With steps in flight (-pp), a step queued behind a running one is not charged for the
    wait: each worker's clock starts when it answered its previous call."""
    group = WorkerProcessGroup.__new__(WorkerProcessGroup)  # the bookkeeping only, no processes
    base = time.monotonic() - 1000.0  # times long past
    group.num_workers = 2
    group._pending = [collections.deque(), collections.deque()]
    group._answered_at = [base, base]
    start_up = _Call("load_model", 2, list)  # start-up calls have their own limit
    first = _Call("execute", 2, list, timeout=5.0)
    second = _Call("execute", 2, list, timeout=5.0)
    start_up.sent_at, first.sent_at, second.sent_at = base - 10, base, base + 1
    for pending in group._pending:
        pending.append(start_up)
    assert group._overdue_since(0) is None and group._overdue_ranks() == []
    for pending in group._pending:
        pending.popleft()
        pending.extend([first, second])
    assert group._overdue_since(0) == group._overdue_since(1) == base + 5
    group._pending[0].popleft()
    group._answered_at[0] = base + 4
    assert group._overdue_since(0) == base + 9  # from its answer, not from when it was sent
    assert group._overdue_since(1) == base + 5
    assert group._overdue_ranks() == [0, 1]


def test_a_script_that_exits_without_shutdown_leaves_no_worker(tiny_llama_dir, tmp_path):
    """The executor's finalizer runs at interpreter exit: no orphan processes."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "exits.py"
    script.write_text(
        textwrap.dedent(f"""
        from tokenloom import LLM

        if __name__ == "__main__":
            llm = LLM(model={tiny_llama_dir!r}, dtype="float32", tensor_parallel_size=2)
            print(*llm.engine.executor.worker_pids)
        """)
    )
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    pids = [int(pid) for pid in result.stdout.split()]
    assert len(pids) == 2
    assert_gone(pids)


def test_a_model_that_fails_to_load_in_the_workers_raises_its_error_and_leaves_nothing(tiny_llama_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.norm.weight"]  # every worker finds the final norm missing
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    before = set(multiprocessing.active_children())
    with pytest.raises(Exception, match="model.norm") as failure:
        LLM(model=str(broken), dtype="float32", tensor_parallel_size=2)
    assert not isinstance(failure.value, EngineDeadError)  # the worker's own error, not a death
    assert set(multiprocessing.active_children()) <= before


def test_a_worker_dying_while_idle_fails_check_health_and_the_next_step(mp_llm):
    """The module's last test: it kills a worker of the shared engine (its teardown then checks
    that shutdown leaves no process)."""
    engine = mp_llm.engine
    pids = engine.executor.worker_pids
    engine.check_health()  # all alive
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        try:
            engine.check_health()
        except EngineDeadError as exc:
            assert f"worker 0 (pid {pids[0]}) was killed by SIGKILL" in str(exc)
            break
        assert time.monotonic() < deadline, "check_health did not notice the dead worker"
        time.sleep(0.05)
    engine.add_request("r", "hello", GREEDY)
    with pytest.raises(EngineDeadError, match="worker 0"):
        engine.step()
