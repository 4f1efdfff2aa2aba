"""The GGML block dequantizers against gguf-py's reference, and GGUFWeight's row operations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from tokenloom.builtin_plugins.quantization import gguf_blocks
from tokenloom.builtin_plugins.quantization.gguf_blocks import GGUFWeight, dequantize_blocks
from tokenloom.errors import ModelLoadError

# byte offsets of each type's fp16 scale fields: random bytes there could be NaN/inf
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def random_blocks(ggml_type: int, num_blocks: int, seed: int) -> np.ndarray:
    name, _, block_bytes = gguf_blocks.GGML_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[name]:
        scales = rng.normal(scale=0.05, size=num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks


@pytest.mark.parametrize("ggml_type", sorted(gguf_blocks.DEQUANTIZERS), ids=gguf_blocks.type_name)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantizer_matches_gguf_reference_bit_for_bit(ggml_type, seed):
    _, block_values, _ = gguf_blocks.GGML_TYPES[ggml_type]
    blocks = random_blocks(ggml_type, num_blocks=96, seed=seed)
    expected = reference_dequantize(blocks.reshape(-1), GGMLQuantizationType(ggml_type)).reshape(-1)
    actual = dequantize_blocks(torch.from_numpy(blocks.copy()), ggml_type, (96 * block_values,)).numpy()
    np.testing.assert_array_equal(actual, expected)


def test_every_type_the_brief_requires_is_supported():
    names = {gguf_blocks.type_name(t) for t in gguf_blocks.SUPPORTED_TYPES}
    assert {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "F32", "BF16"} <= names


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantize_inverts_reference_quantize_within_the_type_precision(name):
    ggml_type = GGMLQuantizationType[name]
    rng = np.random.default_rng(3)
    values = rng.normal(size=(8, 64)).astype(np.float32)
    packed = reference_quantize(values, ggml_type)
    restored = dequantize_blocks(torch.from_numpy(packed.copy()), int(ggml_type), values.shape).numpy()
    bits = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}[name]
    block_range = np.abs(values).reshape(-1, 32).max(axis=1).repeat(32).reshape(values.shape) * 2
    assert np.all(np.abs(restored - values) <= block_range / (2**bits - 1) + 1e-6)


def test_large_tensors_are_dequantized_in_chunks_with_the_same_result(monkeypatch):
    blocks = random_blocks(gguf_blocks.Q4_K, num_blocks=40, seed=5)
    whole = dequantize_blocks(torch.from_numpy(blocks.copy()), gguf_blocks.Q4_K, (40, 256))
    monkeypatch.setattr(gguf_blocks, "_BLOCKS_PER_CHUNK", 7)
    chunked = dequantize_blocks(torch.from_numpy(blocks.copy()), gguf_blocks.Q4_K, (40, 256))
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("ggml_type", sorted(gguf_blocks.DEQUANTIZERS), ids=gguf_blocks.type_name)
def test_blocks_at_an_odd_byte_offset_or_strided_dequantize_the_same(ggml_type):
    # the dequantizers read fp16 scales through a view when the bytes allow it, and copy otherwise
    _, block_values, block_bytes = gguf_blocks.GGML_TYPES[ggml_type]
    blocks = torch.from_numpy(random_blocks(ggml_type, num_blocks=12, seed=7))
    expected = gguf_blocks.DEQUANTIZERS[ggml_type](blocks.clone())
    shifted = torch.empty(blocks.numel() + 1, dtype=torch.uint8)
    shifted[1:] = blocks.reshape(-1)
    wide = torch.zeros(12, block_bytes + 2, dtype=torch.uint8)
    wide[:, :block_bytes] = blocks
    for layout in (shifted[1:].view(12, block_bytes), wide[:, :block_bytes]):
        assert torch.equal(gguf_blocks.DEQUANTIZERS[ggml_type](layout), expected)
    assert expected.shape == (12, block_values)


def test_float_types_pass_through_and_convert_to_the_requested_dtype():
    values = torch.randn(4, 8)
    for ggml_type, dtype in gguf_blocks.FLOAT_TYPES.items():
        raw = values.to(dtype).contiguous().view(torch.uint8)
        out = dequantize_blocks(raw, ggml_type, (4, 8), torch.float32)
        assert torch.equal(out, values.to(dtype).float())
    assert dequantize_blocks(values.view(torch.uint8), gguf_blocks.F32, (4, 8), torch.bfloat16).dtype == torch.bfloat16


def packed_weight(rows: int, cols: int, seed: int = 0) -> tuple[GGUFWeight, np.ndarray]:
    values = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    packed = reference_quantize(values, GGMLQuantizationType.Q8_0)
    weight = GGUFWeight(torch.from_numpy(packed.copy()), gguf_blocks.Q8_0, (rows, cols), name="blk.0.attn_q.weight")
    return weight, packed


def test_gguf_weight_dequantizes_to_the_logical_shape_and_dtype():
    weight, packed = packed_weight(6, 64)
    expected = reference_dequantize(packed, GGMLQuantizationType.Q8_0)
    assert weight.shape == torch.Size([6, 64]) and weight.type_name == "Q8_0"
    assert torch.equal(weight.dequantize(), torch.from_numpy(expected))
    assert weight.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_row_permutation_and_narrowing_act_on_packed_rows_like_on_dense_rows():
    weight, _ = packed_weight(6, 64)
    dense = weight.dequantize()
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    assert torch.equal(weight.permute_rows(order).dequantize(), dense[order])
    narrowed = weight.narrow_rows(2, 3)
    assert narrowed.shape == torch.Size([3, 64])
    assert torch.equal(narrowed.dequantize(), dense[2:5])


def test_unsupported_type_raises_naming_the_tensor_the_file_and_the_type():
    iq4 = int(GGMLQuantizationType.IQ4_NL)
    weight = GGUFWeight(
        torch.zeros(2, 18, dtype=torch.uint8), iq4, (2, 32), name="blk.3.ffn_up.weight", path="/models/x.gguf"
    )
    assert not weight.is_supported
    with pytest.raises(ModelLoadError) as error:
        weight.dequantize()
    message = str(error.value)
    assert "blk.3.ffn_up.weight" in message and "/models/x.gguf" in message and "IQ4_NL" in message
    assert "Q4_K" in message  # lists what is supported


def test_tensor_nbytes_rejects_rows_that_are_not_whole_blocks():
    assert gguf_blocks.tensor_nbytes(gguf_blocks.Q4_K, (2, 512)) == 2 * 2 * 144
    with pytest.raises(ModelLoadError, match="not a whole number of Q4_K blocks"):
        gguf_blocks.tensor_nbytes(gguf_blocks.Q4_K, (2, 100), tensor_name="t", path="f.gguf")
    with pytest.raises(ModelLoadError, match="unknown ggml type 99"):
        gguf_blocks.tensor_nbytes(99, (2, 32))


def test_column_narrowing_cuts_whole_blocks_of_every_row():
    weight, _ = packed_weight(6, 128)
    dense = weight.dequantize()
    narrowed = weight.narrow_columns(32, 64)
    assert narrowed.shape == torch.Size([6, 64]) and narrowed.data.shape == (6, 2 * 34)
    assert torch.equal(narrowed.dequantize(), dense[:, 32:96])


def test_a_column_shard_inside_a_block_is_an_error_naming_the_tensor():
    weight, _ = packed_weight(6, 128)
    with pytest.raises(ModelLoadError) as error:
        weight.narrow_columns(16, 64)
    message = str(error.value)
    assert "blk.0.attn_q.weight" in message and "Q8_0" in message and "16:80" in message
    assert "--tensor-parallel-size" in message
    with pytest.raises(ModelLoadError, match="no columns"):
        weight.narrow_columns(96, 64)
