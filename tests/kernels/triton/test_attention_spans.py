"""A step whose prompt holds spans that attend both ways (``bidirectional_spans``: a Gemma 3
image) goes from the Triton backend to the torch one, whose prefill masks them: the same
output as the torch reference, and the cache written."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the `gpu` extra)")

from tests.kernels.triton.test_attention import make_step  # noqa: E402
from tokenloom.kernels.paged_attention import reference_paged_attention  # noqa: E402
from tokenloom.kernels.triton.attention import TritonPagedAttention  # noqa: E402


def test_a_step_with_bidirectional_spans_matches_the_reference():
    query, key, value, cache, metadata = make_step([(0, 20), (4, 1)], 4, 2, 64, torch.float32, seed=3)
    metadata = dataclasses.replace(metadata, bidirectional_spans=[[(5, 15)], []])
    reference_cache = cache.clone()
    expected = reference_paged_attention(
        query, key, value, reference_cache, dataclasses.replace(metadata, kv_caches=[reference_cache]), scale=0.125
    )
    output = TritonPagedAttention().forward(query, key, value, cache, metadata, scale=0.125)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, reference_cache)
