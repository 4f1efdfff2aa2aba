"""SharedStorageConnector on a tiny random Llama (float32): greedy ids with the prefix from the
directory, from the local prefix cache, or both, equal the ids without a connector, also with
chunked prefill and preemption and under the mp executor; a corrupted or truncated block file is
detected, recomputed and stored again; another model never loads a block; a kv_producer's blocks
serve a kv_consumer; and the store's own checks (options, LRU eviction by bytes, files written
for another namespace)."""

from __future__ import annotations

import gc
import os
import shutil

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.builtin_plugins.kv_connectors.shared_storage import BLOCK_SUFFIX, SharedStorageConnector
from tokenloom.core.config import KVTransferConfig
from tokenloom.core.kv_connector import KVBlockCorruptError, KVConnectorContext
from tokenloom.errors import ConfigError

PLUGINS = ["tokenloom.builtin_plugins.kv_connectors"]
BLOCK_SIZE = 16
# the chosen tokens' logprobs too: a wrong KV block that leaves the greedy ids of a random model
# unchanged still moves them
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
# 150 tokens (9 full blocks before the last token); the second shares the first 3 blocks
PROMPT = [(7 * i + 3) % 1000 + 20 for i in range(150)]
SHARES_THREE_BLOCKS = PROMPT[:48] + [(11 * i + 5) % 900 + 30 for i in range(40)]
OTHERS = [[(13 * i + k) % 950 + 25 for i in range(120 + 10 * k)] for k in range(3)]


def kv_config(store, role: str = "kv_both", **extra) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store), **extra},
    }


def make_llm(model: str, store=None, role: str = "kv_both", **options) -> LLM:
    options.setdefault("num_gpu_blocks_override", 64)
    return LLM(
        model,
        plugins=PLUGINS,
        dtype="float32",
        kv_transfer_config=None if store is None else kv_config(store, role),
        **options,
    )


def ids(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params)]


def answer(output) -> tuple[list[int], float]:
    """Greedy ids and their summed logprob."""
    return list(output.outputs[0].token_ids), output.outputs[0].cumulative_logprob


def same(output, expected: tuple[list[int], float]) -> bool:
    token_ids, cumulative_logprob = answer(output)
    # float32 sums over other batch shapes: equal to rounding, where a wrong block is far off
    return token_ids == expected[0] and abs(cumulative_logprob - expected[1]) < 1e-3


def flush(llm: LLM) -> None:
    """Wait until the worker's saver stored every block it was handed."""
    worker_connector = llm.engine.executor.worker.kv_connector
    assert worker_connector is not None
    worker_connector.wait_for_save()


def block_files(store) -> list[str]:
    return sorted(
        os.path.join(directory, name)
        for directory, _, names in os.walk(store)
        for name in names
        if name.endswith(BLOCK_SUFFIX)
    )


def close(llm: LLM) -> None:
    llm.engine.executor.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict[tuple[int, ...], list[int]]:
    llm = make_llm(tiny_llama_dir)
    prompts = [PROMPT, SHARES_THREE_BLOCKS, *OTHERS]
    result = {tuple(prompt): answer(output) for prompt, output in zip(prompts, llm.generate(prompts, GREEDY))}
    close(llm)
    return result


