"""Data parallelism: which replica the balancer picks, the replicas' stats as one engine's,
errors across the process boundary, abort routing and a dead replica's streams (with scripted
replicas), and two real replica processes: greedy outputs as one engine's, one killed mid-stream,
one stopped mid-stream (dead once silent for the step timeout, and killed), nothing left running
after shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from unittest import mock

import pytest

from tokenloom.core.config import EngineArgs
from tokenloom.core.engine import build_engine_client
from tokenloom.core.engine.commands import AbortRequest
from tokenloom.core.engine.data_parallel import DataParallelAsyncLLM, ReplicaLoad, choose_replica
from tokenloom.core.engine.engine_stats import EngineStats, sum_stats
from tokenloom.core.engine.replica_handles import RayReplica, ReplicaHandle, local_cpu_sets
from tokenloom.core.engine.replica_messages import (
    AddLora,
    Call,
    Generate,
    Output,
    PackedError,
    RemoveLora,
    Reply,
    ResolveLora,
    Stats,
)
from tokenloom.core.outputs import CompletionOutput, RequestOutput
from tokenloom.core.sampling_params import RequestOutputKind, SamplingParams
from tokenloom.errors import ConfigError, EngineDeadError, InvalidRequestError, UnknownNameError
from tokenloom.plugins.manager import PluginSet


def load(in_flight: int, kv: float = 0.0, alive: bool = True) -> ReplicaLoad:
    return ReplicaLoad(num_in_flight=in_flight, kv_cache_usage=kv, alive=alive)


# -- balancing ---------------------------------------------------------------------------------


def test_the_replica_with_fewest_requests_in_flight_gets_the_next_one():
    assert choose_replica([load(3), load(1), load(2)]) == 1
    assert choose_replica([load(0, kv=0.9), load(1, kv=0.0)]) == 0  # queue length before cache use


def test_equal_queues_go_to_the_lower_kv_cache_usage_then_the_lower_index():
    assert choose_replica([load(2, kv=0.5), load(2, kv=0.25), load(2, kv=0.75)]) == 1
    assert choose_replica([load(1, kv=0.5), load(1, kv=0.5)]) == 0


def test_dead_replicas_get_nothing_and_all_dead_is_an_engine_dead_error():
    assert choose_replica([load(0, alive=False), load(5)]) == 1
    with pytest.raises(EngineDeadError, match="every data-parallel replica is dead"):
        choose_replica([load(0, alive=False), load(0, alive=False)])


def stats(**fields) -> EngineStats:
    values = dict(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        prompt_tokens_total=0,
        generation_tokens_total=0,
    )
    values.update(fields)
    return EngineStats(**values)


def test_replica_stats_are_summed_and_kv_usage_averaged():
    total = sum_stats(
        [
            stats(
                num_running=2, num_waiting=1, kv_cache_usage=0.5, prompt_tokens_total=10, running_lora_adapters=["a"]
            ),
            stats(
                num_running=3,
                kv_cache_usage=0.25,
                prompt_tokens_total=5,
                generation_tokens_total=7,
                max_lora=2,
                running_lora_adapters=["b", "a"],
            ),
        ]
    )
    assert (total.num_running, total.num_waiting, total.prompt_tokens_total, total.generation_tokens_total) == (
        5,
        1,
        15,
        7,
    )
    assert total.kv_cache_usage == pytest.approx(0.375)
    assert total.running_lora_adapters == ["a", "b"] and total.max_lora == 2


# -- the process boundary ------------------------------------------------------------------------


def test_errors_cross_with_their_class_message_and_param():
    error = PackedError.of(InvalidRequestError("max_tokens must be at least 1", param="max_tokens")).unpack()
    assert type(error) is InvalidRequestError and str(error) == "max_tokens must be at least 1"
    assert error.param == "max_tokens" and error.status_code == 400
    # a class whose __init__ takes other arguments than the message still comes back whole
    unknown = PackedError.of(UnknownNameError("tool parser", "hermez", ["hermes"])).unpack()
    assert type(unknown) is UnknownNameError and unknown.suggestion == "hermes"


def test_plain_plugins_keep_each_entry_its_plugin_and_its_options():
    from tokenloom.plugins.manager import load_plugins

    plugins = load_plugins()
    rebuilt = PluginSet.from_plain(plugins.to_plain())
    for kind, registry in plugins.registries.items():
        assert rebuilt.registry(kind).names() == registry.names()
        for entry in registry.entries():
            assert rebuilt.registry(kind).entry(entry.name).options == entry.options
            assert rebuilt.registry(kind).entry(entry.name).plugin_name == entry.plugin_name


def test_local_replicas_get_disjoint_cores_when_there_are_enough():
    cores = sorted(os.sched_getaffinity(0))
    sets = local_cpu_sets(len(cores))
    assert sets == [[core] for core in cores]
    assert local_cpu_sets(len(cores) + 1)[-1] == [cores[0]]  # more replicas than cores: shared


def test_data_parallel_flags_are_checked_together():
    with pytest.raises(ConfigError, match="^--data-parallel-address: 1 of 2 replicas on this node"):
        EngineArgs(data_parallel_size=2, data_parallel_size_local=1).create_engine_config()
    with pytest.raises(ConfigError, match="^--data-parallel-size-local: must be between 0 and --data-parallel-size"):
        EngineArgs(data_parallel_size=2, data_parallel_size_local=3, data_parallel_backend="ray").create_engine_config()
    with pytest.raises(ConfigError, match="^--data-parallel-backend: must be one of mp, ray, got 'slurm'"):
        EngineArgs(data_parallel_size=2, data_parallel_backend="slurm").create_engine_config()
    with pytest.raises(ConfigError, match="^--data-parallel-size: must be a whole number of at least 1, got 0"):
        EngineArgs(data_parallel_size=0).create_engine_config()
    config = EngineArgs(
        data_parallel_size=4, data_parallel_size_local=1, data_parallel_backend="ray"
    ).create_engine_config()
    assert (config.parallel.data_parallel_size, config.parallel.data_parallel_size_local) == (4, 1)


class FakeRay:
    """The two things ray_actor_options asks Ray: this node's id and the cluster's nodes."""

    def __init__(self, node_ids: list[str]):
        self.node_ids = node_ids

    def get_runtime_context(self):
        here = self.node_ids[0]
        return type("Context", (), {"get_node_id": lambda self: here})()

    def nodes(self):
        return [{"NodeID": node, "Alive": True} for node in self.node_ids] + [{"NodeID": "gone", "Alive": False}]


HEAD, W1, W2 = (f"{number:056x}" for number in (1, 2, 3))  # node ids are 28-byte hex strings


def test_ray_replicas_beyond_the_local_count_go_to_other_nodes():
    from tokenloom.core.engine.replica_handles import ray_actor_options

    parallel = EngineArgs(data_parallel_size=4, data_parallel_size_local=1, data_parallel_backend="ray")
    options = ray_actor_options(parallel.create_engine_config().parallel, FakeRay([HEAD, W1, W2]))
    placed = [(option["scheduling_strategy"].node_id, option["scheduling_strategy"].soft) for option in options]
    assert placed == [(HEAD, False), (W1, False), (W2, False), (W1, False)]
    assert all(option["num_cpus"] == 1 for option in options)
    unset = EngineArgs(data_parallel_size=2, data_parallel_backend="ray").create_engine_config().parallel
    assert [option["scheduling_strategy"] for option in ray_actor_options(unset, FakeRay([HEAD]))] == ["SPREAD"] * 2
    with pytest.raises(
        ConfigError, match="leaves 3 replica\\(s\\) for other nodes, but the Ray cluster has only this one"
    ):
        ray_actor_options(parallel.create_engine_config().parallel, FakeRay([HEAD]))


# -- routing, with scripted replicas -----------------------------------------------------------


class ScriptedReplica(ReplicaHandle):
    """Records what the server sends; the test plays the replica's answers."""

    def __init__(self, index: int):
        super().__init__(index)
        self.sent: list[tuple] = []

    def start(self, on_messages, on_death) -> None:
        pass

    def send(self, message) -> None:
        self.sent.append(message)

    def stop(self, timeout: float) -> None:
        self.closing = True

    def kill(self) -> None:
        pass


