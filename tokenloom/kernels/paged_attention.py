"""Paged attention over the block-structured KV cache: the plain torch reference
(:func:`reference_paged_attention`) and the fast CPU backend (:class:`TorchPagedAttention`)
that platforms name as their attention backend.

Cache layout (one tensor per layer): ``[2, num_blocks, block_size, num_kv_heads, head_size]``;
token ``p`` of a sequence lives at slot ``block_table[p // block_size] * block_size +
p % block_size``. A query at position ``q`` attends to cached positions ``k`` with
``k <= q`` and, under a sliding window ``w``, ``k > q - w`` (the last ``w`` positions,
itself included), as in Hugging Face transformers.

The cache holds the activations' dtype, or an 8-bit float format (``--kv-cache-dtype fp8``,
``fp8_e4m3``: ``torch.float8_e4m3fn``; ``fp8_e5m2``: ``torch.float8_e5m2``) with vLLM's
per-layer scales: an element ``q`` of the key (value) half stands for ``q * k_scale``
(``q * v_scale``); :func:`quantize_kv` writes it, :func:`dequantize_kv` reads it. Attention
always reads what the cache holds, so a prompt's own keys and values are rounded to the cache's
format before its tokens attend to them, as later decode steps see them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.errors import ConfigError
from tokenloom.kernels.cpu_native import ops_for

# the 8-bit KV-cache formats and their largest finite value (writes saturate there, as vLLM's
# kernels do: torch's own cast turns an e5m2 overflow into inf)
FP8_KV_CACHE_LIMITS = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_fp8_kv_cache(kv_cache: torch.Tensor | None) -> bool:
    return kv_cache is not None and kv_cache.dtype in FP8_KV_CACHE_LIMITS


def quantize_kv(rows: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``rows`` as the fp8 cache stores them: ``rows * (1 / scale)`` in float32 (the reciprocal
    rounded to float32 first, as the native kernel computes it), saturated, rounded to nearest
    even."""
    limit = FP8_KV_CACHE_LIMITS[cache_dtype]
    return (rows.float() * (1.0 / scale)).clamp_(-limit, limit).to(cache_dtype)


