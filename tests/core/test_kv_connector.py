"""The core of --kv-transfer-config without a model: the config's vLLM shape, the scheduler
asking a connector for a new request's blocks past the local prefix hit, keeping the request
aside while they load (others keep stepping), prefilling only the tail once the worker reports
the load, the blocks each step computes offered for saving by role, an abort while loading, and
the worker half's loader and saver threads over a real KV-cache tensor layout."""

from __future__ import annotations

import pytest
import torch

from tokenloom.core.batch import ModelRunnerOutput
from tokenloom.core.config import CacheConfig, EngineArgs, KVTransferConfig, SchedulerConfig
from tokenloom.core.kv_connector import (
    KVBlockCorruptError,
    KVConnector,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorWorker,
    check_kv_transfer,
)
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.sequence import EngineSequence, SequenceStatus
from tokenloom.errors import ConfigError, UnknownNameError
from tokenloom.plugins.manager import load_plugins

BLOCK_SIZE = 4


class DictConnector(KVConnector):
    """Blocks in a dict; ``stored`` is shared by the test's scheduler and worker halves."""

    def __init__(self, context: KVConnectorContext, stored: dict[bytes, torch.Tensor] | None = None):
        super().__init__(context)
        self.stored: dict[bytes, torch.Tensor] = {} if stored is None else stored
        self.corrupt: set[bytes] = set()

    def num_stored_blocks(self, block_hashes):
        count = 0
        while count < len(block_hashes) and block_hashes[count] in self.stored:
            count += 1
        return count

    def load_block(self, block_hash):
        if block_hash in self.corrupt:
            raise KVBlockCorruptError("checksum mismatch")
        return self.stored.get(block_hash)

    def save_block(self, block_hash, kv):
        if block_hash in self.stored:
            return 0
        self.stored[block_hash] = kv.clone()
        return kv.numel() * kv.element_size()


def context(role: str = "kv_both") -> KVConnectorContext:
    return KVConnectorContext(KVTransferConfig("Dict", role), "test-namespace", {}, BLOCK_SIZE)


def make_scheduler(connector: KVConnector, num_blocks: int = 32, **scheduler_options) -> Scheduler:
    return Scheduler(
        SchedulerConfig(**{"max_num_batched_tokens": 64, **scheduler_options}),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        num_blocks,
        max_model_len=256,
        kv_connector=connector,
    )


def seq(seq_id: str, prompt: list[int], **params) -> EngineSequence:
    return EngineSequence(seq_id, list(prompt), SamplingParams(max_tokens=4, **params))


def hashes_of(scheduler: Scheduler, sequence: EngineSequence, num_blocks: int) -> list[bytes]:
    return scheduler.block_manager.block_hashes(sequence, 0, num_blocks)  # type: ignore[return-value]


PROMPT = list(range(10, 30))  # 20 tokens: 5 full blocks, the last one's final token always computed


def store_blocks(connector: DictConnector, scheduler: Scheduler, prompt: list[int], num_blocks: int) -> list[bytes]:
    hashes = hashes_of(scheduler, seq("probe", prompt), num_blocks)
    scheduler.block_manager._sequences.pop("probe")  # the probe only computed hashes
    for block_hash in hashes:
        connector.stored[block_hash] = torch.zeros(1)
    return hashes