def scripted_engine(num_replicas: int = 2) -> tuple[DataParallelAsyncLLM, list[ScriptedReplica]]:
    from tokenloom.plugins.manager import load_plugins

    replicas = [ScriptedReplica(index) for index in range(num_replicas)]
    engine = DataParallelAsyncLLM(EngineArgs().create_engine_config(), load_plugins(), replicas)
    engine._num_in_flight = [0] * num_replicas
    engine._replica_stats = [stats() for _ in range(num_replicas)]
    engine._dead_reasons = [None] * num_replicas
    engine._facts = {"model_name": "scripted"}
    return engine, replicas


def output(request_id: str, text: str, finished: bool) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=[1],
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="length" if finished else None,
    )
    return RequestOutput(
        request_id=request_id,
        prompt="p",
        prompt_token_ids=[1],
        prompt_logprobs=None,
        outputs=[completion],
        finished=finished,
    )


PARAMS = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)


def test_requests_spread_over_replicas_aborts_go_to_the_holder_and_outputs_to_their_stream():
    engine, replicas = scripted_engine()

    async def run():
        first = engine.generate("p", PARAMS, "first")
        second = engine.generate("p", PARAMS, "second")
        first_output = asyncio.ensure_future(first.__anext__())
        second_output = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0)
        assert [(type(m), m.request_id) for m in replicas[0].sent] == [(Generate, "first")]
        assert [(type(m), m.request_id) for m in replicas[1].sent] == [(Generate, "second")]
        assert replicas[0].sent[0].sampling_params is PARAMS and replicas[0].sent[0].priority == 0
        assert engine.replica_loads()[0].num_in_flight == 1
        engine._on_messages(1, [Output("second", output("second", "b", False))])
        engine._on_messages(0, [Output("first", output("first", "a", True))])
        assert (await first_output).outputs[0].text == "a"
        assert (await second_output).outputs[0].text == "b"
        with pytest.raises(StopAsyncIteration):
            await first.__anext__()  # finished: no abort for it
        await engine.abort("second")
        assert replicas[1].sent[-1] == AbortRequest("second") and isinstance(replicas[0].sent[-1], Generate)
        await second.aclose()  # closed early: the holder is told again, harmlessly
        assert replicas[1].sent[-1] == AbortRequest("second")
        assert [load.num_in_flight for load in engine.replica_loads()] == [0, 0]
        # the next request goes to the replica with less KV-cache in use
        engine._on_messages(0, [Stats(stats(kv_cache_usage=0.6), None)])
        third = engine.generate("p", PARAMS, "third")
        pending = asyncio.ensure_future(third.__anext__())
        await asyncio.sleep(0)
        assert isinstance(replicas[1].sent[-1], Generate) and replicas[1].sent[-1].request_id == "third"
        pending.cancel()  # the client went away: the holder aborts it
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert replicas[1].sent[-1] == AbortRequest("third")

    asyncio.run(run())


