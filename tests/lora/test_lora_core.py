"""What LoRA changes in the core: the scheduler never runs more distinct adapters than
``max_loras`` at once (and still finishes everything, in order), and prefix-cache blocks are
keyed by adapter: two adapters never share KV, the same adapter does."""

from __future__ import annotations

import pytest

from tests.core.test_block_manager import collide_every_hash, prefill
from tests.core.test_block_manager import make_request as make_plain_request
from tests.core.test_scheduler import FakeWorker, expected_tokens, make_request, run
from tokenloom.core.block_manager import BlockManager
from tokenloom.core.config import CacheConfig, SchedulerConfig
from tokenloom.core.scheduler import Scheduler
from tokenloom.lora.request import LoRARequest

ADAPTERS = [LoRARequest(f"adapter-{index}", index, f"/adapters/{index}") for index in (1, 2, 3)]


def make_scheduler(max_loras: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(), CacheConfig(block_size=4), num_blocks=64, max_model_len=256, max_loras=max_loras
    )


def with_lora(request, lora_request):
    request.lora_request = lora_request
    return request


def test_scheduler_runs_at_most_max_loras_distinct_adapters_per_step():
    scheduler = make_scheduler(max_loras=2)
    requests = []
    for index in range(9):
        lora = None if index % 4 == 3 else ADAPTERS[index % 3]
        requests.append(with_lora(make_request(f"r{index}", [5 + index, 6, 7], max_tokens=6), lora))
    scheduler.add_sequences(requests[:1])
    for request in requests[1:]:
        scheduler.add_sequence(request)
    worker = FakeWorker(num_blocks=64, block_size=4)
    log = run(scheduler, worker)
    by_id = {request.seq_id: request for request in requests}
    for output in log.outputs:
        adapters_in_step = {
            by_id[req_id].lora_request.lora_int_id
            for req_id in output.num_scheduled_tokens
            if by_id[req_id].lora_request is not None
        }
        assert len(adapters_in_step) <= 2
    assert set(log.finished) == set(by_id)
    for request in requests:
        assert log.finished[request.seq_id].output_token_ids == expected_tokens(request.prompt_token_ids, 6)
    # the third adapter had to wait for a slot: some step ran without it although it was queued
    assert any(len(output.scheduled_new_reqs) < len(output.num_scheduled_tokens) for output in log.outputs)


def test_scheduler_reports_running_and_waiting_adapters():
    scheduler = make_scheduler(max_loras=1)
    scheduler.add_sequence(with_lora(make_request("a", [1, 2, 3]), ADAPTERS[0]))
    scheduler.add_sequence(with_lora(make_request("b", [1, 2, 3]), ADAPTERS[1]))
    scheduler.add_sequence(make_request("base", [1, 2, 3]))
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["a"]  # b waits for the slot, and base behind it
    assert [new.lora_request for new in output.scheduled_new_reqs] == [ADAPTERS[0]]
    assert scheduler.running_lora_ids() == {1}
    assert scheduler.waiting_lora_ids() == {2}


def computed_then_freed(manager, request) -> int:
    num_cached = prefill(manager, request)
    manager.free(request)
    return num_cached


@pytest.mark.parametrize("hash_algo", ["sha256", "builtin"])
def test_prefix_cache_blocks_are_keyed_by_adapter(hash_algo):
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True, hash_algo=hash_algo)
    prompt = list(range(10, 23))
    assert computed_then_freed(manager, with_lora(make_plain_request("a1", prompt), ADAPTERS[0])) == 0
    # another adapter, and the base model: the same tokens give other K/V, nothing is shared
    assert computed_then_freed(manager, with_lora(make_plain_request("b1", prompt), ADAPTERS[1])) == 0
    assert computed_then_freed(manager, make_plain_request("base", prompt)) == 0
    # the same adapter (by id) again: its own blocks are hits
    same = LoRARequest("adapter-1", 1, "/adapters/1")
    assert computed_then_freed(manager, with_lora(make_plain_request("a2", prompt), same)) == 12
    assert computed_then_freed(manager, make_plain_request("base2", prompt)) == 12


def test_a_hash_collision_across_adapters_is_refused():
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True, hash_algo="builtin")
    collide_every_hash(manager, lambda parent, token_ids: hash(token_ids))  # the adapter does not reach the hash
    prompt = list(range(10, 23))
    computed_then_freed(manager, with_lora(make_plain_request("a1", prompt), ADAPTERS[0]))
    assert manager.get_computed_blocks(with_lora(make_plain_request("b1", prompt), ADAPTERS[1])) == ([], 0)
