"""KV-cache events (``--kv-events-config``): what the prefix cache stored, evicted and cleared,
and the publisher that sends them out as vLLM does, so routers that place requests by prefix
cache (llm-d, the Gateway API Inference Extension, Dynamo) can follow a tokenloom engine.

The :class:`~tokenloom.core.block_manager.BlockManager` records events as plain values; the
engine drains them once per step into one batch and hands the batch to a publisher. The ZMQ
publisher encodes and sends on its own thread: the step loop only puts the batch on a bounded
queue and never waits on a socket.

Wire format (vLLM's ``vllm/distributed/kv_events.py``, msgspec structs with ``array_like`` and
``tag``): a multipart message ``[topic, seq, payload]`` where ``seq`` is the batch's 8-byte
big-endian sequence number and ``payload`` the msgpack array ``[ts, [event, ...], dp_rank]``.
Each event is an array that starts with its tag: ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]``, ``["BlockRemoved",
block_hashes, medium]``, ``["AllBlocksCleared"]``. Block hashes are the prefix cache's own:
32-byte sha256 digests (msgpack bin) or, with ``--prefix-caching-hash-algo builtin``, integers.

Replay: a DEALER (or REQ) client sends ``[b"", start_seq]`` (8 bytes, big-endian) to the ROUTER
at ``replay_endpoint`` and gets back ``[b"", seq, payload]`` for every kept batch from
``start_seq`` on, then ``[b"", -1 (8 bytes, signed), b""]``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from tokenloom.core.config import KVEventsConfig
from tokenloom.errors import ConfigError

logger = logging.getLogger(__name__)

# vLLM's medium for blocks in the engine's own KV cache (its CPU backend reports it too); a
# consumer that keys blocks by medium then treats tokenloom's blocks like any engine's
MEDIUM = "GPU"
# the end-of-replay marker's sequence number
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)
# how long the publisher thread waits for a batch before looking at the replay socket again
POLL_SECONDS = 0.02


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered the prefix cache: their hashes in token
    order, the hash of the cached block they follow (None: they start the sequence), their
    tokens (``block_size`` per block), and the LoRA adapter's id they were computed with."""

    block_hashes: list[Hashable]
    parent_block_hash: Hashable | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None

    def to_wire(self) -> list[Any]:
        return [
            "BlockStored",
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            MEDIUM,
        ]


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache: their content can no longer be hit."""

    block_hashes: list[Hashable]

    def to_wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, MEDIUM]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was forgotten (a prefix-cache reset)."""

    def to_wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventPublisher(Protocol):
    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one step's events as one batch, without blocking the caller."""

    def shutdown(self) -> None: ...


def build_event_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> EventPublisher | None:
    """The publisher ``--kv-events-config`` names, or None when no events are published."""
    if not config.publishes:
        return None
    return ZmqEventPublisher(config, data_parallel_rank)


def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of data-parallel replica ``data_parallel_rank`` (vLLM's rule): a tcp port
    plus the rank, an inproc name with ``_dp<rank>`` appended; rank 0 keeps it as given."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    host, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit():
        return f"{host}:{int(port) + data_parallel_rank}"
    raise ConfigError(
        f"--kv-events-config: with -dp every replica needs its own endpoint, and {endpoint!r} has no "
        "tcp port (tcp://host:port) or inproc name to offset by the replica's rank",
        param="kv-events-config",
    )


class ZmqEventPublisher:
    """A ZMQ PUB socket (and, with ``replay_endpoint``, a ROUTER for replays) served by one
    thread; the last ``buffer_steps`` encoded batches are kept for replay."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        try:
            import msgspec
            import zmq
        except ImportError as exc:
            raise ConfigError(
                f"--kv-events-config: the zmq publisher needs pyzmq and msgspec ({exc}): "
                "pip install 'tokenloom[kv-events]'",
                param="kv-events-config",
            ) from None
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (
            None if config.replay_endpoint is None else offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
        )
        self._topic = config.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._batches: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._num_dropped = 0
        # the sockets are made (and bound, so a taken port fails start-up) here, then used only
        # by the publisher thread
        self._context: Any = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: Any = None
        try:
            self._pub.set_hwm(config.hwm)
            if self._binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(
                f"--kv-events-config: cannot open {self.endpoint} or {self.replay_endpoint}: {exc}",
                param="kv-events-config",
            ) from None
        self._thread = threading.Thread(target=self._serve, name="tokenloom-kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "publishing KV-cache events on %s (replay: %s, data-parallel rank %d)",
            self.endpoint,
            self.replay_endpoint or "off",
            data_parallel_rank,
        )

    @staticmethod
    def _binds(endpoint: str) -> bool:
        """vLLM's rule: a wildcard or local transport is bound, a concrete address connected to."""
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))

    def publish(self, events: list[KVCacheEvent]) -> None:
        try:
            self._batches.put_nowait((time.time(), events))
        except queue.Full:
            self._num_dropped += 1
            if self._num_dropped & (self._num_dropped - 1) == 0:  # 1, 2, 4, 8 ...: logged, not flooded
                logger.warning("KV-cache events: the publisher queue is full; %d batches dropped", self._num_dropped)

    def shutdown(self) -> None:
        self._batches.put(None)
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except Exception:
                    logger.exception("KV-cache events: a replay request failed")
            try:
                item = self._batches.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if item is None:
                break
            ts, events = item
            payload = self._encoder.encode([ts, [event.to_wire() for event in events], self.data_parallel_rank])
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload))
            except Exception:
                logger.exception("KV-cache events: batch %d could not be sent", seq)
            self._sent.append((seq, payload))
            seq += 1
        self._close_sockets()

    def _answer_replay(self) -> None:
        assert self._replay is not None  # only called when replay is on
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV-cache events: ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._sent):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", REPLAY_END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
