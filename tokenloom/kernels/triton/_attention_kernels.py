"""The Triton programs of paged attention (imported only by
:mod:`tokenloom.kernels.triton.attention`, which launches them). Importing this module imports
triton, and triton decides at that moment whether ``@triton.jit`` compiles for a GPU or runs in
its interpreter (``TRITON_INTERPRET=1``).

Every program reads keys and values through the block table (``slot = block_table[p //
block_size] * block_size + p % block_size``), computes scores and the softmax in float32 with
the online (running max / running sum) formulation, and masks exactly as
:func:`tokenloom.kernels.paged_attention.attention_allowed` does for causal attention.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _soft_cap(scores, soft_cap):
    # cap * tanh(s / cap); tanh through the sigmoid: tl has no tanh on every backend
    return soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_slot,
    stride_cache_head,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (token, KV head): copy the token's key and value to its slot. A negative
    slot is a padding token and is skipped."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_SIZE
        key = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + dims, mask=dim_mask)
        value = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + dims, mask=dim_mask)
        target = slot * stride_cache_slot + head * stride_cache_head + dims
        tl.store(key_cache_ptr + target, key.to(key_cache_ptr.dtype.element_ty), mask=dim_mask)
        tl.store(value_cache_ptr + target, value.to(value_cache_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def prefill_kernel(
    output_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    seq_indices_ptr,
    scale,
    soft_cap,
    window,
    group_size,
    stride_query_token,
    stride_query_head,
    stride_output_token,
    stride_output_head,
    stride_table_seq,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    HEAD_SIZE: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (sequence, query head, block of BLOCK_M query rows): the rows' causal
    attention over the sequence's cached prefix and the step's own tokens (already written to
    the cache), under the sliding window. Varlen: a program past its sequence's queries exits.

    Both products take float32 operands: ``DOT_PRECISION`` "tf32" for 16-bit activations
    (tf32 holds every bfloat16 and float16 value exactly, so q.k loses nothing against a 16-bit
    dot, at half a 16-bit tensor core's rate) and "ieee" for float32 ones. This is also what
    Triton's interpreter computes: it cannot multiply 16-bit dot operands, so a native 16-bit
    dot could not be tested here."""
    seq = tl.load(seq_indices_ptr + tl.program_id(0))
    head = tl.program_id(1)
    row_block = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if row_block * BLOCK_M < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - query_len
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < query_len
        query_positions = context_len + rows
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_SIZE
        query = tl.load(
            query_ptr
            + (query_start + rows).to(tl.int64)[:, None] * stride_query_token
            + head * stride_query_head
            + dims[None, :],
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        kv_head = head // group_size
        running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        accumulator = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # keys past the block's last query are all masked: stop there
        key_end = tl.minimum(context_len + (row_block + 1) * BLOCK_M, seq_len)
        key_begin = 0
        if USE_WINDOW:
            # the earliest key the block's first query sees, rounded down to a whole key block
            key_begin = tl.maximum(context_len + row_block * BLOCK_M - window + 1, 0)
            key_begin = (key_begin // BLOCK_N) * BLOCK_N
        for key_start in range(key_begin, key_end, BLOCK_N):
            key_positions = key_start + tl.arange(0, BLOCK_N)
            key_mask = key_positions < seq_len
            block_ids = tl.load(
                block_tables_ptr + seq * stride_table_seq + key_positions // KV_BLOCK_SIZE, mask=key_mask, other=0
            ).to(tl.int64)
            offsets = (
                block_ids * stride_cache_block
                + (key_positions % KV_BLOCK_SIZE) * stride_cache_offset
                + kv_head * stride_cache_head
            )
            kv_mask = key_mask[:, None] & dim_mask[None, :]
            keys = tl.load(key_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(query, tl.trans(keys.to(tl.float32)), input_precision=DOT_PRECISION) * scale
            if USE_SOFT_CAP:
                scores = _soft_cap(scores, soft_cap)
            allowed = (key_positions[None, :] <= query_positions[:, None]) & key_mask[None, :]
            if USE_WINDOW:
                allowed = allowed & (query_positions[:, None] - key_positions[None, :] < window)
            scores = tl.where(allowed, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # a row that has seen no allowed key yet keeps max -inf: shift by 0 instead (no nan)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp(scores - shift[:, None])
            rescale = tl.exp(running_max - shift)
            values = tl.load(value_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            accumulator = accumulator * rescale[:, None] + tl.dot(
                probs, values.to(tl.float32), input_precision=DOT_PRECISION
            )
            running_max = new_max
        running_sum = tl.where(running_sum == 0.0, 1.0, running_sum)  # padded rows
        output = accumulator / running_sum[:, None]
        tl.store(
            output_ptr
            + (query_start + rows).to(tl.int64)[:, None] * stride_output_token
            + head * stride_output_head
            + dims[None, :],
            output.to(output_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )


@triton.jit
def decode_split_kernel(
    partial_output_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    seq_indices_ptr,
    scale,
    soft_cap,
    window,
    group_size,
    partition_size,
    stride_query_token,
    stride_query_head,
    stride_table_seq,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_partial_row,
    stride_partial_head,
    stride_partial_split,
    HEAD_SIZE: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    """Split-K decode, one program per (decode row, KV head, partition of the context): the
    one query of each of the KV head's ``group_size`` query heads against the partition's
    keys. Writes the partition's unnormalised output, running max and running sum, which
    :func:`decode_reduce_kernel` combines: a long context is spread over many programs instead
    of one program walking it all."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(seq_indices_ptr + row)
    token = tl.load(query_start_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
    key_begin = first_key + split * partition_size
    key_end = tl.minimum(key_begin + partition_size, seq_len)
    group = tl.arange(0, BLOCK_G)
    group_mask = group < group_size
    heads = kv_head * group_size + group
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_SIZE
    query = tl.load(
        query_ptr + token.to(tl.int64) * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    running_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for key_start in range(key_begin, key_end, BLOCK_N):
        key_positions = key_start + tl.arange(0, BLOCK_N)
        key_mask = key_positions < key_end
        block_ids = tl.load(
            block_tables_ptr + seq * stride_table_seq + key_positions // KV_BLOCK_SIZE, mask=key_mask, other=0
        ).to(tl.int64)
        offsets = (
            block_ids * stride_cache_block
            + (key_positions % KV_BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        # a handful of query rows: a broadcast product, not a tensor-core dot (which wants 16 rows)
        scores = tl.sum(query[:, None, :] * keys[None, :, :], axis=2) * scale
        if USE_SOFT_CAP:
            scores = _soft_cap(scores, soft_cap)
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - shift[:, None])
        rescale = tl.exp(running_max - shift)
        values = tl.load(value_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        accumulator = accumulator * rescale[:, None] + tl.sum(probs[:, :, None] * values[None, :, :], axis=1)
        running_max = new_max
    partial = row * stride_partial_row + heads * stride_partial_head + split * stride_partial_split
    tl.store(partial_output_ptr + partial[:, None] * BLOCK_D + dims[None, :], accumulator, mask=group_mask[:, None])
    tl.store(partial_max_ptr + partial, running_max, mask=group_mask)
    tl.store(partial_sum_ptr + partial, running_sum, mask=group_mask)


@triton.jit
def decode_reduce_kernel(
    output_ptr,
    partial_output_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_ptr,
    seq_indices_ptr,
    num_splits,
    stride_output_token,
    stride_output_head,
    stride_partial_row,
    stride_partial_head,
    HEAD_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (decode row, query head): the partitions' outputs weighted by
    ``exp(max_p - max)``, divided by the equally weighted sums. An empty partition (a context
    shorter than the longest) has max -inf and weighs nothing."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_indices_ptr + row)
    token = tl.load(query_start_ptr + seq)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    partial = row * stride_partial_row + head * stride_partial_head + splits
    maxima = tl.load(partial_max_ptr + partial, mask=split_mask, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + partial, mask=split_mask, other=0.0)
    overall_max = tl.max(maxima, axis=0)
    weights = tl.where(maxima == float("-inf"), 0.0, tl.exp(maxima - overall_max))
    dims = tl.arange(0, BLOCK_D)
    outputs = tl.load(
        partial_output_ptr + partial[:, None] * BLOCK_D + dims[None, :], mask=split_mask[:, None], other=0.0
    )
    output = tl.sum(outputs * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    tl.store(
        output_ptr + token.to(tl.int64) * stride_output_token + head * stride_output_head + dims,
        output.to(output_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )
