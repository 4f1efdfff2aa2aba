"""The KV-cache block pool: per-request block tables, ref-counted fixed-size blocks, prefix
caching by a hash chain over full blocks, and LRU eviction of cached free blocks.

Pure Python and unit-testable: it hands out block ids; the worker owns the memory behind them.
Every block id in ``range(num_blocks)`` is a normal block (no null block is reserved).

Isolation: a prefix hit never rests on the hash alone. Each cached block keeps the token ids
it holds and what it follows (the cached block before it, or the request's ``cache_salt`` for
the first block), and a lookup compares both, so even a crafted collision of the (optional,
``builtin``) Python hash cannot serve one request's KV into another's context; ``sha256`` (the
default) makes collisions infeasible in the first place. Requests with different
``cache_salt`` values, or different LoRA adapters (the same tokens give other K/V), never share
a block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from tokenloom.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from tokenloom.core.multimodal.inputs import block_extra_keys
from tokenloom.core.sequence import EngineSequence
from tokenloom.errors import ConfigError, TokenloomError

PREFIX_HASH_ALGOS = ("sha256", "builtin")
DEFAULT_PREFIX_HASH_ALGO = "sha256"


@dataclass(frozen=True)
class CachedContent:
    """What a cached block holds, checked on every hit: its content (``token_ids``) and what it
    follows (``parent``: ``("root", cache_salt)`` for a sequence's first block, ``("block",
    serial)`` of the cached block before it otherwise). ``serial`` is unique for the life of the
    manager (never reused after eviction), so a child that names its parent by serial can only
    follow that exact content."""

    serial: int
    parent: tuple[Any, ...]
    token_ids: tuple[int, ...]


@dataclass(eq=False)
class Block:
    """One KV block: its id (the index of its memory in the worker's cache), how many block
    tables hold it, and, while its KV may be reused, the content hash it is found by and what
    it holds. A block with ``ref_count == 0`` is free; a free block that is still cached can be
    hit (revived) until it is evicted."""

    block_id: int
    ref_count: int = 0
    block_hash: Hashable | None = None
    content: CachedContent | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


@dataclass
class _SequenceBlocks:
    """The block manager's record of one sequence."""

    # block ids, in token order; None until its first allocation (a prefix lookup may come first)
    table: list[int] | None = None
    # hash chain of its leading full blocks, extended lazily
    hashes: list[Hashable] = field(default_factory=list)
    # how many leading blocks of the table have been offered to the cache already
    num_registered: int = 0
    # what its next block to register follows; None once its chain left the cache (a colliding
    # hash held other content), after which none of its blocks are cached
    next_parent: tuple[Any, ...] | None = None


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups counted in tokens, like vLLM's prefix_cache_queries/hits."""

    queries: int = 0
    hits: int = 0
    # lookups whose hash matched a cached block of other content (or another salt/prefix)
    collisions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    """Allocates KV blocks to requests and shares identical full-block prefixes between them.

    A block's content is identified by the hash chain ``hash(parent_hash, block_token_ids)``,
    so a hit on block ``i`` implies the whole prefix before it matches too.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        hash_algo: str = DEFAULT_PREFIX_HASH_ALGO,
        enable_kv_cache_events: bool = False,
    ):
        if num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        if block_size < 1:
            raise ConfigError(f"--block-size must be at least 1, got {block_size}", param="block-size")
        if hash_algo not in PREFIX_HASH_ALGOS:
            raise ConfigError(
                f"--prefix-caching-hash-algo must be one of {', '.join(PREFIX_HASH_ALGOS)}, got {hash_algo!r}",
                param="prefix-caching-hash-algo",
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self.prefix_cache_stats = PrefixCacheStats()

        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._block_by_hash: dict[Hashable, Block] = {}
        self._next_serial = 0
        # free blocks with nothing cached are reused before any cached block is evicted
        self._free_uncached: list[Block] = self.blocks[::-1]
        # free blocks that still hold a cached prefix, least recently freed first (the LRU order)
        self._free_cached: OrderedDict[int, Block] = OrderedDict()
        self._sequences: dict[str, _SequenceBlocks] = {}
        # what the prefix cache stored, evicted and cleared since the last take_kv_events()
        # (None: not recorded)
        self._kv_events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks (in use or free) whose content can be hit by a prefix lookup."""
        return len(self._block_by_hash)

    def cached_block_hashes(self) -> set[Hashable]:
        """The hashes a prefix lookup can hit now (what KV-cache events describe)."""
        return set(self._block_by_hash)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def get_block_table(self, seq_id: str) -> list[int]:
        """A copy of the request's block table (empty when it holds no blocks)."""
        record = self._sequences.get(seq_id)
        return list(record.table) if record is not None and record.table is not None else []

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, seq: EngineSequence) -> tuple[list[int], int]:
        """The longest run of cached full blocks that starts the request's tokens.

        The hit stops one token short of the whole sequence (rounded down to a block) so the
        last token is always recomputed and the model produces logits for it.

        :returns: the hit block ids and the number of tokens they hold.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (seq.num_tokens - 1) // self.block_size
        hit_blocks: list[int] = []
        parent = self._root_ref(seq)
        for block_index in range(max_hit_blocks):
            block = self._block_by_hash.get(self._block_hash(seq, block_index))
            if block is None:
                break
            cached = block.content
            # the hash only finds a candidate: its content and what it follows must match too
            if cached is None or cached.parent != parent or cached.token_ids != self._block_token_ids(seq, block_index):
                self.prefix_cache_stats.collisions += 1
                break
            hit_blocks.append(block.block_id)
            parent = ("block", cached.serial)
        return hit_blocks, len(hit_blocks) * self.block_size

    def block_hashes(self, seq: EngineSequence, start: int, end: int) -> list[Hashable]:
        """The chain hashes of the request's full blocks ``start`` to ``end`` (exclusive), the
        keys a KV connector stores them under."""
        return [self._block_hash(seq, block_index) for block_index in range(start, end)]

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV-cache events recorded since the last call, oldest first."""
        if not self._kv_events:
            return []
        events, self._kv_events = self._kv_events, []
        return events

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after new weights); blocks in use keep serving their
        own requests but are no longer shared and return to the pool uncached."""
        if self._kv_events is not None:
            self._kv_events.append(AllBlocksCleared())
        self._free_uncached.extend(self._free_cached.values())
        self._free_cached.clear()
        for block in self._block_by_hash.values():
            block.block_hash = block.content = None
        self._block_by_hash.clear()

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self, seq: EngineSequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grow the sequence's block table to cover ``seq.num_computed_tokens`` plus the
        prefix hit (``computed_blocks``, only on the first allocation) plus ``num_new_tokens``.

        The caller sets ``seq.num_computed_tokens`` to include the hit after this succeeds.
        Passing ``computed_blocks`` (even ``[]``) marks a prefix lookup whose result is used:
        it is counted in :attr:`prefix_cache_stats` once per allocation that uses it.

        :returns: the block ids added, or None (and nothing allocated) when too few are free.
        """
        seq_id = seq.seq_id
        record = self._sequences.get(seq_id)
        table = record.table if record is not None else None
        hit_blocks = [self.blocks[block_id] for block_id in computed_blocks or ()]
        if hit_blocks and table:
            raise TokenloomError(
                f"sequence {seq_id!r} already holds blocks; a prefix hit only applies to its first allocation"
            )
        num_held = len(table) if table else 0
        num_tokens = seq.num_computed_tokens + len(hit_blocks) * self.block_size + num_new_tokens
        num_to_allocate = max(0, self.num_blocks_needed(num_tokens) - num_held - len(hit_blocks))
        # hit blocks that are free leave the free pool when touched
        num_revived = sum(1 for block in hit_blocks if block.ref_count == 0)
        if num_to_allocate > self.num_free_blocks - num_revived:
            return None

        if record is None:
            record = self._sequences[seq_id] = _SequenceBlocks()
        if table is None:
            table = record.table = []
            record.num_registered = len(hit_blocks)
            record.next_parent = ("block", self._serial_of(hit_blocks[-1])) if hit_blocks else self._root_ref(seq)
            if computed_blocks is not None and self.enable_prefix_caching:
                self.prefix_cache_stats.queries += seq.num_tokens
                self.prefix_cache_stats.hits += len(hit_blocks) * self.block_size
        # take the hit blocks before popping new ones, so the pops cannot evict them
        for block in hit_blocks:
            if block.ref_count == 0:
                del self._free_cached[block.block_id]
            block.ref_count += 1
            table.append(block.block_id)
        new_block_ids = []
        for _ in range(num_to_allocate):
            block = self._pop_free_block()
            block.ref_count = 1
            new_block_ids.append(block.block_id)
        table.extend(new_block_ids)
        if self.enable_prefix_caching:
            self._register_computed_blocks(seq, record)
        return new_block_ids

    def free(self, seq: EngineSequence) -> None:
        """Release the request's blocks (finish, abort or preemption).

        Full blocks whose KV is computed (per ``seq.num_computed_tokens``) are cached first,
        so a preempted request can hit its own blocks when it resumes.
        """
        record = self._sequences.pop(seq.seq_id, None)
        if record is None or record.table is None:
            return
        if self.enable_prefix_caching:
            self._register_computed_blocks(seq, record)
        # the tail goes into the LRU queue first, so a prefix outlives its own continuation
        for block_id in reversed(record.table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.is_cached:
                    self._free_cached[block_id] = block
                else:
                    self._free_uncached.append(block)

    # ---- internals ---------------------------------------------------------------------------

    def _pop_free_block(self) -> Block:
        if self._free_uncached:
            return self._free_uncached.pop()
        _, block = self._free_cached.popitem(last=False)
        del self._block_by_hash[block.block_hash]
        if self._kv_events is not None:
            self._kv_events.append(BlockRemoved([block.block_hash]))
        block.block_hash = block.content = None
        return block

    def _register_computed_blocks(self, seq: EngineSequence, record: _SequenceBlocks) -> None:
        """Offer each newly computed full block of the sequence to the cache.

        Only blocks whose KV was written in earlier steps qualify, so a lookup can never hit a
        block the worker is still filling.
        """
        table = record.table or []
        num_full_computed = min(seq.num_computed_tokens // self.block_size, len(table))
        block_index = record.num_registered
        parent = record.next_parent
        stored: list[int] = []  # indices of the blocks this call caches, for the KV-cache events
        while block_index < num_full_computed and parent is not None:
            block = self.blocks[table[block_index]]
            block_hash = self._block_hash(seq, block_index)
            token_ids = self._block_token_ids(seq, block_index)
            cached_block = self._block_by_hash.get(block_hash)
            if cached_block is None and not block.is_cached:
                block.block_hash = block_hash
                block.content = CachedContent(self._next_serial, parent, token_ids)
                self._next_serial += 1
                self._block_by_hash[block_hash] = block
                parent = ("block", block.content.serial)
                stored.append(block_index)
            else:
                # a duplicate of a cached block stays private (freed uncached); its children
                # follow the cached copy, but only if that copy truly holds the same content
                existing = cached_block.content if cached_block is not None else None
                if existing is None or existing.parent != parent or existing.token_ids != token_ids:
                    parent = None
                else:
                    parent = ("block", existing.serial)
            block_index += 1
        record.num_registered = block_index
        record.next_parent = parent
        if self._kv_events is not None and stored:
            self._record_stored(seq, stored)

    def _record_stored(self, seq: EngineSequence, block_indices: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks (a duplicate of a block
        cached before, which stays private, splits a run)."""
        assert self._kv_events is not None  # only called while recording
        runs: list[list[int]] = []
        for block_index in block_indices:
            if runs and runs[-1][-1] == block_index - 1:
                runs[-1].append(block_index)
            else:
                runs.append([block_index])
        for run in runs:
            self._kv_events.append(
                BlockStored(
                    block_hashes=[self._block_hash(seq, index) for index in run],
                    parent_block_hash=self._block_hash(seq, run[0] - 1) if run[0] else None,
                    # the tokens alone: an image's keys follow a full block's tokens
                    token_ids=[
                        token for index in run for token in self._block_token_ids(seq, index)[: self.block_size]
                    ],
                    block_size=self.block_size,
                    lora_id=_lora_id(seq),
                )
            )

    def _block_hash(self, seq: EngineSequence, block_index: int) -> Hashable:
        """The chain hash of full block ``block_index`` of the request, computing the chain up
        to it on first use."""
        chain = self._sequences.setdefault(seq.seq_id, _SequenceBlocks()).hashes
        while len(chain) <= block_index:
            parent = chain[-1] if chain else self._root_hash(seq)
            chain.append(self._hash_block(parent, self._block_token_ids(seq, len(chain))))
        return chain[block_index]

    def _hash_block(self, parent: Hashable | None, token_ids: tuple[int, ...]) -> Hashable:
        if self.hash_algo == "sha256":
            # every parent is a 32-byte digest, so the byte string is unambiguous
            assert isinstance(parent, bytes)  # the sha256 chain's parents are its own digests
            return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()
        return hash((parent, token_ids))

    def _root_hash(self, seq: EngineSequence) -> Hashable:
        """The parent of the first block: derived from the request's cache salt, so requests
        with different salts have different hashes for every block (and never share one)."""
        salt = seq.sampling_params.cache_salt
        lora_id = _lora_id(seq)
        if self.hash_algo == "sha256":
            return hashlib.sha256(
                b"tokenloom-prefix-root\0"
                + (b"" if salt is None else b"salt\0" + salt.encode("utf-8"))
                + (b"" if lora_id is None else b"\0lora\0" + str(lora_id).encode("ascii"))
            ).digest()
        return self._root_ref(seq)

    @staticmethod
    def _serial_of(block: Block) -> int:
        if block.content is None:  # a prefix hit is always a cached block
            raise RuntimeError(f"block {block.block_id} was a prefix-cache hit but holds no cached content")
        return block.content.serial

    @staticmethod
    def _root_ref(seq: EngineSequence) -> tuple[Any, ...]:
        lora_id = _lora_id(seq)
        if lora_id is None:
            return ("root", seq.sampling_params.cache_salt)
        return ("root", seq.sampling_params.cache_salt, "lora", lora_id)

    def _block_token_ids(self, seq: EngineSequence, block_index: int) -> tuple[int, ...]:
        # sliced from the two lists directly: seq.all_token_ids copies the whole sequence
        start = block_index * self.block_size
        end = start + self.block_size
        prompt = seq.prompt_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            # a block over an image's placeholders is keyed by the image too
            return tuple(prompt[start:end]) + block_extra_keys(seq.mm_items, start, end)
        output = seq.output_token_ids
        if start >= num_prompt:
            return tuple(output[start - num_prompt : end - num_prompt])
        return tuple(prompt[start:]) + tuple(output[: end - num_prompt]) + block_extra_keys(seq.mm_items, start, end)


def _lora_id(seq: EngineSequence) -> int | None:
    """The id of the LoRA adapter the request runs with (None: the base model)."""
    lora_request = seq.lora_request
    return None if lora_request is None else lora_request.lora_int_id