def test_an_error_a_replica_sends_is_raised_from_the_stream():
    engine, replicas = scripted_engine()

    async def run():
        stream = engine.generate("p", PARAMS, "bad")
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        engine._on_messages(0, [Output("bad", PackedError.of(InvalidRequestError("too long", param="prompt")))])
        with pytest.raises(InvalidRequestError, match="too long"):
            await pending
        assert not engine.errored

    asyncio.run(run())


def test_a_dead_replica_ends_its_streams_and_the_engine_reports_unhealthy_while_others_finish():
    engine, replicas = scripted_engine()

    async def run():
        await engine.start()
        on_zero = engine.generate("p", PARAMS, "on-zero")
        on_one = engine.generate("p", PARAMS, "on-one")
        zero_output = asyncio.ensure_future(on_zero.__anext__())
        one_output = asyncio.ensure_future(on_one.__anext__())
        await asyncio.sleep(0)
        engine._on_death(1, "data-parallel replica 1 (pid 42) exited with code -9")
        await asyncio.sleep(0)
        with pytest.raises(EngineDeadError, match="replica 1 \\(pid 42\\) exited with code -9"):
            await one_output
        assert engine.errored and not engine.is_running
        assert not any(isinstance(message, AbortRequest) for message in replicas[1].sent)  # nothing to the dead
        engine._on_messages(0, [Output("on-zero", output("on-zero", "done", True))])
        assert (await zero_output).finished  # the live replica's stream finishes
        with pytest.raises(EngineDeadError, match="the engine is dead"):
            await engine.generate("p", PARAMS, "late").__anext__()

    asyncio.run(run())