@pytest.mark.hook("register_kv_connectors")
def test_prefix_from_disk_local_cache_or_both_gives_the_ids_without_a_connector(tiny_llama_dir, tmp_path, reference):
    llm = make_llm(tiny_llama_dir, tmp_path)
    (output,) = llm.generate([PROMPT], GREEDY)
    assert same(output, reference[tuple(PROMPT)])
    flush(llm)
    # every full prompt block before the last token's is stored, nothing more
    assert len(block_files(tmp_path)) == len(PROMPT) // BLOCK_SIZE
    # again in the same engine: the local prefix cache serves it, the connector is not asked
    (output,) = llm.generate([PROMPT], GREEDY)
    assert same(output, reference[tuple(PROMPT)])
    # (the saver's count reaches the engine's stats with a step's output: read it after one)
    stats = llm.engine.stats().kv_connector
    assert stats is not None and (stats.hits, stats.num_blocks_stored) == (0, len(PROMPT) // BLOCK_SIZE)
    assert output.num_cached_tokens == 144
    close(llm)

    restarted = make_llm(tiny_llama_dir, tmp_path)
    # 3 blocks from disk (then cached locally), its tail computed
    (output,) = restarted.generate([SHARES_THREE_BLOCKS], GREEDY)
    assert same(output, reference[tuple(SHARES_THREE_BLOCKS)])
    assert output.num_cached_tokens == 48
    # 3 blocks from the local cache, the next 6 from disk, 6 tokens computed
    (output,) = restarted.generate([PROMPT], GREEDY)
    assert same(output, reference[tuple(PROMPT)])
    assert output.num_cached_tokens == 144
    stats = restarted.engine.stats().kv_connector
    assert (stats.hits, stats.num_blocks_loaded, stats.num_load_failures) == (48 + 96, 3 + 6, 0)
    caches = restarted.engine.executor.worker.runner.kv_caches
    assert stats.num_bytes_loaded == 9 * sum(cache[:, 0].numel() * cache.element_size() for cache in caches)
    close(restarted)


def test_chunked_prefill_preemption_and_the_mp_executor_give_the_same_ids(tiny_llama_dir, tmp_path, reference):
    writer = make_llm(tiny_llama_dir, tmp_path)
    ids(writer, [PROMPT])
    flush(writer)
    close(writer)
    prompts = [PROMPT, *OTHERS]
    # 32-token chunks; 24 blocks cannot hold four prompts of 8-10 blocks: preemptions
    llm = make_llm(
        tiny_llama_dir, tmp_path, max_num_batched_tokens=32, enable_chunked_prefill=True, num_gpu_blocks_override=24
    )
    outputs = llm.generate(prompts, GREEDY)
    assert all(same(output, reference[tuple(prompt)]) for output, prompt in zip(outputs, prompts))
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_connector is not None and stats.kv_connector.hits >= 144
    close(llm)

    mp = make_llm(tiny_llama_dir, tmp_path, distributed_executor_backend="mp")
    (output,) = mp.generate([PROMPT], GREEDY)
    assert same(output, reference[tuple(PROMPT)])
    assert output.num_cached_tokens == 144
    assert mp.engine.stats().kv_connector.num_blocks_loaded == 9
    mp.engine.executor.shutdown()
    del mp
    gc.collect()


def test_blocks_loaded_before_their_request_runs_are_not_zeroed_by_prefaulting(tiny_llama_dir, tmp_path, reference):
    writer = make_llm(tiny_llama_dir, tmp_path)
    ids(writer, [PROMPT])
    flush(writer)
    close(writer)
    llm = make_llm(tiny_llama_dir, tmp_path)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": PROMPT}, GREEDY)
    engine.step()  # the load starts
    engine.executor.worker.kv_connector.wait_for_load()
    # the server's idle loop maps never-used blocks by writing zeros over them: not these
    assert engine.executor.prefault_kv_cache(1 << 40) > 0
    worker = engine.executor.worker
    block_manager = engine.scheduler.block_manager
    table = block_manager.get_block_table("r")
    for block_id, block_hash in zip(table, block_manager.block_hashes(engine.scheduler.get_sequence("r"), 0, 9)):
        stored = worker.kv_connector.connector.load_block(block_hash)
        assert stored.any() and torch.equal(
            torch.stack([cache[:, block_id] for cache in worker.runner.kv_caches]), stored
        )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert same(outputs[-1], reference[tuple(PROMPT)])
    assert outputs[-1].num_cached_tokens == 144
    close(llm)


def test_a_corrupted_or_truncated_block_is_recomputed_and_stored_again(tiny_llama_dir, tmp_path, reference):
    writer = make_llm(tiny_llama_dir, tmp_path)
    ids(writer, [PROMPT])
    flush(writer)
    close(writer)
    # the saver stores a step's blocks in prompt order: modification times give the chain
    chain = sorted(block_files(tmp_path), key=lambda path: os.stat(path).st_mtime_ns)
    sizes = {path: os.path.getsize(path) for path in chain}
    with open(chain[2], "r+b") as file:
        file.truncate(sizes[chain[2]] - 1000)
    with open(chain[4], "r+b") as file:
        file.seek(-100, os.SEEK_END)
        byte = file.read(1)
        file.seek(-100, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0xFF]))

    for num_loaded in (2, 4):  # the truncated block ends the first load, the flipped bit the second
        llm = make_llm(tiny_llama_dir, tmp_path)
        (output,) = llm.generate([PROMPT], GREEDY)
        assert same(output, reference[tuple(PROMPT)])
        stats = llm.engine.stats().kv_connector
        assert (stats.num_blocks_loaded, stats.num_load_failures) == (num_loaded, 1)
        assert output.num_cached_tokens == num_loaded * BLOCK_SIZE
        flush(llm)
        close(llm)
    # every file is whole again: the bad ones were recomputed and stored anew
    assert {path: os.path.getsize(path) for path in block_files(tmp_path)} == sizes
    (namespace,) = os.listdir(tmp_path)
    store = connector(tmp_path, namespace)
    for path in chain:
        assert store.load_block(bytes.fromhex(os.path.basename(path).removesuffix(BLOCK_SUFFIX))) is not None


def test_another_model_never_loads_a_block(tiny_llama_dir, tmp_path, reference):
    writer = make_llm(tiny_llama_dir, tmp_path)
    ids(writer, [PROMPT])
    flush(writer)
    close(writer)
    # the same weights in bfloat16 make other KV: another namespace, nothing found
    llm = LLM(
        tiny_llama_dir,
        plugins=PLUGINS,
        dtype="bfloat16",
        num_gpu_blocks_override=64,
        kv_transfer_config=kv_config(tmp_path),
    )
    (output,) = llm.generate([PROMPT], GREEDY)
    stats = llm.engine.stats().kv_connector
    assert (stats.queries, stats.hits, output.num_cached_tokens) == (144, 0, 0)
    flush(llm)
    close(llm)
    assert len(os.listdir(tmp_path)) == 2 and len(block_files(tmp_path)) == 2 * 9


def test_a_producers_blocks_serve_a_consumer_that_computes_only_the_tail(tiny_llama_dir, tmp_path, reference):
    producer = make_llm(tiny_llama_dir, tmp_path, role="kv_producer")
    producer.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))
    flush(producer)
    close(producer)
    consumer = make_llm(tiny_llama_dir, tmp_path, role="kv_consumer")
    (output,) = consumer.generate([PROMPT], GREEDY)
    assert same(output, reference[tuple(PROMPT)])
    assert output.num_cached_tokens == 144
    stats = consumer.engine.stats().kv_connector
    assert (stats.hits, stats.num_blocks_stored) == (144, 0)
    close(consumer)


# -- the store without an engine ----------------------------------------------------------------


def connector(store, namespace: str = "a" * 32, **extra) -> SharedStorageConnector:
    config = KVTransferConfig("SharedStorageConnector", "kv_both", {"shared_storage_path": str(store), **extra})
    return SharedStorageConnector(KVConnectorContext(config, namespace, {"model": namespace}, BLOCK_SIZE))


def block(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, BLOCK_SIZE, 2, 8, generator=torch.Generator().manual_seed(seed))


def test_options_are_checked():
    for extra, message in [
        ({}, 'needs "shared_storage_path"'),
        ({"shared_storage_path": "/tmp/x", "max_size": 1}, "unknown kv_connector_extra_config key"),
        ({"shared_storage_path": "/tmp/x", "max_bytes": "1G"}, "max_bytes must be a whole number"),
    ]:
        with pytest.raises(ConfigError, match=message):
            SharedStorageConnector(
                KVConnectorContext(KVTransferConfig("SharedStorageConnector", "kv_both", extra), "n", {}, BLOCK_SIZE)
            )


def test_blocks_round_trip_and_the_least_recently_used_go_past_the_byte_bound(tmp_path):
    probe = connector(tmp_path / "probe")
    size = probe.save_block(b"\x00" * 32, block(0))
    assert probe.save_block(b"\x00" * 32, block(0)) == 0  # stored already
    store = connector(tmp_path / "store", max_bytes=3 * size)
    hashes = [bytes([index]) * 32 for index in range(1, 5)]
    for index, block_hash in enumerate(hashes[:3]):
        assert store.save_block(block_hash, block(index)) == size
        os.utime(store._path(block_hash), (1000 + index, 1000 + index))
    assert torch.equal(store.load_block(hashes[0]), block(0))  # loading refreshes the oldest
    assert store.num_stored_blocks(hashes) == 3
    store.save_block(hashes[3], block(3))  # over the bound: down to 90%, least recently used first
    assert [store.num_stored_blocks([block_hash]) for block_hash in hashes] == [1, 0, 0, 1]
    assert store.load_block(hashes[1]) is None
    assert store.num_stored_blocks(hashes) == 1


def test_a_file_of_another_namespace_is_never_served(tmp_path):
    first = connector(tmp_path, "a" * 32)
    second = connector(tmp_path, "b" * 32)
    first.save_block(b"\x01" * 32, block(1))
    os.makedirs(os.path.dirname(second._path(b"\x01" * 32)), exist_ok=True)
    shutil.copy(first._path(b"\x01" * 32), second._path(b"\x01" * 32))
    assert second.num_stored_blocks([b"\x01" * 32]) == 1
    with pytest.raises(KVBlockCorruptError, match="another model"):
        second.load_block(b"\x01" * 32)
    assert second.num_stored_blocks([b"\x01" * 32]) == 0  # deleted: never looked at again
    # a file renamed to another block's hash is refused the same way
    os.makedirs(os.path.dirname(first._path(b"\x02" * 32)), exist_ok=True)
    os.rename(first._path(b"\x01" * 32), first._path(b"\x02" * 32))
    with pytest.raises(KVBlockCorruptError, match="another model or block"):
        first.load_block(b"\x02" * 32)