def test_the_config_takes_vllms_shape_and_names_what_is_wrong():
    config = KVTransferConfig.from_dict(
        {"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"a": 1}}
    )
    assert (config.kv_connector, config.loads, config.saves, config.kv_connector_extra_config) == (
        "SharedStorageConnector",
        True,
        False,
        {"a": 1},
    )
    assert KVTransferConfig.from_dict({"kv_connector": "X"}).kv_role == "kv_both"
    for options, message in [
        ({"kv_role": "kv_both"}, "kv_connector must name a connector"),
        ({"kv_connector": "X", "kv_role": "kv_sender"}, "kv_role must be one of kv_producer, kv_consumer, kv_both"),
        ({"kv_connector": "X", "kv_rank": 0}, "unknown key 'kv_rank'"),
        ({"kv_connector": "X", "kv_connector_extra_config": [1]}, "must be a JSON object"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            KVTransferConfig.from_dict(options)
        assert error.value.param == "kv-transfer-config"
    engine_config = EngineArgs(kv_transfer_config={"kv_connector": "X"}).create_engine_config()
    assert engine_config.kv_transfer == KVTransferConfig("X")
    assert EngineArgs().create_engine_config().kv_transfer is None


def test_an_unknown_connector_is_refused_naming_the_registered_ones():
    plugins = load_plugins(modules=["tokenloom.builtin_plugins.kv_connectors"])
    config = EngineArgs(kv_transfer_config={"kv_connector": "LMCacheConnectorV1"}).create_engine_config()
    with pytest.raises(UnknownNameError, match="SharedStorageConnector"):
        check_kv_transfer(config, plugins)
    config = EngineArgs(
        kv_transfer_config={"kv_connector": "SharedStorageConnector"}, prefix_caching_hash_algo="builtin"
    ).create_engine_config()
    with pytest.raises(ConfigError, match="use sha256"):
        check_kv_transfer(config, plugins)


def test_a_request_waits_aside_for_its_load_then_prefills_only_the_tail():
    connector = DictConnector(context())
    scheduler = make_scheduler(connector)
    hashes = store_blocks(connector, scheduler, PROMPT, 3)
    other = seq("other", list(range(500, 506)))
    scheduler.add_sequence(other)
    scheduler.add_sequence(seq("a", PROMPT))

    first = scheduler.schedule()
    # the other request runs; "a" holds blocks for its 3 stored blocks plus nothing else yet
    assert first.num_scheduled_tokens == {"other": 6}
    table = scheduler.block_manager.get_block_table("a")
    assert len(table) == 3
    metadata = first.kv_connector_metadata
    assert metadata is not None
    assert metadata.loads == {"a": list(zip(table, hashes))}
    assert metadata.num_loads_in_flight == 1 and first.needs_worker
    assert scheduler.has_unfinished_sequences() and scheduler.num_waiting == 1

    # a step that reports nothing: "a" stays aside, the other request decodes
    scheduler.update_from_output(
        first, ModelRunnerOutput(sampled_token_ids={"other": [7]}, kv_connector_output=KVConnectorOutput())
    )
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"other": 1}
    assert second.kv_connector_metadata is not None and second.kv_connector_metadata.loads == {}
    scheduler.update_from_output(
        second,
        ModelRunnerOutput(
            sampled_token_ids={"other": [7]}, kv_connector_output=KVConnectorOutput(finished_loads={"a": 3})
        ),
    )
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"other": 1, "a": 20 - 12}
    (new,) = third.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, new.block_ids[:3]) == ("a", 12, table)
    stats = scheduler.stats().kv_connector
    # asked: "other"'s one full block before its last token, and "a"'s four
    assert stats is not None and (stats.queries, stats.hits) == (4 + 16, 12)
    assert scheduler.get_sequence("a").num_cached_tokens == 12


def test_a_short_load_leaves_the_rest_to_compute_and_the_local_hit_comes_first():
    connector = DictConnector(context())
    scheduler = make_scheduler(connector)
    # a first request computes the first two blocks locally (cached when it finishes)
    scheduler.add_sequence(seq("local", PROMPT[:9]))
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"local": 9}
    scheduler.update_from_output(step, ModelRunnerOutput(sampled_token_ids={"local": [5]}))
    scheduler.finish_sequences("local", SequenceStatus.FINISHED_ABORTED)
    hashes = store_blocks(connector, scheduler, PROMPT, 4)

    scheduler.add_sequence(seq("a", PROMPT))
    step = scheduler.schedule()
    table = scheduler.block_manager.get_block_table("a")
    assert step.kv_connector_metadata is not None
    # blocks 0 and 1 come from the local prefix cache, 2 and 3 from the connector
    assert step.kv_connector_metadata.loads == {"a": [(table[2], hashes[2]), (table[3], hashes[3])]}
    # only the first of the two loaded: the rest of the prompt is computed
    scheduler.update_from_output(
        step, ModelRunnerOutput(kv_connector_output=KVConnectorOutput(finished_loads={"a": 1}))
    )
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"a": 20 - 12}
    assert step.scheduled_new_reqs[0].num_computed_tokens == 12


