"""BlockManager: allocation and ref counts, prefix-cache hits over full blocks, the hit cap,
LRU eviction of cached free blocks, stats, and the all-blocks-free invariant under random use."""

from __future__ import annotations

import random

import pytest

from tokenloom.core.block_manager import BlockManager
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import EngineSequence
from tokenloom.errors import ConfigError


def make_request(request_id: str, prompt: list[int]) -> EngineSequence:
    return EngineSequence(seq_id=request_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams())


def prefill(manager: BlockManager, request: EngineSequence, use_cache: bool = True) -> int:
    """Allocate the whole (uncached part of the) sequence as a scheduler would, then mark it
    computed; returns the number of tokens the prefix cache supplied."""
    computed_blocks, num_cached = manager.get_computed_blocks(request) if use_cache else (None, 0)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_cached, computed_blocks)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return num_cached


def decode(manager: BlockManager, request: EngineSequence, token_id: int) -> list[int] | None:
    """One decode step: the sampled token joins the sequence and gets a KV slot."""
    request.output_token_ids.append(token_id)
    new_blocks = manager.allocate_slots(request, 1)
    if new_blocks is not None:
        request.num_computed_tokens += 1
    return new_blocks


def assert_all_free(manager: BlockManager) -> None:
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.usage == 0.0
    assert all(manager.ref_count(block_id) == 0 for block_id in range(manager.num_blocks))


