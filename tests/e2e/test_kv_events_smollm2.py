"""The real `tokenloom serve smollm2 --kv-events-config ...`, followed as llm-d or Dynamo follow
vLLM: a pyzmq SUB socket decodes every batch with msgspec structs mirroring vLLM's schema.
Shared-prefix chats on a small cache (so blocks are evicted), then POST /reset_prefix_cache: the
events describe the prompts' blocks as the engine caches them, the blocks evicted, and the clear;
the replay socket sends missed batches again by sequence number; bad settings fail start-up in
one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import zmq

from tests.core.test_kv_events import DECODER, VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored, live_hashes
from tests.e2e.conftest import REPO_ROOT, free_port, start_server, stop_server

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NUM_BLOCKS = 24
TOPIC = b"kv@tokenloom"
# two system prompts of about ten blocks each: chats under one share its blocks, and the two
# families with their continuations need more than NUM_BLOCKS, so older blocks are evicted
SYSTEMS = [
    "You are a patient museum guide. " + "You describe paintings, sculptures and their history in detail. " * 14,
    "You are a terse ship's navigator. " + "You report headings, tides, winds and the stars you steer by. " * 14,
]
QUESTIONS = ["Who are you?", "What do you see?", "Where are we going?"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """A SUB socket on the server's events and a DEALER on its replay socket."""

    def __init__(self, pub_port: int, replay_port: int):
        context = zmq.Context.instance()
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(f"tcp://127.0.0.1:{pub_port}")
        self.replay = context.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.RCVTIMEO, 10_000)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.received: dict[int, bytes] = {}  # seq -> payload, as it came over the SUB socket

    def drain(self, quiet_seconds: float = 1.5) -> None:
        """Receive until nothing has come for ``quiet_seconds``."""
        while self.sub.poll(int(quiet_seconds * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC
            self.received[int.from_bytes(seq, "big")] = payload

    def replay_from(self, start: int) -> dict[int, bytes]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        replayed: dict[int, bytes] = {}
        while True:
            empty, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                return replayed
            replayed[int.from_bytes(seq, "big")] = payload

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


@pytest.fixture(scope="module")
def events_server(tmp_path_factory):
    pub_port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC.decode(),
    }
    log_path = str(tmp_path_factory.mktemp("server") / "serve.log")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_SERVER_DEV_MODE", "1")  # vLLM's switch for /reset_prefix_cache
        server = start_server(
            [
                "smollm2",
                "--max-model-len",
                "384",
                "--num-gpu-blocks-override",
                str(NUM_BLOCKS),
                "--enable-prefix-caching",
                "--kv-events-config",
                json.dumps(config),
            ],
            log_path,
            timeout=600.0,
        )
    subscriber = Subscriber(pub_port, replay_port)
    yield server, subscriber
    subscriber.close()
    stop_server(server)


def chain_of(prompt: list[int], stored: dict) -> list:
    """The hashes of the prompt's full blocks, found by following the stored events' parent
    links from the root with the prompt's own tokens (vLLM's consumers match prefixes so)."""
    hashes: list = []
    for start in range(0, len(prompt) - len(prompt) % BLOCK_SIZE, BLOCK_SIZE):
        tokens = prompt[start : start + BLOCK_SIZE]
        parent = hashes[-1] if hashes else None
        matches = [
            block
            for block, (block_parent, block_tokens) in stored.items()
            if (block_parent, block_tokens) == (parent, tokens)
        ]
        assert len(matches) == 1, f"block {start // BLOCK_SIZE} of the prompt: {len(matches)} stored blocks match"
        hashes.append(matches[0])
    return hashes


def test_events_follow_the_prefix_cache_through_evictions_and_a_reset(events_server):
    server, subscriber = events_server
    time.sleep(0.5)  # the subscription reaches the PUB socket (anything missed comes by replay below)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    prompts = []
    for question in QUESTIONS:
        for system in SYSTEMS:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0.0)
            tokenized = httpx.post(server.base_url + "/tokenize", json={"model": "smollm2", "messages": messages})
            prompts.append(tokenized.json()["tokens"])
    subscriber.drain()

    # the replay socket sends every kept batch again from a sequence number, byte for byte;
    # batches the SUB socket missed (before the subscription took) come from it
    replayed = subscriber.replay_from(0)
    assert replayed and sorted(replayed) == list(range(len(replayed)))
    assert all(replayed[seq] == payload for seq, payload in subscriber.received.items())
    assert subscriber.replay_from(len(replayed) - 1) == {len(replayed) - 1: replayed[len(replayed) - 1]}
    batches = [DECODER.decode(replayed[seq]) for seq in sorted(replayed)]
    assert all(batch.data_parallel_rank == 0 for batch in batches)
    events = [event for batch in batches for event in batch.events]

    stored_events = [event for event in events if isinstance(event, VllmBlockStored)]
    assert stored_events and all(isinstance(event, (VllmBlockStored, VllmBlockRemoved)) for event in events)
    for event in stored_events:
        assert (event.block_size, event.lora_id, event.medium) == (BLOCK_SIZE, None, "GPU")
        assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
        assert all(isinstance(block_hash, bytes) and len(block_hash) == 32 for block_hash in event.block_hashes)
    assert any(isinstance(event, VllmBlockRemoved) for event in events), "the small cache evicted nothing"

    # every block is stored once while live, removed only while live (live_hashes checks both),
    # and the cache never holds more blocks than it has
    live = live_hashes(events)
    assert 0 < len(live) <= NUM_BLOCKS
    stored: dict = {}
    for event in stored_events:
        parent = event.parent_block_hash
        for index, block_hash in enumerate(event.block_hashes):
            stored[block_hash] = (parent, event.token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            parent = block_hash
    # the last chat's prompt is cached whole (its full blocks), and its system prompt's blocks
    # are the ones the other chat under that system prompt stored: a shared prefix is stored once
    last = chain_of(prompts[-1], stored)
    assert len(last) == len(prompts[-1]) // BLOCK_SIZE and set(last) <= live
    shared = chain_of(prompts[-3], stored)
    common = next(i for i, (a, b) in enumerate(zip(prompts[-1], prompts[-3], strict=False)) if a != b) // BLOCK_SIZE
    assert common >= 8 and last[:common] == shared[:common]
    # the first family's blocks were evicted by the time the last chat ran, or are still live
    assert set(stored) - live, "nothing stored was evicted"

    reset = httpx.post(server.base_url + "/reset_prefix_cache")
    assert reset.status_code == 200
    before = max(subscriber.received, default=-1)
    subscriber.drain()
    after = [DECODER.decode(subscriber.received[seq]) for seq in sorted(subscriber.received) if seq > before]
    assert [batch.events for batch in after] == [[VllmAllBlocksCleared()]]
    assert live_hashes(events + after[0].events) == set()


def test_an_unknown_publisher_fails_start_up_in_one_line():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenloom",
            "serve",
            "smollm2",
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "publisher": "kafka"}',
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
        timeout=120,
    )
    output = result.stderr + result.stdout
    assert result.returncode != 0 and "Traceback" not in output
    assert "--kv-events-config: publisher 'kafka' is not implemented; use one of null, zmq" in output
    assert len([line for line in output.splitlines() if "--kv-events-config" in line]) == 1, output
