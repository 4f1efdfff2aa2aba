"""KV-cache events (``--kv-events-config``): what the block manager records as its prefix cache
stores, evicts and clears, and the ZMQ publisher's wire format and replay, decoded with msgspec
structs that mirror vLLM's (``vllm/distributed/kv_events.py``)."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from tests.core.test_block_manager import decode, make_request, prefill
from tokenloom.core.block_manager import BlockManager
from tokenloom.core.config import KVEventsConfig
from tokenloom.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ZmqEventPublisher,
    offset_endpoint_port,
)
from tokenloom.errors import ConfigError

# -- vLLM's schema, as a subscriber declares it -------------------------------------------------


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def live_hashes(events, live=None) -> set:
    """The hashes a consumer believes cached after applying ``events`` in order."""
    live = set() if live is None else live
    for event in events:
        if isinstance(event, (BlockStored, VllmBlockStored)):
            assert not live & set(event.block_hashes), "a block was stored twice without a removal"
            live |= set(event.block_hashes)
        elif isinstance(event, (BlockRemoved, VllmBlockRemoved)):
            assert set(event.block_hashes) <= live, "a block was removed that was never stored"
            live -= set(event.block_hashes)
        else:
            live.clear()
    return live


# -- recording in the block manager -----------------------------------------------------------


def recording(num_blocks: int = 6, hash_algo: str = "sha256") -> BlockManager:
    return BlockManager(num_blocks, 4, True, hash_algo=hash_algo, enable_kv_cache_events=True)


@pytest.mark.parametrize("hash_algo", ["sha256", "builtin"])
def test_a_shared_prefix_is_stored_once_and_its_continuations_follow_it(hash_algo):
    manager = recording(hash_algo=hash_algo)
    first = make_request("first", [*range(8), 50, 51])
    prefill(manager, first)
    # full blocks are offered to the cache once computed: at the sequence's next allocation
    assert manager.take_kv_events() == []
    decode(manager, first, 52)
    (stored,) = manager.take_kv_events()
    assert stored == BlockStored(
        block_hashes=[manager._block_hash(first, 0), manager._block_hash(first, 1)],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=None,
    )
    assert manager.take_kv_events() == []  # drained

    second = make_request("second", [*range(8), 60, 61, 62, 63, 64])
    assert prefill(manager, second) == 8  # the shared two blocks are hits, not stored again
    manager.free(second)
    (continuation,) = manager.take_kv_events()
    assert continuation == BlockStored(
        block_hashes=[manager._block_hash(second, 2)],
        parent_block_hash=manager._block_hash(first, 1),
        token_ids=[60, 61, 62, 63],
        block_size=4,
        lora_id=None,
    )
    # a block filled by decoding is stored once computed
    decode(manager, first, 53)
    assert manager.take_kv_events() == []
    decode(manager, first, 54)  # tokens 0-11 computed: block 2 of first ([50, 51, 52, 53]) is full
    (decoded,) = manager.take_kv_events()
    assert decoded.token_ids == [50, 51, 52, 53] and decoded.parent_block_hash == manager._block_hash(first, 1)
    assert live_hashes([stored, continuation, decoded]) == manager.cached_block_hashes()


def test_eviction_removes_the_least_recently_freed_block_by_hash():
    manager = recording(num_blocks=3)
    old = make_request("old", range(100, 109))  # 2 full blocks + 1 token: all 3 blocks
    prefill(manager, old)
    manager.free(old)
    events = manager.take_kv_events()
    assert [type(event) for event in events] == [BlockStored]
    old_hashes = events[0].block_hashes
    # 3 blocks: the uncached free block first, then the two cached ones, the prefix's tail first
    new = make_request("new", range(9))
    prefill(manager, new)
    removed = [event for event in manager.take_kv_events() if isinstance(event, BlockRemoved)]
    assert removed == [BlockRemoved([old_hashes[1]]), BlockRemoved([old_hashes[0]])]
    assert not manager.cached_block_hashes() & set(old_hashes)
    assert live_hashes(events + manager.take_kv_events()) <= set(old_hashes) | manager.cached_block_hashes()


def test_reset_clears_all_and_a_block_in_use_is_not_stored_again():
    manager = recording(num_blocks=8)
    running = make_request("running", range(9))
    prefill(manager, running)
    decode(manager, running, 1)
    before = manager.take_kv_events()
    assert live_hashes(before) == manager.cached_block_hashes() and len(manager.cached_block_hashes()) == 2
    manager.reset_prefix_cache()
    assert manager.take_kv_events() == [AllBlocksCleared()]
    decode(manager, running, 2)
    decode(manager, running, 3)
    decode(manager, running, 4)  # its 3rd block is full and computed now
    manager.free(running)
    events = manager.take_kv_events()
    assert [event.token_ids for event in events] == [[8, 1, 2, 3]]
    assert events[0].parent_block_hash == manager._block_hash(running, 1)  # which a consumer no longer holds
    assert live_hashes(before + [AllBlocksCleared()] + events) == manager.cached_block_hashes()


def test_a_lora_requests_blocks_carry_its_adapter_id():
    from tokenloom.lora.request import LoRARequest

    manager = recording()
    request = make_request("lora", range(5))
    request.lora_request = LoRARequest("adapter", 7, "/nowhere")
    prefill(manager, request)
    manager.free(request)
    (stored,) = manager.take_kv_events()
    assert stored.lora_id == 7 and stored.token_ids == [0, 1, 2, 3]


def test_nothing_is_recorded_unless_asked():
    manager = BlockManager(6, 4, True)
    prefill(manager, make_request("a", range(9)))
    manager.reset_prefix_cache()
    assert manager.take_kv_events() == []


# -- the publisher --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_batches_decode_with_vllms_schema_and_the_replay_returns_missed_ones():
    pub_port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        buffer_steps=2,
        topic="kv",
    )
    publisher = ZmqEventPublisher(config, data_parallel_rank=0)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    dealer = context.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        stored = BlockStored([b"\x01" * 32], None, [1, 2, 3, 4], 4, None)
        # a PUB drops what it sends before the subscription arrives: publish until one lands
        for _ in range(100):
            publisher.publish([stored])
            try:
                topic, seq, payload = sub.recv_multipart()
                break
            except zmq.Again:
                continue
        else:
            pytest.fail("no batch reached the subscriber")
        assert topic == b"kv" and len(seq) == 8
        first = DECODER.decode(payload)
        assert first.data_parallel_rank == 0 and first.ts > 0
        assert first.events == [VllmBlockStored([b"\x01" * 32], None, [1, 2, 3, 4], 4, None, "GPU")]

        sub.setsockopt(zmq.RCVTIMEO, 5000)
        publisher.publish([BlockRemoved([b"\x01" * 32]), AllBlocksCleared()])
        _, last_seq, last_payload = sub.recv_multipart()
        assert int.from_bytes(last_seq, "big") == int.from_bytes(seq, "big") + 1
        assert DECODER.decode(last_payload).events == [VllmBlockRemoved([b"\x01" * 32], "GPU"), VllmAllBlocksCleared()]

        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", last_seq])
        assert dealer.recv_multipart() == [b"", last_seq, last_payload]
        assert dealer.recv_multipart() == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        # only buffer_steps batches are kept: asking from 0 returns the last two
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = [dealer.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(frames[1], "big", signed=True) for frames in replayed] == [
            int.from_bytes(last_seq, "big") - 1,
            int.from_bytes(last_seq, "big"),
            -1,
        ]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        publisher.shutdown()


def test_each_data_parallel_replica_publishes_on_its_own_port():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://10.0.0.1:6000", 1) == "tcp://10.0.0.1:6001"
    assert offset_endpoint_port("inproc://events", 1) == "inproc://events_dp1"
    with pytest.raises(ConfigError, match="no tcp port"):
        offset_endpoint_port("ipc:///tmp/events", 1)


def test_a_taken_port_is_a_start_up_error():
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    first = ZmqEventPublisher(config)
    try:
        with pytest.raises(ConfigError, match=f"--kv-events-config: cannot open tcp://\\*:{port}"):
            ZmqEventPublisher(config)
    finally:
        first.shutdown()


def consecutive_free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 all free now."""
    for _ in range(50):
        base = free_port()
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no run of free ports")