def test_a_reply_to_a_call_on_a_dead_replica_is_an_error_not_a_hang():
    engine, replicas = scripted_engine()
    future = engine._call_now(1, ResolveLora(None))
    engine._on_death(1, "replica 1 gone")
    with pytest.raises(EngineDeadError, match="replica 1 gone"):
        future.result(timeout=1)
    answered = engine._call_now(0, RemoveLora(3))
    engine._on_messages(0, [Reply(replicas[0].sent[-1].call_id, True, False)])
    assert answered.result(timeout=1) is False


# -- real replica processes --------------------------------------------------------------------


def collect(engine, request_id: str, prompt: str, max_tokens: int, first_tokens: asyncio.Event | None = None):
    """The request's greedy token ids; ``first_tokens`` is set once its first tokens arrived."""

    async def run():
        tokens = []
        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        async for item in engine.generate(prompt, params, request_id):
            tokens += item.outputs[0].token_ids
            if first_tokens is not None:
                first_tokens.set()
        return tokens

    return run()


class FirstTokens(asyncio.Event):
    """Set on a request's first tokens, noting then which replica the engine gave it to (a
    request that has finished is no longer in the engine's table)."""

    def __init__(self, engine, request_id: str):
        super().__init__()
        self.engine, self.request_id, self.owner = engine, request_id, None

    def set(self) -> None:
        if not self.is_set():
            self.owner = self.engine._owner.get(self.request_id)
        super().set()


async def running_long_requests(engine, prompts: list[str]) -> tuple[list[asyncio.Future], dict[str, int]]:
    """A 200-token request per prompt (``long-0``, ``long-1`` ...), returned once each is running,
    its first tokens received, with the replica each was running on then. (Polling the replicas'
    stats for both running missed the window whenever a replica ran its 200 tokens between two
    stats messages, and the test hung; the engine's table after both started missed a request
    that one replica had finished before the other replica's first tokens.)"""
    started = [FirstTokens(engine, f"long-{index}") for index in range(len(prompts))]
    requests = [
        asyncio.ensure_future(collect(engine, f"long-{index}", prompt, 200, started[index]))
        for index, prompt in enumerate(prompts)
    ]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=120)
    return requests, {event.request_id: event.owner for event in started}


