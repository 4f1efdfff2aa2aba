"""A forward pass's flat inputs (token ids, positions, :class:`AttentionMetadata`) built from
each sequence's run of tokens and its block table: one builder for the model runner's steps
and for a draft model's steps, which index the same paged KV layout."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.core.batch import AttentionMetadata, KVCacheScales


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    query_start_loc: list[int]
    seq_lens: list[int]


def prepare_batch(
    rows: Iterable[tuple[Sequence[int], int, Sequence[int]]],
    *,
    block_size: int,
    to_device: Callable[[torch.Tensor], torch.Tensor],
    kv_caches: list[Any],
    backend: Any,
    kv_scales: list[KVCacheScales] | None = None,
    num_draft_tokens_cpu: list[int] | None = None,
    bidirectional_spans: list[list[tuple[int, int]]] | None = None,
    prompt_lens: Sequence[int] | None = None,
) -> PreparedBatch:
    """One batch from ``rows`` of ``(token_ids, start, block_ids)``: a sequence computes
    ``token_ids`` at positions ``start, start + 1, ...``, its KV going to the slots its
    ``block_ids`` give those positions. ``to_device`` copies a host tensor the platform's
    way (pinned and asynchronous on a GPU). ``bidirectional_spans``: see
    :class:`~tokenloom.core.batch.AttentionMetadata`; ``prompt_lens``: each sequence's prompt
    length, from which its ``prompt_query_lens_cpu`` follows."""
    token_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    query_lens: list[int] = []
    block_ids_used: list[Sequence[int]] = []
    max_blocks = 0
    for tokens, start, blocks in rows:
        count = len(tokens)
        end = start + count
        token_ids.extend(tokens)
        positions.extend(range(start, end))
        slot_mapping.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_lens.append(count)
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + count)
        used = -(-end // block_size)
        block_ids_used.append(blocks[:used])
        max_blocks = max(max_blocks, used)
    # padded with block 0 (past a sequence's length no backend reads its table), and made one
    # tensor in one call: a copy per row costs more than the rows' Python lists
    block_tables = torch.tensor(
        [[*blocks, *[0] * (max_blocks - len(blocks))] for blocks in block_ids_used], dtype=torch.int64
    ).reshape(len(seq_lens), max_blocks)
    attn_metadata = AttentionMetadata(
        slot_mapping=to_device(torch.tensor(slot_mapping, dtype=torch.int64)),
        query_start_loc=to_device(torch.tensor(query_start_loc, dtype=torch.int64)),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int64)),
        block_tables=to_device(block_tables),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        kv_caches=kv_caches,
        backend=backend,
        kv_scales=kv_scales,
        num_draft_tokens_cpu=num_draft_tokens_cpu,
        bidirectional_spans=bidirectional_spans,
        prompt_query_lens_cpu=None
        if prompt_lens is None
        else [
            max(0, min(count, prompt - (end - count)))
            for count, end, prompt in zip(query_lens, seq_lens, prompt_lens, strict=True)
        ],
    )
    return PreparedBatch(
        input_ids=to_device(torch.tensor(token_ids, dtype=torch.int64)),
        positions=to_device(torch.tensor(positions, dtype=torch.int64)),
        attn_metadata=attn_metadata,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )
