"""AsyncLLM with a tiny random Llama: per-request streams, abort on close freeing blocks at once,
validation before anything is queued, and every stream told when the engine dies."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.core.config import EngineArgs
from tokenloom.core.engine import AsyncLLM
from tokenloom.core.sampling_params import RequestOutputKind
from tokenloom.errors import ContextLengthError, EngineDeadError, InvalidRequestError

PROMPT = "A short story about a robot:"


@pytest.fixture
def engine(tiny_llama_dir):
    return AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4))


def delta_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


async def collect(engine: AsyncLLM, request_id: str, prompt, params) -> tuple[str, list[int], str | None]:
    text, tokens, finish = "", [], None
    async for output in engine.generate(prompt, params, request_id):
        text += output.outputs[0].text
        tokens += output.outputs[0].token_ids
        finish = output.outputs[0].finish_reason
    return text, tokens, finish


def test_concurrent_streams_equal_offline_greedy(engine, tiny_llama_dir):
    offline = LLM(model=tiny_llama_dir, dtype="float32", block_size=4).generate(
        [PROMPT, "Numbers: 1, 2,"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )

    async def run():
        await engine.start()
        try:
            return await asyncio.gather(
                collect(engine, "a", PROMPT, delta_params(10)), collect(engine, "b", "Numbers: 1, 2,", delta_params(10))
            )
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    for (text, tokens, finish), expected in zip(results, offline):
        assert tokens == expected.outputs[0].token_ids
        assert text == expected.outputs[0].text
        assert finish == "length"


def test_closing_a_stream_aborts_and_frees_its_blocks(engine):
    async def run():
        await engine.start()
        try:
            stream = engine.generate(PROMPT, delta_params(200), "long")
            await stream.__anext__()
            await stream.__anext__()
            assert engine.engine.scheduler.block_manager.num_free_blocks < engine.engine.num_blocks
            await stream.aclose()
            for _ in range(100):
                if engine.engine.scheduler.block_manager.num_free_blocks == engine.engine.num_blocks:
                    break
                await asyncio.sleep(0.05)
            return engine.engine.scheduler.block_manager.num_free_blocks, engine.engine.has_unfinished_requests()
        finally:
            await engine.shutdown()

    free_blocks, unfinished = asyncio.run(run())
    assert free_blocks == engine.engine.num_blocks
    assert not unfinished


def test_bad_input_fails_before_anything_is_queued(engine):
    async def first(prompt, params, request_id="x"):
        async for output in engine.generate(prompt, params, request_id):
            return output

    async def run():
        await engine.start()
        try:
            with pytest.raises(ContextLengthError, match="256"):
                await first([5] * 300, delta_params(4))
            with pytest.raises(InvalidRequestError, match="vocabulary"):
                await first([10**9], delta_params(4))
            with pytest.raises(InvalidRequestError, match="empty"):
                await first([], delta_params(4))
            assert not engine.engine.has_unfinished_requests()
            return await first(PROMPT, delta_params(2), "fine")
        finally:
            await engine.shutdown()

    assert asyncio.run(run()).outputs[0].token_ids


def test_every_stream_learns_when_the_engine_dies(engine):
    def broken_step():
        raise RuntimeError("simulated worker crash")

    engine.engine.step = broken_step

    async def run():
        await engine.start()
        with pytest.raises(EngineDeadError, match="simulated worker crash"):
            await collect(engine, "doomed", PROMPT, delta_params(4))
        with pytest.raises(EngineDeadError):
            await collect(engine, "after", PROMPT, delta_params(4))
        assert engine.errored and not engine.is_running

    asyncio.run(run())


def test_the_engine_is_built_and_stepped_on_one_thread(tiny_llama_dir, monkeypatch):
    # a second thread running torch ops would start a second OpenMP pool (slow steps)
    import threading

    from tokenloom.core.engine import LLMEngine

    threads = {"main": threading.current_thread()}
    build, step = LLMEngine.from_engine_args.__func__, LLMEngine.step

    def recording_build(cls, *args, **kwargs):
        threads["build"] = threading.current_thread()
        return build(cls, *args, **kwargs)

    def recording_step(self):
        threads["step"] = threading.current_thread()
        return step(self)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(recording_build))
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_dir, dtype="float32", block_size=4))

    async def run():
        try:
            return await collect(engine, "a", PROMPT, delta_params(3))
        finally:
            await engine.shutdown()

    assert asyncio.run(run())[2] == "length"
    assert threads["build"] is threads["step"] is not threads["main"]


def test_a_build_error_is_raised_by_from_engine_args(tmp_path):
    with pytest.raises(Exception, match=str(tmp_path / "missing")):
        AsyncLLM.from_engine_args(EngineArgs(model=str(tmp_path / "missing")))


def test_an_idle_engine_maps_unused_kv_blocks_without_touching_used_ones(engine, tiny_llama_dir):
    """Prefaulting writes zeros only above the high-water mark of blocks ever handed out: a
    request's KV survives it, and greedy output after it equals the offline engine's."""
    offline = LLM(model=tiny_llama_dir, dtype="float32", block_size=4).generate(
        [PROMPT, PROMPT + " It"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )

    async def run():
        await engine.start()
        try:
            first = await collect(engine, "a", PROMPT, delta_params(6))
            runner = engine.engine.executor.worker.runner
            used = runner._kv_high_water
            snapshot = [cache[:, :used].clone() for cache in runner.kv_caches]
            for _ in range(200):  # the idle loop maps chunk after chunk
                if runner._kv_prefaulted > used:
                    break
                await asyncio.sleep(0.01)
            assert runner._kv_prefaulted > used
            for cache, before in zip(runner.kv_caches, snapshot):
                assert torch.equal(cache[:, :used], before)
            second = await collect(engine, "b", PROMPT + " It", delta_params(6))
            return first, second
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    for (_, tokens, _), expected in zip(results, offline):
        assert tokens == expected.outputs[0].token_ids


# two layers of K and V for one block of the runners below, float32
BLOCK_BYTES = 2 * (2 * 4 * 1 * 2 * 4)


def prefault_runner(blocks: int, high_water: int, fill: float, maps: bool):
    """A model runner with only what prefault_kv_cache reads: two layers' caches of ``blocks``
    blocks filled with ``fill``, blocks below ``high_water`` used, and a mock platform whose
    map_blocks answers ``maps``."""
    from tokenloom.core.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.kv_caches = [torch.full((2, blocks, 4, 1, 2), fill) for _ in range(2)]
    runner._kv_high_water, runner._kv_prefaulted, runner._kv_map_blocks_off = high_water, 0, False
    runner.platform = mock.Mock()
    runner.platform.map_blocks.return_value = maps
    return runner


def mapped_spans(runner) -> list[tuple[int, int]]:
    return [call.args[1:] for call in runner.platform.map_blocks.call_args_list]


def test_prefault_stops_at_the_end_of_the_pool_and_never_goes_below_the_high_water_mark():
    runner = prefault_runner(6, 3, 7.0, maps=False)  # a platform that cannot map: zeros are written
    assert runner.prefault_kv_cache(2 * BLOCK_BYTES) == 2 * BLOCK_BYTES
    for cache in runner.kv_caches:
        assert (cache[:, :3] == 7).all() and (cache[:, 3:5] == 0).all() and (cache[:, 5:] == 7).all()
    assert runner.prefault_kv_cache(10 * BLOCK_BYTES) == BLOCK_BYTES  # only block 5 is left
    assert runner.prefault_kv_cache(10 * BLOCK_BYTES) == 0
    assert runner.platform.map_blocks.call_count == 1  # not asked again once it could not


def test_prefault_maps_through_the_platform_where_it_maps_and_writes_nothing():
    runner = prefault_runner(6, 3, 7.0, maps=True)
    assert runner.prefault_kv_cache(2 * BLOCK_BYTES) == 2 * BLOCK_BYTES
    assert runner.prefault_kv_cache(10 * BLOCK_BYTES) == BLOCK_BYTES
    assert mapped_spans(runner) == [(3, 5), (5, 6)]
    assert all((cache == 7).all() for cache in runner.kv_caches)


def test_prefault_keeps_a_lead_of_mapped_blocks_ahead_of_the_used_ones(monkeypatch):
    """The idle loop maps up to KV_PREFAULT_LEAD_BYTES ahead of the high-water mark, and after
    steps took more blocks, maps on to restore that lead (a benchmark sweeping a 4 GiB pool finds
    its next blocks mapped after each pause, not only its first GiB)."""
    from tokenloom.core import model_runner_kv_cache

    runner = prefault_runner(10, 0, 0.0, maps=True)
    monkeypatch.setattr(model_runner_kv_cache, "KV_PREFAULT_LEAD_BYTES", 3 * BLOCK_BYTES)
    assert runner.prefault_kv_cache(2 * BLOCK_BYTES) == 2 * BLOCK_BYTES
    assert runner.prefault_kv_cache(2 * BLOCK_BYTES) == BLOCK_BYTES  # the lead is 3 blocks
    assert runner.prefault_kv_cache(2 * BLOCK_BYTES) == 0
    runner._kv_high_water = 2  # steps used blocks 0 and 1
    assert runner.prefault_kv_cache(5 * BLOCK_BYTES) == 2 * BLOCK_BYTES
    assert runner.prefault_kv_cache(5 * BLOCK_BYTES) == 0
    runner._kv_high_water = 9
    assert runner.prefault_kv_cache(5 * BLOCK_BYTES) == BLOCK_BYTES  # the pool's last block
    assert mapped_spans(runner) == [(0, 2), (2, 3), (3, 5), (9, 10)]


def test_a_prefault_chunk_smaller_than_a_block_still_maps_one_block():
    """A 1.7B model's block (all layers' K and V) is 3 MiB, three times the idle loop's chunk: the
    chunk maps one block, where it used to map none and so end the idle mapping at once."""
    runner = prefault_runner(4, 1, 0.0, maps=True)
    for _ in range(3):
        assert runner.prefault_kv_cache(BLOCK_BYTES // 3) == BLOCK_BYTES
    assert runner.prefault_kv_cache(BLOCK_BYTES // 3) == 0  # the pool's end
    assert mapped_spans(runner) == [(1, 2), (2, 3), (3, 4)]
