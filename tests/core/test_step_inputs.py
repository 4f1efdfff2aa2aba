"""prepare_batch: each sequence's run of tokens becomes flat token ids, positions and the
slots its block table gives them, exactly."""

from __future__ import annotations

import torch

from tokenloom.core.step_inputs import prepare_batch


def build(rows, **options):
    return prepare_batch(rows, block_size=4, to_device=lambda tensor: tensor, kv_caches=[], backend=None, **options)


def test_a_prefill_chunk_and_a_decode_row_map_onto_their_blocks():
    # sequence 0: positions 2..6 (a chunk crossing from block 7 into block 3); sequence 1: the
    # one token at position 9 (its third block, 5)
    batch = build([([10, 11, 12, 13, 14], 2, [7, 3, 9]), ([20], 9, [1, 2, 5])])
    assert batch.input_ids.tolist() == [10, 11, 12, 13, 14, 20]
    assert batch.positions.tolist() == [2, 3, 4, 5, 6, 9]
    assert batch.attn_metadata.slot_mapping.tolist() == [30, 31, 12, 13, 14, 21]
    assert batch.query_start_loc == [0, 5, 6]
    assert batch.seq_lens == [7, 10]
    metadata = batch.attn_metadata
    assert metadata.query_start_loc.tolist() == [0, 5, 6]
    assert metadata.seq_lens.tolist() == [7, 10]
    assert (metadata.query_lens_cpu, metadata.seq_lens_cpu) == ([5, 1], [7, 10])
    assert (metadata.max_query_len, metadata.max_seq_len, metadata.block_size) == (5, 10, 4)
    # only the blocks a sequence's length reaches, padded with 0 (sequence 0's third block,
    # 9, is not reached by position 6)
    assert metadata.block_tables.tolist() == [[7, 3, 0], [1, 2, 5]]
    assert metadata.block_tables.dtype == torch.int64
    assert metadata.num_draft_tokens_cpu is None and metadata.kv_scales is None


def test_drafts_and_scales_are_passed_through_and_rows_may_be_a_generator():
    kv_scales = [object()]
    batch = build(
        ((tokens, start, blocks) for tokens, start, blocks in [([5, 6, 7, 8], 3, [4, 8])]),
        kv_scales=kv_scales,
        num_draft_tokens_cpu=[3],
    )
    assert batch.positions.tolist() == [3, 4, 5, 6]
    assert batch.attn_metadata.slot_mapping.tolist() == [19, 32, 33, 34]
    assert batch.attn_metadata.block_tables.tolist() == [[4, 8]]
    assert batch.attn_metadata.kv_scales is kv_scales
    assert batch.attn_metadata.num_draft_tokens_cpu == [3]


def test_prompt_query_lens_count_each_querys_rows_inside_its_prompt():
    # a prompt chunk (positions 2..6 of an 8-token prompt), a decode row (position 9 of a
    # 6-token prompt), the last prompt token with recomputed outputs after it (positions 4..7 of
    # a 5-token prompt: one prompt row), and a first chunk of a 3-token prompt
    rows = [([1] * 5, 2, [0, 1]), ([2], 9, [0, 1, 2]), ([3] * 4, 4, [0, 1]), ([4] * 3, 0, [0])]
    assert build(rows, prompt_lens=[8, 6, 5, 3]).attn_metadata.prompt_query_lens_cpu == [5, 0, 1, 3]
    assert build(rows).attn_metadata.prompt_query_lens_cpu is None