def replay_all(port: int) -> list[VllmKVEventBatch]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while (frames := dealer.recv_multipart())[1] != (-1).to_bytes(8, "big", signed=True):
            batches.append(DECODER.decode(frames[2]))
        return batches
    finally:
        dealer.close(linger=0)


def events_of(batches) -> list:
    return [event for batch in batches for event in batch.events]


def replay_until(port: int, done, timeout: float = 30.0) -> list[VllmKVEventBatch]:
    """The replayed batches, asked again until ``done(batches)`` (the publisher's thread sends
    a moment after the engine hands it a batch)."""
    deadline = time.monotonic() + timeout
    while not done(batches := replay_all(port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return batches


def test_an_engine_publishes_its_cache_with_its_data_parallel_rank_on_its_ports(tiny_llama_dir):
    """Replica 1 of -dp: its batches carry rank 1 and leave on the ports plus 1; replayed, they
    describe exactly the blocks its prefix cache holds, through a shared prefix and a reset."""
    from tokenloom import LLM, SamplingParams

    pub, replay = consecutive_free_ports(2), consecutive_free_ports(2)
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=4, kv_events_config=config, data_parallel_rank=1)
    publisher = llm.engine.kv_event_publisher
    block_manager = llm.engine.scheduler.block_manager
    try:
        assert (publisher.endpoint, publisher.replay_endpoint) == (f"tcp://*:{pub + 1}", f"tcp://*:{replay + 1}")
        params = SamplingParams(temperature=0, max_tokens=3)
        llm.generate(["A short story about a robot: it woke up", "A short story about a robot: it fell"], params)
        cached = block_manager.cached_block_hashes()
        # the publisher thread sends (and keeps) what the last step handed it a moment later
        batches = replay_until(replay + 1, lambda batches: live_hashes(events_of(batches)) == cached)
        events = events_of(batches)
        assert {batch.data_parallel_rank for batch in batches} == {1}
        assert cached and live_hashes(events) == cached
        llm.engine.reset_prefix_cache()
        cleared = replay_until(
            replay + 1, lambda batches: bool(batches) and batches[-1].events == [VllmAllBlocksCleared()]
        )
        assert cleared[-1].events == [VllmAllBlocksCleared()] and live_hashes(events_of(cleared)) == set()
    finally:
        llm.engine.shutdown()


def test_data_parallel_replicas_are_built_with_their_index_as_rank(monkeypatch):
    from tokenloom.core.config import EngineArgs
    from tokenloom.core.engine import data_parallel

    ranks = []

    class RecordingReplica:
        def __init__(self, index, engine_args, tables, cpu_ids):
            ranks.append((index, engine_args.data_parallel_rank, engine_args.data_parallel_size))

        def start(self, on_messages, on_death):
            raise RuntimeError("recorded")

        def stop(self, timeout):
            pass

    monkeypatch.setattr(data_parallel, "ProcessReplica", RecordingReplica)
    with pytest.raises(RuntimeError, match="recorded"):
        data_parallel.DataParallelAsyncLLM.from_engine_args(EngineArgs(data_parallel_size=3))
    assert ranks == [(0, 0, 1), (1, 1, 1), (2, 2, 1)]