@pytest.mark.slow  # two engine processes
def test_two_replica_processes_serve_as_one_engine_and_a_killed_one_fails_only_its_streams(tiny_llama_dir):
    import psutil

    args = dict(model=tiny_llama_dir, dtype="float32", block_size=4)
    prompts = ["A short story about a robot:", "Numbers: 1, 2,", "The sky is", "Once upon a time"]

    async def single():
        engine = build_engine_client(EngineArgs(**args))
        await engine.start()
        try:
            return await asyncio.gather(*(collect(engine, f"r{i}", prompt, 8) for i, prompt in enumerate(prompts)))
        finally:
            await engine.shutdown()

    expected = asyncio.run(single())
    engine = build_engine_client(EngineArgs(**args, data_parallel_size=2))
    assert isinstance(engine, DataParallelAsyncLLM)
    pids = [replica.process.pid for replica in engine.replicas]

    async def run():
        await engine.start()
        try:
            got = await asyncio.gather(*(collect(engine, f"r{i}", prompt, 8) for i, prompt in enumerate(prompts)))
            assert got == expected
            assert engine.stats().generation_tokens_total == 8 * len(prompts)
            # a long request on each replica, then replica 1 dies mid-stream
            (long_zero, long_one), owners = await running_long_requests(engine, prompts[:2])
            assert owners == {"long-0": 0, "long-1": 1}
            engine.replicas[1].kill()
            with pytest.raises(EngineDeadError, match="replica 1 .* exited with code -9"):
                await long_one
            assert engine.errored
            assert len(await long_zero) == 200  # the live replica's request runs to its end
        finally:
            await engine.shutdown()

    asyncio.run(run())
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow  # two engine processes
def test_a_stopped_replica_process_is_dead_once_silent_for_the_step_timeout_and_is_killed(tiny_llama_dir, monkeypatch):
    import psutil

    monkeypatch.setenv("TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3")
    args = dict(model=tiny_llama_dir, dtype="float32", block_size=4, data_parallel_size=2)
    engine = build_engine_client(EngineArgs(**args))
    pids = [replica.process.pid for replica in engine.replicas]

    async def run():
        await engine.start()
        try:
            (long_zero, long_one), owners = await running_long_requests(
                engine, ["A short story about a robot:", "Numbers: 1, 2,"]
            )
            assert owners == {"long-0": 0, "long-1": 1}
            os.kill(pids[1], signal.SIGSTOP)
            with pytest.raises(EngineDeadError) as failure:
                await asyncio.wait_for(long_one, timeout=3 + 20)
            assert f"replica 1 (pid {pids[1]}, stopped by a signal) sent nothing for 3s" in str(failure.value)
            assert engine.errored
            assert len(await long_zero) == 200  # the live replica's request runs to its end
        finally:
            await engine.shutdown()

    try:
        asyncio.run(run())
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_a_ray_replica_silent_for_the_step_timeout_is_dead_and_killed(monkeypatch):
    class GetTimeoutError(Exception):
        pass

    actor = mock.MagicMock()
    started = actor.start.remote.return_value
    timeouts: list[float | None] = []

    def get(ref, timeout=None):
        if ref is started:
            return {"model_name": "scripted"}
        timeouts.append(timeout)
        raise GetTimeoutError  # what ray.get raises once the actor has been silent that long

    ray = mock.MagicMock(get=get, exceptions=mock.MagicMock(GetTimeoutError=GetTimeoutError))
    ray.remote.return_value.options.return_value.remote.return_value = actor
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "7")
    replica = RayReplica(1, EngineArgs(), {}, {"num_cpus": 1})
    deaths: list[tuple[int, str]] = []
    died = threading.Event()
    replica.start(lambda index, messages: None, lambda index, reason: (deaths.append((index, reason)), died.set()))
    assert died.wait(10)
    assert deaths == [
        (
            1,
            "data-parallel replica 1 (Ray actor) sent nothing for 7s (TOKENLOOM_EXECUTE_MODEL_TIMEOUT_SECONDS sets the limit)",
        )
    ]
    assert timeouts == [0.5 + 7]  # a stats interval, then the limit
    ray.kill.assert_called_once_with(actor)


def test_lora_adapters_are_added_to_and_removed_from_every_live_replica():
    engine, replicas = scripted_engine(3)
    engine._dead_reasons[2] = "replica 2 gone"

    async def answer(expected_call, call, values: list) -> object:
        task = asyncio.ensure_future(call)
        while not all(replica.sent and isinstance(replica.sent[-1], Call) for replica in replicas[:2]):
            await asyncio.sleep(0)
        for replica, value in zip(replicas[:2], values):
            sent = replica.sent[-1]
            assert sent.call == expected_call
            engine._on_messages(replica.index, [Reply(sent.call_id, True, value)])
            replica.sent.clear()
        return await task

    async def run():
        assert await answer(AddLora("adapter"), engine.add_lora("adapter"), [True, True]) is True
        assert await answer(RemoveLora(1), engine.remove_lora(1), [False, True]) is True
        assert replicas[2].sent == []  # nothing to the dead one

    asyncio.run(run())


def test_the_ray_backend_starts_ray_without_its_dashboard(monkeypatch):
    # issue 37: the data-parallel ray.init started Ray's dashboard (an open HTTP port of its
    # own), which the executor's ray.init already turned off
    from tokenloom.core.engine import data_parallel
    from tokenloom.plugins.manager import load_plugins

    calls = []

    class RecordingRay:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            calls.append(kwargs)
            raise RuntimeError("stop here: no cluster in this test")

    monkeypatch.setattr(data_parallel, "import_ray", lambda flag: RecordingRay())
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    engine_args = EngineArgs(data_parallel_size=2, data_parallel_backend="ray")
    with pytest.raises(RuntimeError, match="stop here"):
        data_parallel.DataParallelAsyncLLM.from_engine_args(engine_args, load_plugins())
    assert calls == [{"address": "local", "include_dashboard": False}]
