"""Test helpers that stand in for the model runner: KV-cache allocation, AttentionMetadata for
a flat batch, and :class:`PagedBatcher`, a tiny block allocator that hands out shuffled
(non-contiguous) block ids so sequences really span scattered blocks."""

from __future__ import annotations

import random

import torch

from tokenloom.core.batch import AttentionMetadata


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype=torch.float32
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_size]`` tensor per layer, filled
    with large finite garbage: a read of a slot nobody wrote that is not masked out skews the
    result visibly. (Finite, as a runner's zero-initialised cache is: a masked NaN would
    still poison SDPA.)"""
    generator = torch.Generator().manual_seed(1234)
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    return [(torch.randn(shape, generator=generator) * 100).to(dtype) for _ in range(num_layers)]


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    kv_caches: list[torch.Tensor],
    backend=None,
    bidirectional: bool = False,
) -> AttentionMetadata:
    """Metadata for sequences whose last ``query_lens[i]`` of ``seq_lens[i]`` tokens run now."""
    slot_mapping = []
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        for position in range(seq_len - query_len, seq_len):
            slot_mapping.append(table[position // block_size] * block_size + position % block_size)
    max_blocks = max(len(table) for table in block_tables)
    padded_tables = [table + [0] * (max_blocks - len(table)) for table in block_tables]
    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded_tables, dtype=torch.int32),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        kv_caches=kv_caches,
        backend=backend,
        bidirectional=bidirectional,
    )


class PagedBatcher:
    """Tracks each sequence's tokens and blocks across steps, like a minimal scheduler +
    runner: ``step({seq_id: new_token_ids})`` returns ``(input_ids, positions, metadata)``."""

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int, backend, seed: int = 0):
        num_blocks = kv_caches[0].shape[1]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.num_tokens: dict[str, int] = {}
        self.block_tables: dict[str, list[int]] = {}

    def step(self, new_tokens: dict[str, list[int]]):
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq_id, token_ids in new_tokens.items():
            computed = self.num_tokens.get(seq_id, 0)
            seq_len = computed + len(token_ids)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < seq_len:
                table.append(self.free_blocks.pop())
            self.num_tokens[seq_id] = seq_len
            input_ids.extend(token_ids)
            positions.extend(range(computed, seq_len))
            query_lens.append(len(token_ids))
            seq_lens.append(seq_len)
            tables.append(table)
        metadata = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, self.kv_caches, self.backend)
        return torch.tensor(input_ids), torch.tensor(positions), metadata
