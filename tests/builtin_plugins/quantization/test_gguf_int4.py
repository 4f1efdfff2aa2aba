"""GGML 4-bit blocks rewritten as group-wise affine int4: the same values as the dequantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tests.builtin_plugins.quantization.test_gguf_blocks import random_blocks
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGUFWeight
from tokenloom.builtin_plugins.quantization.gguf_int4 import int4_groups, is_int4_type
from tokenloom.kernels.int4_matmul import dequantize_int4


@pytest.mark.parametrize(
    "quant_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K]
)
def test_codes_scales_and_zeros_give_the_dequantized_values(quant_type):
    if quant_type == GGMLQuantizationType.Q4_K:  # gguf cannot quantize to Q4_K: random valid blocks
        packed = random_blocks(int(quant_type), num_blocks=12, seed=3).reshape(6, -1)
    else:
        values = np.random.default_rng(int(quant_type)).normal(size=(6, 512)).astype(np.float32)
        packed = quantize(values, quant_type)
    weight = GGUFWeight(torch.from_numpy(packed.copy()), int(quant_type), (6, 512))
    codes, scales, zeros = int4_groups(weight)
    assert codes.shape == (6, 512) and scales.shape == zeros.shape == (6, 16)
    assert int(codes.max()) <= 15
    torch.testing.assert_close(dequantize_int4(codes, scales, zeros), weight.dequantize(), atol=1e-5, rtol=1e-5)


def test_other_types_are_not_4_bit_blocks():
    assert not is_int4_type(int(GGMLQuantizationType.Q8_0))
    weight = GGUFWeight(torch.zeros(1, 34, dtype=torch.uint8), int(GGMLQuantizationType.Q8_0), (1, 32))
    with pytest.raises(ValueError, match="Q8_0"):
        int4_groups(weight)
