"""Spans that attend both ways inside a causal prefill (``AttentionMetadata.bidirectional_spans``:
a Gemma 3 image's tokens): the reference and both CPU backends against textbook attention whose
mask is transformers' for Gemma 3 (window AND (causal OR same span)), with and without a cached
prefix, beside decodes, with GQA and sliding windows shorter than a span."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.test_paged_attention import make_step
from tokenloom.kernels.paged_attention import (
    NativeCpuPagedAttention,
    TorchPagedAttention,
    attention_allowed,
    reference_paged_attention,
)

pytestmark = pytest.mark.usefixtures("isa_level")

# per sequence (context_len, query_len) and its spans, as absolute positions
STEPS = [
    ([(0, 14), (5, 1)], [[(3, 11)], []]),  # a prompt with one image, beside a decode
    ([(4, 12), (0, 9)], [[(6, 14)], [(1, 4), (4, 8)]]),  # a chunk after a cached prefix; two adjacent images
]


def dense_attention(query, keys, values, query_positions, spans, *, scale, window):
    """Textbook attention over a whole sequence with Gemma 3's image mask, written out per pair."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    bias = torch.zeros(len(query_positions), keys.shape[0])
    for row, position in enumerate(query_positions):
        for column in range(keys.shape[0]):
            same_span = any(start <= position < end and start <= column < end for start, end in spans)
            visible = (column <= position or same_span) and (window is None or column > position - window)
            if not visible:
                bias[row, column] = float("-inf")
    return torch.einsum("hqk,khd->qhd", (scores + bias).softmax(-1), values)


@pytest.mark.parametrize("step", STEPS, ids=["prompt-and-decode", "chunk-after-prefix"])
@pytest.mark.parametrize("window", [None, 3, 5])
@pytest.mark.parametrize("backend", ["reference", "torch", "native"])
def test_spans_attend_both_ways_as_transformers_masks_them(step, window, backend):
    specs, spans = step
    sequences, kv_cache, metadata, (query, key, value) = make_step(specs, 8, 2, 16, torch.float32, 3)
    metadata = dataclasses.replace(metadata, bidirectional_spans=spans)
    if backend == "reference":
        output = reference_paged_attention(query, key, value, kv_cache, metadata, scale=0.25, sliding_window=window)
    else:
        backend_class = TorchPagedAttention if backend == "torch" else NativeCpuPagedAttention
        output = backend_class().forward(query, key, value, kv_cache, metadata, scale=0.25, sliding_window=window)
    start = 0
    for (context_len, query_len, queries, keys, values), seq_spans in zip(sequences, spans, strict=True):
        positions = list(range(context_len, context_len + query_len))
        expected = dense_attention(queries[context_len:], keys, values, positions, seq_spans, scale=0.25, window=window)
        torch.testing.assert_close(output[start : start + query_len], expected, atol=2e-6, rtol=2e-5)
        start += query_len


def test_a_span_lets_its_first_token_see_its_last_and_a_window_still_cuts_far_keys():
    positions = torch.arange(8)
    allowed = attention_allowed(positions, positions, causal=True, sliding_window=3, bidirectional_spans=[(2, 7)])
    assert allowed[2, 6] and not allowed[2, 7]  # the span's first token sees its last, whatever the window...
    assert allowed[6, 4] and not allowed[6, 3]  # ...and behind, the last 3 positions as always
    assert not allowed[1, 2] and not allowed[6, 7]  # outside the span: causal