def dequantize_kv(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What cache elements stand for, in ``dtype``: ``cached * scale`` for an fp8 cache, the
    elements themselves otherwise."""
    if cached.dtype not in FP8_KV_CACHE_LIMITS:
        return cached.to(dtype)
    return (cached.float() * scale).to(dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's ``key``/``value`` (``[num_tokens, num_kv_heads, head_size]``) at
    their flat slots (``block_id * block_size + offset``) in ``kv_cache``; an fp8 cache gets
    them quantized with the layer's ``k_scale``/``v_scale``."""
    if kv_cache is None:
        raise ConfigError("no KV cache for this attention layer: the runner must allocate one per layer")
    if not kv_cache.is_contiguous():
        raise ConfigError(
            "the KV cache tensor must be contiguous: allocate it as one [2, blocks, block_size, heads, dim] tensor"
        )
    num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    slots = slot_mapping.to(torch.long)
    if is_fp8_kv_cache(kv_cache):
        # torch has no index_copy_ for float8: move the bytes
        for half, rows, scale in ((0, key, k_scale), (1, value, v_scale)):
            quantized = quantize_kv(rows, scale, kv_cache.dtype).view(torch.uint8)
            kv_cache[half].view(torch.uint8).view(-1, num_kv_heads, head_size).index_copy_(0, slots, quantized)
        return
    kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slots, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(0, slots, value.to(kv_cache.dtype))


def kv_as_cached(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, k_scale: float, v_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``key``/``value`` as the cache gives them back (rounded through an fp8 cache's format), in
    their own dtype: what a prompt's tokens attend to."""
    if not is_fp8_kv_cache(kv_cache):
        return key, value
    return (
        dequantize_kv(quantize_kv(key, k_scale, kv_cache.dtype), k_scale, key.dtype),
        dequantize_kv(quantize_kv(value, v_scale, kv_cache.dtype), v_scale, value.dtype),
    )


def attention_allowed(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    causal: bool,
    sliding_window: int | None,
    bidirectional_spans: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:
    """``[..., num_queries, num_keys]`` boolean: may the query at each position see each key.

    Bidirectional attention under a window allows ``|q - k| < window``. Under causal attention
    a query inside one of ``bidirectional_spans`` (``[start, end)`` positions) also sees the
    span's later keys; a window still cuts keys more than ``window - 1`` before the query, as
    transformers composes Gemma 3's image mask (window AND (causal OR same span))."""
    distance = query_positions.unsqueeze(-1) - key_positions.unsqueeze(-2)
    if causal:
        allowed = distance >= 0
        for start, end in bidirectional_spans:
            query_inside = (query_positions >= start) & (query_positions < end)
            key_inside = (key_positions >= start) & (key_positions < end)
            allowed |= query_inside.unsqueeze(-1) & key_inside.unsqueeze(-2)
        if sliding_window is not None:
            allowed &= distance < sliding_window
    else:
        allowed = torch.ones_like(distance, dtype=torch.bool)
        if sliding_window is not None:
            allowed &= distance.abs() < sliding_window
    return allowed


def _spans_of(attn_metadata, seq_index: int) -> Sequence[tuple[int, int]]:
    """The sequence's ``AttentionMetadata.bidirectional_spans`` (none when the step has none)."""
    spans = getattr(attn_metadata, "bidirectional_spans", None)
    return spans[seq_index] if spans is not None else ()


def _soft_capped(scores: torch.Tensor, logits_soft_cap: float | None) -> torch.Tensor:
    if logits_soft_cap is None:
        return scores
    return torch.tanh(scores / logits_soft_cap) * logits_soft_cap


def reference_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    attn_metadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The readable definition every fast path is tested against: one sequence at a time,
    token-level slot lookup, float32 softmax; every key and value read from the cache."""
    bidirectional = attn_metadata.bidirectional
    if not bidirectional:
        write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping, k_scale, v_scale)
    num_q_heads, num_kv_heads, head_size = query.shape[1], key.shape[1], key.shape[2]
    group_size = num_q_heads // num_kv_heads
    block_size = attn_metadata.block_size
    output = torch.empty_like(query)
    query_start = 0
    for seq_index, (query_len, seq_len) in enumerate(zip(attn_metadata.query_lens_cpu, attn_metadata.seq_lens_cpu)):
        tokens = slice(query_start, query_start + query_len)
        query_start += query_len
        if bidirectional:
            seq_keys, seq_values = key[tokens], value[tokens]
            key_positions = torch.arange(query_len, device=query.device)
            query_positions = key_positions
        else:
            key_positions = torch.arange(seq_len, device=query.device)
            block_table = attn_metadata.block_tables[seq_index].to(torch.long)
            slots = block_table[key_positions // block_size] * block_size + key_positions % block_size
            seq_keys = dequantize_kv(kv_cache[0].reshape(-1, num_kv_heads, head_size)[slots], k_scale, torch.float32)
            seq_values = dequantize_kv(kv_cache[1].reshape(-1, num_kv_heads, head_size)[slots], v_scale, torch.float32)
            query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
        seq_keys = seq_keys.float().repeat_interleave(group_size, dim=1)
        seq_values = seq_values.float().repeat_interleave(group_size, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[tokens].float(), seq_keys) * scale
        scores = _soft_capped(scores, logits_soft_cap)
        allowed = attention_allowed(
            query_positions,
            key_positions,
            causal=not bidirectional,
            sliding_window=sliding_window,
            bidirectional_spans=_spans_of(attn_metadata, seq_index),
        )
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        output[tokens] = torch.einsum("hqk,khd->qhd", probs, seq_values).to(query.dtype)
    return output


class ReferencePagedAttention:
    """:func:`reference_paged_attention` as a backend object (slow: for debugging a model
    or checking a new backend end to end)."""

    # reads an fp8 cache (the model runner refuses --kv-cache-dtype fp8 for a backend without this)
    supports_fp8_kv_cache = True

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        *,
        scale,
        sliding_window=None,
        logits_soft_cap=None,
        k_scale=1.0,
        v_scale=1.0,
    ):
        return reference_paged_attention(
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )


def _attend_folded(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None,
    logits_soft_cap: float | None,
) -> torch.Tensor:
    """``query [..., Hkv, R, D]`` (each KV head's query rows) against ``key/value
    [..., Hkv, K, D]``; ``mask`` is a boolean "allowed" mask broadcastable to the scores.
    SDPA cannot soft-cap logits, so capped models take the math path."""
    if logits_soft_cap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    scores = _soft_capped(torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale, logits_soft_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), value.float()).to(query.dtype)


def _attend_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None,
    is_causal: bool,
    logits_soft_cap: float | None,
    scores_buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence: ``query [Q, Hq, D]`` over ``key/value [K, Hkv, D]`` -> ``[Q, Hq, D]``.
    ``mask`` (``[Q, K]`` allowed) or ``is_causal`` (queries are the last ``Q`` keys).
    ``scores_buffer``: see :func:`_causal_attention_bmm`."""
    num_queries, num_q_heads, _ = query.shape
    num_kv_heads = key.shape[1]
    if (
        is_causal
        and logits_soft_cap is None
        and query.dtype != torch.float32
        and _BMM_CAUSAL_ROWS[0] <= num_queries <= _BMM_CAUSAL_ROWS[1]
    ):
        return _causal_attention_bmm(query, key, value, scale, scores_buffer)
    if logits_soft_cap is None:
        # SDPA's own GQA beats folding query heads for many query rows (and is_causal
        # needs no mask at all)
        output = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        )
        return output[0].transpose(0, 1)
    if is_causal:
        positions = torch.arange(key.shape[0] - num_queries, key.shape[0], device=query.device)
        key_positions = torch.arange(key.shape[0], device=query.device)
        mask = attention_allowed(positions, key_positions, causal=True, sliding_window=None)
    group_size = num_q_heads // num_kv_heads
    rows = _attend_folded(
        _fold_query_heads(query, num_kv_heads),
        key.transpose(0, 1),
        value.transpose(0, 1),
        scale=scale,
        # folded rows are group-major, so the per-query mask repeats once per group member
        mask=None if mask is None else mask.repeat(group_size, 1),
        logits_soft_cap=logits_soft_cap,
    )
    return _unfold_query_heads(rows, num_queries)


def _decode_all_heads(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence, ``query [B, Hq, D]`` over gathered ``keys/values [B, L, Hkv, D]``
    where ``allowed [B, 1, L]`` -> ``[B, Hq, D]``. A key that is not allowed gets score -inf by
    selection (whatever its product was: nan or inf from a stale slot included); its value must
    be finite, as its zero weight multiplies it.

    Each sequence's query heads are multiplied against *all* its KV heads in one batched
    matmul straight from the gathered layout, and each head's own KV head is then picked out
    as a diagonal view: the extra products are cheap (Hkv x a few MFLOP), while putting K/V
    head-major first would copy every gathered key and value, and SDPA's CPU kernel is 2-3x
    slower on a batch of single queries."""
    num_seqs, num_q_heads, head_size = query.shape
    num_keys, num_kv_heads = keys.shape[1], keys.shape[2]
    group_size = num_q_heads // num_kv_heads
    scores = torch.bmm(query, keys.view(num_seqs, num_keys * num_kv_heads, head_size).transpose(1, 2))
    # [B, Hkv(query's), G, L, Hkv(key's)] -> the matching pairs, [B, G, L, Hkv]
    scores = scores.view(num_seqs, num_kv_heads, group_size, num_keys, num_kv_heads).diagonal(dim1=1, dim2=4)
    scores = scores.permute(0, 3, 1, 2).reshape(num_seqs, num_q_heads, num_keys).float() * scale
    scores = scores.masked_fill_(~allowed, float("-inf"))
    probs = scores.softmax(dim=-1).to(query.dtype)
    output = torch.bmm(probs, values.view(num_seqs, num_keys, num_kv_heads * head_size))
    # [B, Hkv(query's), G, Hkv(value's), D] -> the matching pairs
    output = output.view(num_seqs, num_kv_heads, group_size, num_kv_heads, head_size).diagonal(dim1=1, dim2=3)
    return output.permute(0, 3, 1, 2).reshape(num_seqs, num_q_heads, head_size)


# prompt lengths for which two batched matmuls with a float32 softmax beat SDPA's CPU kernel
# on a causal 16-bit prompt (figures in docs/design.md, "Compute on the CPU")
_BMM_CAUSAL_ROWS = (64, 384)


def _causal_attention_bmm(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    scores_buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a prompt over itself, ``[T, Hq, D]`` x ``[T, Hkv, D]`` -> ``[T, Hq, D]``,
    with each KV head's query group folded into rows (no repeated K/V). ``scores_buffer`` (at
    least ``Hq * T * T`` elements of the query's dtype, or None): where the scores go on the
    native path, one buffer for a step's prompts: their ~1-3 MB of scores then stay in the
    CPU's cache from prompt to prompt, where a fresh tensor each was memory the scores' first
    writes had to fetch (or fault in): a 256-token prompt of SmolLM2's took ~880 us, ~580 in
    a reused buffer (one thread)."""
    num_tokens, num_kv_heads = key.shape[0], key.shape[1]
    folded = _fold_query_heads(query, num_kv_heads)  # [Hkv, G*T, D]
    ops = ops_for(query)
    if ops is not None:
        # one fused operator for scale, mask, float32 softmax and the rounding back
        shape = (num_kv_heads, folded.shape[1], num_tokens)
        if scores_buffer is not None and scores_buffer.dtype == query.dtype:
            out = scores_buffer[: shape[0] * shape[1] * shape[2]].view(shape)
            probs = torch.bmm(folded, key.permute(1, 2, 0), out=out)
        else:
            probs = torch.bmm(folded, key.permute(1, 2, 0))
        ops.causal_softmax_(probs.view(-1, num_tokens, num_tokens), scale)
        return _unfold_query_heads(torch.bmm(probs, value.transpose(0, 1)), num_tokens)
    scores = torch.bmm(folded, key.permute(1, 2, 0)).float() * scale
    future = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=query.device).triu(1)
    scores = scores.view(num_kv_heads, -1, num_tokens, num_tokens).masked_fill_(future, float("-inf"))
    probs = scores.softmax(dim=-1).to(query.dtype).view(num_kv_heads, -1, num_tokens)
    return _unfold_query_heads(torch.bmm(probs, value.transpose(0, 1)), num_tokens)


def _fold_query_heads(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[Q, Hq, D]`` -> ``[Hkv, G*Q, D]``: each KV head's query group as extra query rows,
    so GQA needs no repeated K/V (rows are ordered group-major: row = g * Q + q)."""
    num_queries, num_q_heads, head_size = query.shape
    group_size = num_q_heads // num_kv_heads
    return (
        query.view(num_queries, num_kv_heads, group_size, head_size)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group_size * num_queries, head_size)
    )


def _unfold_query_heads(folded: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Inverse of :func:`_fold_query_heads`: ``[Hkv, G*Q, D]`` -> ``[Q, Hq, D]``."""
    num_kv_heads, rows, head_size = folded.shape
    group_size = rows // num_queries
    return (
        folded.view(num_kv_heads, group_size, num_queries, head_size)
        .permute(2, 0, 1, 3)
        .reshape(num_queries, num_kv_heads * group_size, head_size)
    )


@dataclass
class _ContextGather:
    """Which cache blocks to read for a set of sequences, and where their keys sit."""

    # [num_seqs * blocks_per_seq] block ids, row-major per sequence
    block_ids: torch.Tensor
    # [num_seqs, blocks_per_seq * block_size] position of every gathered key slot
    key_positions: torch.Tensor
    # flat indices of the gathered slots that hold none of their sequence's positions (the tail
    # of its last block): what an earlier request left there, zeroed after the gather
    stale_rows: torch.Tensor


@dataclass
class _DecodeGroup:
    """Decode sequences of similar length, attended in one padded call."""

    # [group size] flat token index of each query; None when the group is the whole batch
    token_indices: torch.Tensor | None
    gather: _ContextGather
    # [group size, 1, 1, keys] allowed mask
    mask: torch.Tensor


@dataclass
class _StepPlan:
    """Index tensors derived from one step's metadata, shared by all layers with the same window."""

    # first flat token index of each sequence
    query_starts: list[int]
    decode_groups: list[_DecodeGroup]
    prefill_seq_indices: list[int]


# Splitting decode sequences into another padded group costs about one extra gather + SDPA
# call; it pays when it saves more padding than this many gathered elements (token x head x dim).
_GROUP_OVERHEAD_ELEMENTS = 1 << 17


def _group_by_length(seq_indices: list[int], num_blocks: dict[int, int], elements_per_block: int) -> list[list[int]]:
    """Partition sequences so each group pads to a similar block count: sorted by length,
    a group holds lengths within 2x of its shortest, and a group whose padding to the next
    group's length would cost less than a call of overhead joins that group."""
    groups: list[list[int]] = []
    for index in sorted(seq_indices, key=num_blocks.__getitem__):
        if groups and num_blocks[index] <= 2 * num_blocks[groups[-1][0]]:
            groups[-1].append(index)
        else:
            groups.append([index])
    merged: list[list[int]] = []
    for group in groups:
        if merged:
            shorter = merged[-1]
            padding = len(shorter) * (num_blocks[group[-1]] - num_blocks[shorter[-1]]) * elements_per_block
            if padding < _GROUP_OVERHEAD_ELEMENTS:
                merged[-1] = shorter + group
                continue
        merged.append(group)
    return merged


def _query_starts(query_lens: list[int]) -> list[int]:
    """The first flat token index of each sequence."""
    starts = [0]
    for query_len in query_lens[:-1]:
        starts.append(starts[-1] + query_len)
    return starts


def _plan_context_gather(
    block_tables: torch.Tensor,
    seq_indices: list[int],
    first_positions: list[int],
    seq_lens: list[int],
    block_size: int,
) -> _ContextGather:
    """Blocks holding positions ``first_positions[i] .. seq_lens[i]-1`` of each sequence,
    padded to the same count per sequence (padding re-reads the sequence's own first block and
    is masked out by position)."""
    device = block_tables.device
    first_blocks = torch.tensor([first // block_size for first in first_positions], device=device)
    last_blocks = torch.tensor([(seq_len - 1) // block_size for seq_len in seq_lens], device=device)
    blocks_per_seq = int((last_blocks - first_blocks).max()) + 1
    columns = first_blocks.unsqueeze(1) + torch.arange(blocks_per_seq, device=device)
    # padding reads a block of the sequence's own rather than block 0, which may be another
    # request's: masked reads still take part in the arithmetic (a zero weight times the value)
    read_columns = torch.where(columns <= last_blocks.unsqueeze(1), columns, first_blocks.unsqueeze(1))
    table_rows = block_tables[torch.tensor(seq_indices, device=device)]
    block_ids = table_rows.gather(1, read_columns.clamp(max=table_rows.shape[1] - 1)).to(torch.long).flatten()
    offsets = torch.arange(block_size, device=device)
    key_positions = (columns.unsqueeze(-1) * block_size + offsets).flatten(1)
    # what the read slots hold: positions of the sequence's, unless past its end (a last block's tail)
    read_positions = (read_columns.unsqueeze(-1) * block_size + offsets).flatten(1)
    stale = read_positions >= torch.tensor(seq_lens, device=device).unsqueeze(1)
    return _ContextGather(block_ids=block_ids, key_positions=key_positions, stale_rows=stale.flatten().nonzero()[:, 0])


class TorchPagedAttention:
    """The CPU attention backend: SDPA over K/V gathered block-wise from the paged cache.

    Decode queries of a step are batched: one ``index_select`` per K and V reads every
    sequence's blocks into a padded ``[B, L, Hkv, D]`` workspace and one masked attention
    attends all of them (:func:`_decode_all_heads`; SDPA for a single sequence); sequences of
    very different lengths are split into a few groups of similar length, so short ones are
    not padded to the longest. Each prefill
    (or chunked-prefill) sequence runs its own SDPA call: ``is_causal`` on the new tokens
    when nothing is cached before them, else an explicit mask over the gathered context (also
    when the sequence has ``bidirectional_spans``, whose tokens see each other both ways).

    Masking is by selection, because whatever an earlier request left in a freed block (nan or
    inf from one whose activations overflowed) must never reach the output, and a masked nan
    still turns SDPA's output into nan (its zero weight times nan): the padding of a shorter
    sequence re-reads its own first block, the tail of a sequence's last block past its end is
    zeroed in the gathered copy, and batched decode masks scores with ``masked_fill``.

    Index plans are computed once per step and reused by every layer: the backend keys them
    on the ``AttentionMetadata`` object, so a runner builds a fresh metadata object per step.

    An fp8 cache (with the layer's ``k_scale``/``v_scale``) is read back to the activations'
    dtype block-wise, after the gather.
    """

    supports_fp8_kv_cache = True

    def __init__(self) -> None:
        self._planned_metadata = None
        self._plans: dict[int | None, _StepPlan] = {}
        # reused gather buffer: fresh multi-MB allocations per layer cost more than the copy
        self._workspace: torch.Tensor | None = None
        # reused buffer for a prompt's scores (see _causal_attention_bmm)
        self._scores: torch.Tensor | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key/value [T, Hkv, D]`` -> ``[T, Hq, D]``; writes K/V into
        ``kv_cache`` at ``attn_metadata.slot_mapping`` first (not for bidirectional batches).
        ``k_scale``/``v_scale``: the layer's scales of an fp8 cache."""
        if attn_metadata.bidirectional:
            return self._bidirectional(query, key, value, attn_metadata, scale, sliding_window, logits_soft_cap)
        write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping, k_scale, v_scale)
        plan = self._plan(attn_metadata, sliding_window, kv_cache)
        output = torch.empty_like(query)
        kv_scales = (k_scale, v_scale)
        for group in plan.decode_groups:
            if group.token_indices is None:
                output = self._decode(query, kv_cache, group, scale, logits_soft_cap, kv_scales)
            else:
                output[group.token_indices] = self._decode(
                    query[group.token_indices], kv_cache, group, scale, logits_soft_cap, kv_scales
                )
        self._attend_prefills(
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            plan,
            output,
            scale,
            sliding_window,
            logits_soft_cap,
            kv_scales,
        )
        return output

    __call__ = forward

    def _attend_prefills(
        self,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        plan: _StepPlan,
        output,
        scale,
        sliding_window,
        logits_soft_cap,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        if plan.prefill_seq_indices:
            key, value = kv_as_cached(key, value, kv_cache, *kv_scales)
        for seq_index in plan.prefill_seq_indices:
            self._prefill_sequence(
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                plan.query_starts[seq_index],
                seq_index,
                output,
                scale,
                sliding_window,
                logits_soft_cap,
                kv_scales,
            )

    # -- planning --------------------------------------------------------------------

    def _plan(self, attn_metadata, sliding_window: int | None, kv_cache: torch.Tensor) -> _StepPlan:
        if self._planned_metadata is not attn_metadata:
            self._planned_metadata = attn_metadata
            self._plans = {}
        plan = self._plans.get(sliding_window)
        if plan is None:
            elements_per_block = kv_cache[0, 0].numel()
            plan = self._plans[sliding_window] = self._make_plan(attn_metadata, sliding_window, elements_per_block)
        return plan

    def _make_plan(self, attn_metadata, sliding_window: int | None, elements_per_block: int) -> _StepPlan:
        query_lens, seq_lens = attn_metadata.query_lens_cpu, attn_metadata.seq_lens_cpu
        query_starts = _query_starts(query_lens)
        decode_seqs = [index for index, query_len in enumerate(query_lens) if query_len == 1]
        prefill_seqs = [index for index, query_len in enumerate(query_lens) if query_len > 1]
        if not decode_seqs:
            return _StepPlan(query_starts, [], prefill_seqs)
        block_size = attn_metadata.block_size
        first_positions = {
            index: 0 if sliding_window is None else max(0, seq_lens[index] - sliding_window) for index in decode_seqs
        }
        num_blocks = {
            index: (seq_lens[index] - 1) // block_size - first_positions[index] // block_size + 1
            for index in decode_seqs
        }
        groups = _group_by_length(decode_seqs, num_blocks, elements_per_block)
        if len(groups) == 1:
            groups = [decode_seqs]  # batch order: an all-decode step then needs no scatter
        whole_batch = len(groups) == 1 and len(decode_seqs) == len(query_lens)
        return _StepPlan(
            query_starts,
            [
                self._plan_decode_group(
                    attn_metadata, group, first_positions, sliding_window, query_starts, whole_batch
                )
                for group in groups
            ],
            prefill_seqs,
        )

    @staticmethod
    def _plan_decode_group(attn_metadata, group, first_positions, sliding_window, query_starts, whole_batch):
        device = attn_metadata.block_tables.device
        seq_lens = [attn_metadata.seq_lens_cpu[index] for index in group]
        gather = _plan_context_gather(
            attn_metadata.block_tables,
            group,
            [first_positions[index] for index in group],
            seq_lens,
            attn_metadata.block_size,
        )
        query_positions = torch.tensor(seq_lens, device=device).unsqueeze(1) - 1
        mask = attention_allowed(query_positions, gather.key_positions, causal=True, sliding_window=sliding_window)
        token_indices = None if whole_batch else torch.tensor([query_starts[index] for index in group], device=device)
        return _DecodeGroup(token_indices, gather, mask.unsqueeze(1))

    # -- compute ---------------------------------------------------------------------

    def _scores_buffer(self, query: torch.Tensor, query_len: int, logits_soft_cap: float | None) -> torch.Tensor | None:
        """The buffer for the scores of a causal prompt of ``query_len`` tokens on the native
        two-matmul path (``Hq * query_len**2`` elements at least; the same one from prompt to
        prompt while it is large enough), or None where that path does not run."""
        if (
            query.device.type != "cpu"
            or query.dtype == torch.float32
            or logits_soft_cap is not None
            or not _BMM_CAUSAL_ROWS[0] <= query_len <= _BMM_CAUSAL_ROWS[1]
        ):
            return None
        numel = query.shape[1] * query_len * query_len
        scores = self._scores
        if scores is None or scores.numel() < numel or scores.dtype != query.dtype:
            scores = self._scores = torch.empty(numel, dtype=query.dtype)
        return scores

    def _gather(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, stale_rows: torch.Tensor, zero_stale_keys: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the listed blocks, ``[len(block_ids) * block_size, Hkv, D]`` each, with the
        ``stale_rows`` (slots no query may see) zeroed: values always, keys unless the caller
        masks their scores by selection itself."""
        block_shape = kv_cache.shape[2:]
        numel = block_ids.numel() * block_shape.numel()
        workspace = self._workspace
        if workspace is None or workspace.numel() < 2 * numel or workspace.dtype != kv_cache.dtype:
            workspace = self._workspace = torch.empty(2 * numel, dtype=kv_cache.dtype, device=kv_cache.device)
        keys = workspace[:numel].view(block_ids.numel(), *block_shape)
        values = workspace[numel : 2 * numel].view(block_ids.numel(), *block_shape)
        torch.index_select(kv_cache[0], 0, block_ids, out=keys)
        torch.index_select(kv_cache[1], 0, block_ids, out=values)
        keys, values = keys.flatten(0, 1), values.flatten(0, 1)
        if stale_rows.numel():
            # masking is by selection: a slot a query may not see holds whatever an earlier request
            # left there (a freed block, or block 0 read as padding: possibly nan or inf from a
            # request whose activations overflowed), and its zero softmax weight times nan is nan
            for rows in (keys, values) if zero_stale_keys else (values,):
                if rows.dtype in FP8_KV_CACHE_LIMITS:  # no index_fill_ for fp8 on the CPU
                    rows.index_put_((stale_rows,), torch.zeros((), dtype=rows.dtype, device=rows.device))
                else:
                    rows.index_fill_(0, stale_rows, 0)
        return keys, values

    def _decode(self, query, kv_cache, group: _DecodeGroup, scale, logits_soft_cap, kv_scales) -> torch.Tensor:
        num_seqs, num_q_heads, head_size = query.shape
        num_kv_heads = kv_cache.shape[-2]
        batched = num_seqs > 1 and logits_soft_cap is None  # _decode_all_heads, which selects scores
        keys, values = self._gather(
            kv_cache, group.gather.block_ids, group.gather.stale_rows, zero_stale_keys=not batched
        )
        # [B*L, Hkv, D] -> [B, L, Hkv, D]
        keys = dequantize_kv(keys.view(num_seqs, -1, num_kv_heads, head_size), kv_scales[0], query.dtype)
        values = dequantize_kv(values.view(num_seqs, -1, num_kv_heads, head_size), kv_scales[1], query.dtype)
        if batched:
            return _decode_all_heads(query, keys, values, group.mask[:, 0], scale)
        # one query per sequence: its head group as G query rows of the KV head (SDPA's
        # enable_gqa is several times slower here in bfloat16)
        folded_query = query.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_size)
        output = _attend_folded(
            folded_query,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            scale=scale,
            mask=group.mask,
            logits_soft_cap=logits_soft_cap,
        )
        return output.reshape(num_seqs, num_q_heads, head_size)

    def _prefill_sequence(
        self,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        start,
        seq_index,
        output,
        scale,
        sliding_window,
        logits_soft_cap,
        kv_scales,
    ) -> None:
        """One prefill sequence; ``key``/``value`` are this step's rows as the cache holds them."""
        query_len, seq_len = attn_metadata.query_lens_cpu[seq_index], attn_metadata.seq_lens_cpu[seq_index]
        tokens = slice(start, start + query_len)
        context_len = seq_len - query_len
        spans = _spans_of(attn_metadata, seq_index)
        if context_len == 0 and not spans and (sliding_window is None or sliding_window >= query_len):
            # nothing cached before these tokens and no window cut: plain causal attention
            output[tokens] = _attend_sequence(
                query[tokens],
                key[tokens],
                value[tokens],
                scale=scale,
                mask=None,
                is_causal=True,
                logits_soft_cap=logits_soft_cap,
                scores_buffer=self._scores_buffer(query, query_len, logits_soft_cap),
            )
            return
        first_position = 0 if sliding_window is None else max(0, context_len - sliding_window + 1)
        gather = _plan_context_gather(
            attn_metadata.block_tables, [seq_index], [first_position], [seq_len], attn_metadata.block_size
        )
        query_positions = torch.arange(context_len, seq_len, device=query.device)
        allowed = attention_allowed(
            query_positions,
            gather.key_positions[0],
            causal=True,
            sliding_window=sliding_window,
            bidirectional_spans=spans,
        )
        seq_keys, seq_values = self._gather(kv_cache, gather.block_ids, gather.stale_rows)
        output[tokens] = _attend_sequence(
            query[tokens],
            dequantize_kv(seq_keys, kv_scales[0], query.dtype),
            dequantize_kv(seq_values, kv_scales[1], query.dtype),
            scale=scale,
            mask=allowed,
            is_causal=False,
            logits_soft_cap=logits_soft_cap,
        )

    def _bidirectional(self, query, key, value, attn_metadata, scale, sliding_window, logits_soft_cap) -> torch.Tensor:
        output = torch.empty_like(query)
        start = 0
        for query_len in attn_metadata.query_lens_cpu:
            tokens = slice(start, start + query_len)
            start += query_len
            mask = None
            if sliding_window is not None:
                positions = torch.arange(query_len, device=query.device)
                mask = attention_allowed(positions, positions, causal=False, sliding_window=sliding_window)
            output[tokens] = _attend_sequence(
                query[tokens],
                key[tokens],
                value[tokens],
                scale=scale,
                mask=mask,
                is_causal=False,
                logits_soft_cap=logits_soft_cap,
            )
        return output


def _decode_like_seqs(attn_metadata) -> list[int]:
    """The sequences whose every query row is a decode: one-token queries, and the queries of
    sequences verifying drafts (the pending token then the drafts, nothing else)."""
    query_lens = attn_metadata.query_lens_cpu
    drafts = getattr(attn_metadata, "num_draft_tokens_cpu", None) or [0] * len(query_lens)
    return [index for index, query_len in enumerate(query_lens) if query_len == 1 + drafts[index]]


@dataclass
class _NativeDecodePlan:
    """The decode rows of a step, for the native kernel: one call covers them all."""

    # [num_decode] flat token index of each decode query; None when the step is all decodes
    token_indices: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


class NativeCpuPagedAttention(TorchPagedAttention):
    """:class:`TorchPagedAttention` with decode and the KV-cache write done by tokenloom's CPU
    operators (:mod:`tokenloom.kernels.cpu_native`): each decode query reads its sequence's
    keys and values in place from the cache blocks (no gathered copy, no padding, one call
    per layer for the whole step). A sequence verifying drafts runs as one decode row per query
    token (``AttentionMetadata.num_draft_tokens_cpu``). Prefills keep the torch path. An fp8 cache is read and written
    by the kernels (its scales passed along); any other cache whose dtype is not the
    activations' falls back to the torch path wholesale."""

    def __init__(self, ops=None) -> None:
        super().__init__()
        if ops is None:
            from tokenloom.kernels import cpu_native

            ops = cpu_native.load()
            if ops is None:
                raise ConfigError("tokenloom's CPU kernels are not available: use TorchPagedAttention")
        self._ops = ops
        self._native_metadata = None
        self._native_plan: _NativeDecodePlan | None = None

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        *,
        scale,
        sliding_window=None,
        logits_soft_cap=None,
        k_scale=1.0,
        v_scale=1.0,
    ):
        if (
            attn_metadata.bidirectional
            or kv_cache is None
            or (query.dtype != kv_cache.dtype and not is_fp8_kv_cache(kv_cache))
        ):
            return super().forward(
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                scale=scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        self._ops.write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping, k_scale, v_scale)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        decode = self._decode_plan(attn_metadata)
        if decode is not None:
            whole_batch = decode.token_indices is None
            rows = query if whole_batch else query[decode.token_indices]
            decode_output = output if whole_batch else torch.empty_like(rows)
            self._ops.paged_decode_attention(
                decode_output,
                rows,
                kv_cache,
                decode.block_tables,
                decode.seq_lens,
                scale,
                sliding_window or 0,
                logits_soft_cap or 0.0,
                k_scale,
                v_scale,
            )
            if whole_batch:
                return output
            output[decode.token_indices] = decode_output
        self._attend_prefills(
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            self._plan(attn_metadata, sliding_window, kv_cache),
            output,
            scale,
            sliding_window,
            logits_soft_cap,
            (k_scale, v_scale),
        )
        return output

    __call__ = forward

    def _make_plan(self, attn_metadata, sliding_window, elements_per_block) -> _StepPlan:
        # decodes are the native kernel's: the torch plan keeps only the prefills
        query_lens = attn_metadata.query_lens_cpu
        decode_seqs = set(_decode_like_seqs(attn_metadata))
        return _StepPlan(
            _query_starts(query_lens), [], [index for index in range(len(query_lens)) if index not in decode_seqs]
        )

    def whole_decode_plan(self, attn_metadata) -> _NativeDecodePlan | None:
        """The step's decode plan (``block_tables``, ``seq_lens`` as the kernel takes them) when
        every row of the step is a decode, else None; made once per step."""
        plan = self._decode_plan(attn_metadata)
        return plan if plan is not None and plan.token_indices is None else None

    def _decode_plan(self, attn_metadata) -> _NativeDecodePlan | None:
        if self._native_metadata is not attn_metadata:
            self._native_metadata = attn_metadata
            self._native_plan = self._make_decode_plan(attn_metadata)
        return self._native_plan

    @staticmethod
    def _make_decode_plan(attn_metadata) -> _NativeDecodePlan | None:
        query_lens = attn_metadata.query_lens_cpu
        decode_seqs = _decode_like_seqs(attn_metadata)
        if not decode_seqs:
            return None
        block_tables = attn_metadata.block_tables.to(torch.long)
        seq_lens = attn_metadata.seq_lens.to(torch.long)
        whole_batch = len(decode_seqs) == len(query_lens)
        if whole_batch and all(query_lens[index] == 1 for index in decode_seqs):
            return _NativeDecodePlan(None, block_tables.contiguous(), seq_lens.contiguous())
        # A verifying sequence's query (the pending token and its k drafts) becomes k + 1 decode
        # rows over its block table, row j seeing the cache up to its own position: the KV of all
        # k + 1 tokens is written before attention, so this is exactly causal attention among the
        # new rows over the cached context, and each row is computed as a decode step computes it.
        query_starts = _query_starts(query_lens)
        table_rows: list[int] = []
        token_indices: list[int] = []
        row_seq_lens: list[int] = []
        for index in decode_seqs:
            query_len, seq_len = query_lens[index], attn_metadata.seq_lens_cpu[index]
            table_rows.extend([index] * query_len)
            token_indices.extend(range(query_starts[index], query_starts[index] + query_len))
            row_seq_lens.extend(range(seq_len - query_len + 1, seq_len + 1))
        device = block_tables.device
        return _NativeDecodePlan(
            None if whole_batch else torch.tensor(token_indices, dtype=torch.long, device=device),
            block_tables.index_select(0, torch.tensor(table_rows, device=device)).contiguous(),
            torch.tensor(row_seq_lens, dtype=torch.long, device=device),
        )