def test_steps_offer_their_computed_prompt_blocks_and_roles_split_loading_from_saving():
    connector = DictConnector(context("kv_producer"))
    scheduler = make_scheduler(connector, max_num_batched_tokens=8, enable_chunked_prefill=True)
    store_blocks(connector, scheduler, PROMPT, 5)  # a producer never loads, even what it holds
    scheduler.add_sequence(seq("a", PROMPT))
    hashes = hashes_of(scheduler, scheduler.get_sequence("a"), 5)
    saved = []
    while scheduler.get_sequence("a") is not None and scheduler.get_sequence("a").num_computed_tokens < 20:
        step = scheduler.schedule()
        assert step.kv_connector_metadata is not None and not step.kv_connector_metadata.loads
        saved.append(step.kv_connector_metadata.saves)
        scheduler.update_from_output(step, ModelRunnerOutput(sampled_token_ids={"a": [5]}))
    table = scheduler.block_manager.get_block_table("a")
    # chunks of 8 tokens: two blocks per step, and the prompt's last block with its last token
    assert saved == [list(zip(table[0:2], hashes[0:2])), list(zip(table[2:4], hashes[2:4])), [(table[4], hashes[4])]]
    scheduler.finish_sequences("a", SequenceStatus.FINISHED_ABORTED)
    # the same prompt again hits the local cache: nothing to offer
    scheduler.add_sequence(seq("b", PROMPT + [1, 2]))
    step = scheduler.schedule()
    assert step.kv_connector_metadata is not None and step.kv_connector_metadata.saves == []

    consumer = DictConnector(context("kv_consumer"))
    scheduler = make_scheduler(consumer)
    scheduler.add_sequence(seq("c", PROMPT))
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"c": 20}
    assert step.kv_connector_metadata is not None and step.kv_connector_metadata.saves == []


def test_requests_the_connector_cannot_serve_compute_everything():
    connector = DictConnector(context())
    scheduler = make_scheduler(connector)
    store_blocks(connector, scheduler, PROMPT, 4)
    scheduler.add_sequence(seq("logprobs", PROMPT, prompt_logprobs=1))
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"logprobs": 20}
    assert step.kv_connector_metadata is not None and step.kv_connector_metadata.loads == {}


def test_an_aborted_loading_request_keeps_its_blocks_until_the_loader_is_done():
    connector = DictConnector(context())
    scheduler = make_scheduler(connector, num_blocks=8)
    store_blocks(connector, scheduler, PROMPT, 4)
    scheduler.add_sequence(seq("a", PROMPT))
    step = scheduler.schedule()
    assert scheduler.block_manager.num_free_blocks == 4
    assert scheduler.finish_sequences("a", SequenceStatus.FINISHED_ABORTED)
    # the loader may still write them: held, and a new request with the same id waits
    assert scheduler.block_manager.num_free_blocks == 4
    assert scheduler.has_unfinished_sequences()
    scheduler.update_from_output(step, ModelRunnerOutput())
    scheduler.add_sequence(seq("a", list(range(300, 305))))
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.update_from_output(
        step, ModelRunnerOutput(kv_connector_output=KVConnectorOutput(finished_loads={"a": 4}))
    )
    assert scheduler.block_manager.num_free_blocks == 8
    assert scheduler.schedule().num_scheduled_tokens == {"a": 5}


def kv_caches(num_layers: int = 3, num_blocks: int = 6) -> list[torch.Tensor]:
    return [torch.zeros(2, num_blocks, BLOCK_SIZE, 2, 8) for _ in range(num_layers)]


def test_the_worker_saves_after_the_step_and_loads_on_its_thread_stopping_at_a_bad_block():
    stored: dict[bytes, torch.Tensor] = {}
    source = kv_caches()
    for layer, cache in enumerate(source):
        cache.copy_(torch.randn_like(cache) + layer)
    saver = KVConnectorWorker(DictConnector(context(), stored), source)
    saver.save_kv(KVConnectorMetadata(saves=[(1, b"a" * 32), (4, b"b" * 32), (2, b"c" * 32)]))
    saver.wait_for_save()
    for block_id, block_hash in [(1, b"a" * 32), (4, b"b" * 32), (2, b"c" * 32)]:
        expected = torch.stack([cache[:, block_id] for cache in source])
        assert torch.equal(stored[block_hash], expected)
    output = saver.get_finished()
    assert (output.num_blocks_stored, output.num_bytes_stored) == (3, 3 * source[0][:, 0].numel() * 3 * 4)

    loader_connector = DictConnector(context(), stored)
    loader_connector.corrupt.add(b"c" * 32)
    target = kv_caches()
    loader = KVConnectorWorker(loader_connector, target)
    loader.start_load_kv(
        KVConnectorMetadata(loads={"r": [(5, b"a" * 32), (0, b"b" * 32), (3, b"c" * 32), (1, b"a" * 32)]})
    )
    finished = KVConnectorOutput()
    while "r" not in finished.finished_loads:
        finished = loader.get_finished(wait=True)
    # the corrupt third block ends the run: two loaded, one failure, block 3 and 1 untouched
    assert (finished.finished_loads, finished.num_blocks_loaded, finished.num_load_failures) == ({"r": 2}, 2, 1)
    for layer in range(3):
        assert torch.equal(target[layer][:, 5], source[layer][:, 1])
        assert torch.equal(target[layer][:, 0], source[layer][:, 4])
        assert not target[layer][:, 3].any() and not target[layer][:, 1].any()
    loader.close()
    saver.close()