def test_allocate_grows_the_table_and_free_returns_every_block():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    request = make_request("a", range(10))
    assert manager.allocate_slots(request, 10) == [0, 1, 2]
    assert manager.get_block_table("a") == [0, 1, 2]
    assert manager.num_free_blocks == 5
    assert manager.usage == pytest.approx(3 / 8)
    assert [manager.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    request.num_computed_tokens = 10

    assert decode(manager, request, 100) == []  # token 11 fits block 2
    assert decode(manager, request, 101) == []  # token 12 fills it
    assert decode(manager, request, 102) == [3]  # token 13 needs a new block
    assert manager.get_block_table("a") == [0, 1, 2, 3]

    manager.free(request)
    assert manager.get_block_table("a") == []
    assert_all_free(manager)


def test_allocation_failure_allocates_nothing():
    manager = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    holder = make_request("holder", range(8))
    assert manager.allocate_slots(holder, 8) == [0, 1]
    big = make_request("big", range(100, 109))
    assert manager.allocate_slots(big, 9) is None
    assert manager.num_free_blocks == 1
    assert manager.get_block_table("big") == []
    assert manager.prefix_cache_stats.queries == 0
    manager.free(big)  # freeing a request that holds nothing is harmless
    assert manager.num_free_blocks == 1


def test_full_blocks_are_shared_and_ref_counted():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("first", range(14))  # blocks: 3 full + 2 tokens
    assert prefill(manager, first) == 0
    first_table = manager.get_block_table("first")
    # blocks are cached once their KV is computed; the next step's allocation registers them
    assert decode(manager, first, 500) == []
    assert manager.num_cached_blocks == 3

    second = make_request("second", list(range(12)) + [77, 78])
    computed_blocks, num_cached = manager.get_computed_blocks(second)
    assert computed_blocks == first_table[:3]
    assert num_cached == 12
    new_blocks = manager.allocate_slots(second, second.num_tokens - num_cached, computed_blocks)
    assert len(new_blocks) == 1 and new_blocks[0] not in first_table
    assert [manager.ref_count(b) for b in first_table] == [2, 2, 2, 1]

    manager.free(first)
    assert [manager.ref_count(b) for b in first_table] == [1, 1, 1, 0]
    manager.free(second)
    assert_all_free(manager)
    assert manager.num_cached_blocks == 3  # free, but still reusable by hash


def test_partial_blocks_are_not_shared():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("first", range(6))  # one full block, one holding 2 tokens
    prefill(manager, first)
    manager.free(first)
    assert manager.num_cached_blocks == 1

    second = make_request("second", list(range(6)) + [40, 41, 42])
    computed_blocks, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 4
    assert len(computed_blocks) == 1


def test_a_block_only_hits_after_the_same_prefix():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(manager, first)
    manager.free(first)
    # the second block's tokens match, but the first block's do not: the chain breaks at once
    other = make_request("other", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert manager.get_computed_blocks(other) == ([], 0)


def test_hit_is_capped_so_the_last_token_is_recomputed():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("first", range(8))
    prefill(manager, first)
    manager.free(first)
    assert manager.num_cached_blocks == 2

    same = make_request("same", range(8))
    computed_blocks, num_cached = manager.get_computed_blocks(same)
    assert num_cached == 4  # (8 - 1) rounded down to a block
    assert len(computed_blocks) == 1
    longer = make_request("longer", range(9))
    assert manager.get_computed_blocks(longer)[1] == 8


def test_generated_tokens_are_cached_too():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("first", [5, 6, 7])
    prefill(manager, first)
    for token_id in (8, 9, 10, 11, 12):
        assert decode(manager, first, token_id) is not None
    manager.free(first)
    assert first.all_token_ids == [5, 6, 7, 8, 9, 10, 11, 12]
    follow_up = make_request("follow-up", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert manager.get_computed_blocks(follow_up)[1] == 8


def test_uncomputed_blocks_are_not_cached():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("first", range(12))
    assert manager.allocate_slots(first, 12) is not None
    # allocated but not computed yet (the worker writes it this step): nothing to hit
    twin = make_request("twin", range(13))
    assert manager.get_computed_blocks(twin) == ([], 0)
    first.num_computed_tokens = 6  # a chunk of 6 computed: only the first block is complete
    manager.free(first)
    assert manager.get_computed_blocks(twin)[1] == 4


def test_eviction_reuses_uncached_blocks_first_then_least_recently_freed():
    manager = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    requests = {
        name: make_request(name, [base, base + 1, base + 2]) for name, base in (("a", 10), ("b", 20), ("c", 30))
    }
    for request in requests.values():
        prefill(manager, request)
    for name in ("a", "b", "c"):
        manager.free(requests[name])
    # each request left one cached full block and one uncached partial block
    assert manager.num_cached_blocks == 3
    assert manager.num_free_blocks == 6

    def hits() -> tuple[int, ...]:
        return tuple(
            manager.get_computed_blocks(make_request(f"probe-{base}", [base, base + 1, base + 2]))[1]
            for base in (10, 20, 30)
        )

    # a hit on a free cached block takes it out of the LRU queue; freeing it again makes it
    # the most recently freed
    again_a = make_request("again-a", [10, 11, 12])
    computed_blocks, _ = manager.get_computed_blocks(again_a)
    assert manager.allocate_slots(again_a, 1, computed_blocks) == [manager.get_block_table("again-a")[1]]
    assert manager.num_free_blocks == 4
    manager.free(again_a)

    filler = make_request("filler", range(90, 96))
    assert manager.allocate_slots(filler, 6) is not None  # the 3 uncached blocks: nothing lost
    assert hits() == (2, 2, 2)
    assert manager.allocate_slots(make_request("evict-1", [70]), 1) is not None
    assert hits() == (2, 0, 2)  # b: the least recently freed
    assert manager.allocate_slots(make_request("evict-2", [71]), 1) is not None
    assert hits() == (2, 0, 0)
    assert manager.allocate_slots(make_request("evict-3", [72]), 1) is not None
    assert hits() == (0, 0, 0)
    assert manager.num_free_blocks == 0
    assert manager.num_cached_blocks == 0


def test_a_free_hit_counts_against_the_free_pool():
    manager = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    first = make_request("first", [1, 2, 3])
    prefill(manager, first)
    manager.free(first)
    holder = make_request("holder", [9, 9])
    manager.allocate_slots(holder, 2)
    # 2 blocks free, one of them the cached hit; 2 new ones are needed besides the hit
    second = make_request("second", [1, 2, 3, 4, 5])
    computed_blocks, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 2
    assert manager.allocate_slots(second, 3, computed_blocks) is None
    assert manager.num_free_blocks == 2
    assert manager.get_computed_blocks(second)[1] == 2  # the failed attempt evicted nothing


def test_prefix_cache_stats_count_tokens_of_used_lookups():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("first", range(10))
    prefill(manager, first)
    manager.free(first)
    second = make_request("second", range(10))
    assert prefill(manager, second) == 8
    assert manager.prefix_cache_stats.queries == 20
    assert manager.prefix_cache_stats.hits == 8
    assert manager.prefix_cache_stats.hit_rate == pytest.approx(0.4)
    # an allocation without a lookup (prompt logprobs) is not a query
    prefill(manager, make_request("third", range(10)), use_cache=False)
    assert manager.prefix_cache_stats.queries == 20


def test_prefix_caching_disabled_never_hits():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    first = make_request("first", range(12))
    prefill(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(make_request("second", range(12))) == ([], 0)
    assert manager.num_cached_blocks == 0
    assert manager.prefix_cache_stats.queries == 0


def test_reset_prefix_cache_drops_every_hash():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    running = make_request("running", range(9))
    prefill(manager, running)
    done = make_request("done", range(100, 109))
    prefill(manager, done)
    manager.free(done)
    decode(manager, running, 1)
    assert manager.num_cached_blocks == 4
    manager.reset_prefix_cache()
    assert manager.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_request("x", range(9))) == ([], 0)
    assert manager.get_computed_blocks(make_request("y", range(100, 109))) == ([], 0)
    manager.free(running)
    assert_all_free(manager)


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256"])
def test_hash_algorithms_give_hits(hash_algo):
    manager = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True, hash_algo=hash_algo)
    first = make_request("first", [3, 1, 4, 1, 5])
    prefill(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(make_request("second", [3, 1, 4, 1, 9]))[1] == 4
    assert manager.get_computed_blocks(make_request("third", [3, 1, 4, 2, 5]))[1] == 2


def test_bad_construction_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="at least one block"):
        BlockManager(0, 16, True)
    with pytest.raises(ConfigError, match="block-size"):
        BlockManager(4, 0, True)
    with pytest.raises(ConfigError, match="sha256"):
        BlockManager(4, 16, True, hash_algo="md5")


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_leaves_every_block_free(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    manager = BlockManager(
        num_blocks=rng.randint(6, 24), block_size=block_size, enable_prefix_caching=rng.random() < 0.8
    )
    # few distinct prefixes, so requests share blocks often
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    live: dict[str, EngineSequence] = {}
    for step in range(300):
        action = rng.random()
        if action < 0.3 and len(live) < 8:
            prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
            request = make_request(f"r{step}", prompt)
            computed_blocks, num_cached = manager.get_computed_blocks(request)
            assert num_cached <= request.num_tokens - 1
            chunk = rng.randint(1, request.num_tokens - num_cached)
            if manager.allocate_slots(request, chunk, computed_blocks) is None:
                manager.free(request)
                continue
            request.num_computed_tokens = num_cached + chunk
            live[request.seq_id] = request
        elif action < 0.85 and live:
            request = live[rng.choice(sorted(live))]
            if request.num_computed_tokens == request.num_tokens:
                request.output_token_ids.append(rng.randrange(5))
            num_new = rng.randint(1, request.num_tokens - request.num_computed_tokens)
            if manager.allocate_slots(request, num_new) is not None:
                request.num_computed_tokens += num_new
        elif live:
            manager.free(live.pop(rng.choice(sorted(live))))  # finish or abort
        # every block's ref count is the number of tables holding it
        holders = [0] * manager.num_blocks
        for request_id in live:
            table = manager.get_block_table(request_id)
            assert len(set(table)) == len(table)
            for block_id in table:
                holders[block_id] += 1
        assert holders == [manager.ref_count(b) for b in range(manager.num_blocks)]
        assert manager.num_free_blocks == holders.count(0)
    for request in list(live.values()):
        manager.free(request)
    assert_all_free(manager)


# ---- isolation: cache_salt, sha256 by default, hits checked against content -----------------


def salted_request(request_id: str, prompt: list[int], cache_salt: str | None) -> EngineSequence:
    return EngineSequence(
        seq_id=request_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(cache_salt=cache_salt)
    )


def test_sha256_is_the_default_hash():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    assert manager.hash_algo == "sha256"
    request = make_request("a", [1, 2, 3])
    prefill(manager, request)
    manager.free(request)
    [block_hash] = [h for h in manager._block_by_hash]
    assert isinstance(block_hash, bytes) and len(block_hash) == 32


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256"])
def test_requests_with_different_salts_never_share_blocks(hash_algo):
    manager = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True, hash_algo=hash_algo)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    first = salted_request("first", prompt, "tenant-a")
    prefill(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(salted_request("other-salt", prompt, "tenant-b")) == ([], 0)
    assert manager.get_computed_blocks(salted_request("unsalted", prompt, None)) == ([], 0)
    assert manager.get_computed_blocks(salted_request("same-salt", prompt, "tenant-a"))[1] == 6
    # and an unsalted prefix is not visible to a salted request either
    unsalted = salted_request("unsalted-2", [7, 7, 7, 7, 7], None)
    prefill(manager, unsalted)
    manager.free(unsalted)
    assert manager.get_computed_blocks(salted_request("salted", [7, 7, 7, 7, 7], "tenant-a")) == ([], 0)
    assert manager.get_computed_blocks(salted_request("unsalted-3", [7, 7, 7, 7, 7], None))[1] == 4


def collide_every_hash(manager: BlockManager, hash_function) -> None:
    """Replace the block hash, so that tests can craft the collisions a weak hash allows."""
    manager._hash_block = hash_function
    manager._root_hash = lambda request: 0


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256"])
def test_a_colliding_hash_never_serves_other_content(hash_algo):
    manager = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True, hash_algo=hash_algo)
    collide_every_hash(manager, lambda parent, token_ids: 0)  # every block has the same hash
    victim = make_request("victim", [1, 2, 3, 4, 5])
    prefill(manager, victim)
    manager.free(victim)
    attacker = make_request("attacker", [8, 9, 3, 4, 5])
    assert manager.get_computed_blocks(attacker) == ([], 0)
    assert manager.prefix_cache_stats.collisions == 1
    # the honest repeat of the victim's prompt still hits its own first block
    assert manager.get_computed_blocks(make_request("repeat", [1, 2, 3, 4, 5]))[1] == 2


def test_a_colliding_chain_never_serves_a_block_computed_after_another_prefix():
    manager = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True, hash_algo="builtin")
    # a hash blind to the prefix: block (3, 4) hashes the same whatever precedes it
    collide_every_hash(manager, lambda parent, token_ids: hash(token_ids))
    victim = make_request("victim", [1, 2, 3, 4, 5])
    prefill(manager, victim)
    manager.free(victim)
    other = make_request("other", [8, 9, 0])
    prefill(manager, other)
    other_first_block = manager.get_block_table("other")[0]
    manager.free(other)
    # [8, 9] hits the other request's block; [3, 4] after it must not hit the victim's block,
    # whose KV was computed after [1, 2]
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(make_request("probe", [8, 9, 3, 4, 5]))
    assert (hit_blocks, num_hit_tokens) == ([other_first_block], 2)
    assert manager.prefix_cache_stats.collisions == 1


def test_a_salted_collision_is_refused_too():
    manager = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True, hash_algo="builtin")
    collide_every_hash(manager, lambda parent, token_ids: hash(token_ids))  # the salt does not reach the hash
    first = salted_request("first", [1, 2, 3], "tenant-a")
    prefill(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(salted_request("second", [1, 2, 3], "tenant-b")) == ([], 0)


def test_cache_salt_is_validated():
    from tokenloom.errors import InvalidRequestError

    for bad_salt in ("", "\ud800", "x" * 5000):
        with pytest.raises(InvalidRequestError) as error:
            SamplingParams(cache_salt=bad_salt)
        assert error.value.param == "cache_salt"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("weak_hash", [False, True])
def test_every_hit_holds_exactly_the_requests_prefix(seed, weak_hash):
    """Random requests (three salts, few distinct tokens) with the real hash or a hash that
    collides all the time: every prefix hit is a block whose KV was computed for exactly the
    request's salt and tokens up to the end of that block."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    manager = BlockManager(
        num_blocks=rng.randint(8, 24),
        block_size=block_size,
        enable_prefix_caching=True,
        hash_algo=rng.choice(["builtin", "sha256"]),
    )
    if weak_hash:
        collide_every_hash(manager, lambda parent, token_ids: sum(token_ids) % 3)
    # what each block's KV was computed for: (salt, all tokens up to the end of the block)
    written: dict[int, tuple] = {}
    live: dict[str, EngineSequence] = {}
    num_hits = 0

    def record_writes(request: EngineSequence, first_new_block: int) -> None:
        table = manager.get_block_table(request.seq_id)
        for block_index in range(first_new_block, request.num_computed_tokens // block_size):
            written[table[block_index]] = (
                request.sampling_params.cache_salt,
                tuple(request.all_token_ids[: (block_index + 1) * block_size]),
            )

    for step in range(300):
        if rng.random() < 0.5 and len(live) < 6:
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 10))]
            request = salted_request(f"r{step}", prompt, rng.choice([None, "a", "b"]))
            hit_blocks, num_cached = manager.get_computed_blocks(request)
            for block_index, block_id in enumerate(hit_blocks):
                assert written[block_id] == (
                    request.sampling_params.cache_salt,
                    tuple(request.all_token_ids[: (block_index + 1) * block_size]),
                )
            num_hits += len(hit_blocks)
            if manager.allocate_slots(request, request.num_tokens - num_cached, hit_blocks) is None:
                manager.free(request)
                continue
            written_before = request.num_computed_tokens = num_cached
            request.num_computed_tokens = request.num_tokens
            record_writes(request, written_before // block_size)
            live[request.seq_id] = request
        elif live and rng.random() < 0.6:
            request = live[rng.choice(sorted(live))]
            request.output_token_ids.append(rng.randrange(3))
            if manager.allocate_slots(request, 1) is not None:
                first_new_block = request.num_computed_tokens // block_size
                request.num_computed_tokens += 1
                record_writes(request, first_new_block)
            else:
                request.output_token_ids.pop()
        elif live:
            manager.free(live.pop(rng.choice(sorted(live))))
    for request in list(live.values()):
        manager.free(request)
    assert_all_free(manager)
    if not weak_hash:
        assert num_hits > 0  # the check does not simply refuse every hit


@pytest.mark.parametrize("hash_algo", ["sha256", "builtin"])
def test_blocks_over_an_image_are_keyed_by_its_hash(hash_algo):
    from tokenloom.core.multimodal.inputs import MultiModalItem

    manager = BlockManager(16, 4, True, hash_algo=hash_algo, enable_kv_cache_events=True)
    prompt = [5, 6, 7, 8, 9, 9, 9, 9, 10, 11, 12, 13, 14]  # the image's placeholders at 4..7

    def with_image(request_id: str, image_hash: str) -> EngineSequence:
        request = make_request(request_id, prompt)
        request.mm_items = [MultiModalItem("image", image_hash, 4, 4)]
        return request

    first = with_image("a", "11" * 32)
    assert prefill(manager, first) == 0
    decode(manager, first, 15)  # the computed blocks are registered as the sequence moves on
    stored = manager.take_kv_events()
    # the events carry the blocks' tokens, without the image's keys
    assert [token for event in stored for token in event.token_ids] == prompt[:12]
    assert prefill(manager, with_image("b", "22" * 32)) == 4  # the block before the image only
    assert prefill(manager, with_image("c", "11" * 32)) == 12  # the same image: every full block
