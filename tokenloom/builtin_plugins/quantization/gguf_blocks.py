"""GGML block formats: sizes, vectorised torch dequantizers, and :class:`GGUFWeight`, the packed
tensor the GGUF load format yields for quantized weights.

Each dequantizer takes ``[num_blocks, bytes_per_block]`` uint8 and returns
``[num_blocks, values_per_block]`` float32, computed in the same order of float operations
as ggml's reference (and ``gguf.quants``), so results match bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenloom.builtin_plugins.quantization.ggml_types import (  # noqa: F401  (re-exported)
    BF16,
    F16,
    F32,
    GGML_TYPES,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    tensor_nbytes,
    type_name,
)
from tokenloom.errors import ModelLoadError
from tokenloom.kernels.int8_matmul import pack_int8

FLOAT_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}

# blocks dequantized per step: bounds the temporaries to a few tens of MB
_BLOCKS_PER_CHUNK = 1 << 15


# -- dequantizers ------------------------------------------------------------------------------


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte ``start`` of each block, as ``[num_blocks, 1]`` float32."""
    if (
        start % 2 == 0
        and blocks.shape[1] % 2 == 0
        and blocks.storage_offset() % 2 == 0
        and blocks.stride() == (blocks.shape[1], 1)
    ):
        # read in place through a float16 view of whole blocks rather than copying the two bytes out
        return blocks.view(torch.float16)[:, start // 2 : start // 2 + 1].float()
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit layout: a block's first half of values in the low nibbles, second half in the high."""
    num_blocks, half = packed.shape
    values = torch.empty(num_blocks, 2 * half, dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=values[:, :half])
    torch.bitwise_right_shift(packed, 4, out=values[:, half:])
    return values


def _int8(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes ``start:stop`` of each block read as int8 (a view when the blocks are contiguous)."""
    if blocks.stride() == (blocks.shape[1], 1):
        return blocks.view(torch.int8)[:, start:stop]
    return blocks[:, start:stop].contiguous().view(torch.int8)


def _high_bits(qh: torch.Tensor, num_values: int) -> torch.Tensor:
    """Bit i of the little-endian bytes ``qh`` for i in range(num_values), as uint8 0/1."""
    bit = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> bit) & 1).reshape(qh.shape[0], -1)[:, :num_values]


# The dequantizers below update their largest temporary in place (``q.mul_(d)`` is ``d * q``
# bit for bit): the float operations, and their order, stay ggml's.


def _dequantize_q4_0(blocks):
    return _nibbles(blocks[:, 2:18]).float().sub_(8).mul_(_f16(blocks, 0))


def _dequantize_q4_1(blocks):
    return _nibbles(blocks[:, 4:20]).float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _dequantize_q5_0(blocks):
    q = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6], 32) << 4)
    return _f16(blocks, 0) * (q.float() - 16)


def _dequantize_q5_1(blocks):
    q = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8], 32) << 4)
    return _f16(blocks, 0) * q.float() + _f16(blocks, 2)


def _dequantize_q8_0(blocks):
    return _int8(blocks, 2, 34).float().mul_(_f16(blocks, 0))


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in 12 bytes (Q4_K, Q5_K)."""
    low_scales, low_mins, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_scales & 63, (extra & 0x0F) | ((low_scales >> 6) << 4)], dim=1)
    mins = torch.cat([low_mins & 63, (extra >> 4) | ((low_mins >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _split_32s(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Fields of ``num_bits`` bits, read from successive 32-byte groups lowest bits first:
    ``[nb, 32*k]`` -> ``[nb, k * (8 // num_bits) * 32]`` in ggml's value order."""
    grouped = packed.reshape(packed.shape[0], -1, 1, 32)
    mask = (1 << num_bits) - 1
    # one scalar shift per field (a broadcast tensor of shifts is several times slower on uint8)
    fields = [(grouped >> shift) & mask for shift in range(0, 8, num_bits)]
    return torch.cat(fields, dim=2).reshape(packed.shape[0], -1)


def _dequantize_q4_k(blocks):
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * scales).unsqueeze(-1)
    offset = (_f16(blocks, 2) * mins).unsqueeze(-1)
    q = _split_32s(blocks[:, 16:144], 4).view(-1, 8, 32).float()
    return (scale * q - offset).reshape(blocks.shape[0], 256)


def _dequantize_q5_k(blocks):
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * scales).unsqueeze(-1)
    offset = (_f16(blocks, 2) * mins).unsqueeze(-1)
    low = _split_32s(blocks[:, 48:176], 4)
    high = _split_32s(blocks[:, 16:48], 1)
    q = (low | (high << 4)).view(-1, 8, 32).float()
    return (scale * q - offset).reshape(blocks.shape[0], 256)


def _dequantize_q6_k(blocks):
    num_blocks = blocks.shape[0]
    # per half of 128 values: low nibbles of ql[0:32] and ql[32:64], then the high nibbles of both
    low = _split_32s(blocks[:, 0:128], 4).view(num_blocks, 2, 2, 2, 32).transpose(2, 3).reshape(num_blocks, 256)
    high = _split_32s(blocks[:, 128:192], 2)
    q = ((low | (high << 4)).to(torch.int8) - 32).view(num_blocks, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    return ((_f16(blocks, 208) * scales).unsqueeze(-1) * q).reshape(num_blocks, 256)


def _dequantize_q2_k(blocks):
    scales = blocks[:, 0:16]
    scale = (_f16(blocks, 80) * (scales & 0x0F).float()).unsqueeze(-1)
    offset = (_f16(blocks, 82) * (scales >> 4).float()).unsqueeze(-1)
    q = _split_32s(blocks[:, 16:80], 2).view(-1, 16, 16).float()
    return (scale * q - offset).reshape(blocks.shape[0], 256)


def _dequantize_q3_k(blocks):
    num_blocks = blocks.shape[0]
    packed_scales = blocks[:, 96:108]
    low = torch.cat([packed_scales[:, 0:8] & 0x0F, packed_scales[:, 0:8] >> 4], dim=1)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(1, -1, 1)
    high = ((packed_scales[:, 8:12].unsqueeze(1) >> shifts) & 3).reshape(num_blocks, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    q_low = _split_32s(blocks[:, 32:96], 2).to(torch.int8)
    # a value's high bit lives in hmask[l % 32] at bit l // 32; a clear bit subtracts 4
    shifts = torch.arange(8, dtype=torch.uint8).view(1, -1, 1)
    high_bit = ((blocks[:, 0:32].unsqueeze(1) >> shifts) & 1).reshape(num_blocks, 256).to(torch.int8)
    q = (q_low - ((high_bit ^ 1) << 2)).view(num_blocks, 16, 16).float()
    return ((_f16(blocks, 108) * scales).unsqueeze(-1) * q).reshape(num_blocks, 256)


DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q4_0: _dequantize_q4_0,
    Q4_1: _dequantize_q4_1,
    Q5_0: _dequantize_q5_0,
    Q5_1: _dequantize_q5_1,
    Q8_0: _dequantize_q8_0,
    Q2_K: _dequantize_q2_k,
    Q3_K: _dequantize_q3_k,
    Q4_K: _dequantize_q4_k,
    Q5_K: _dequantize_q5_k,
    Q6_K: _dequantize_q6_k,
}

SUPPORTED_TYPES = sorted(set(DEQUANTIZERS) | set(FLOAT_TYPES))


def supported_type_names() -> str:
    return ", ".join(type_name(t) for t in SUPPORTED_TYPES)


def dequantize_blocks(
    data: torch.Tensor,
    ggml_type: int,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    tensor_name: str = "",
    path: str = "",
) -> torch.Tensor:
    """Raw GGUF bytes of one tensor -> a dense ``shape`` tensor of ``dtype``."""
    data = data.reshape(-1)
    if ggml_type in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[ggml_type]).reshape(shape).to(dtype)
    dequantizer = DEQUANTIZERS.get(ggml_type)
    if dequantizer is None:
        where = f"tensor {tensor_name!r}" + (f" of {path}" if path else "") if tensor_name else "a tensor"
        raise ModelLoadError(
            f"{where} is stored as GGML type {type_name(ggml_type)}, which the gguf quantization "
            f"method cannot dequantize; supported types: {supported_type_names()}"
        )
    _, block_values, block_bytes = GGML_TYPES[ggml_type]
    blocks = data.view(-1, block_bytes)
    out = torch.empty(blocks.shape[0], block_values, dtype=dtype)
    for start in range(0, blocks.shape[0], _BLOCKS_PER_CHUNK):
        chunk = blocks[start : start + _BLOCKS_PER_CHUNK]
        out[start : start + chunk.shape[0]] = dequantizer(chunk)
    return out.view(shape)


@dataclass
class GGUFWeight:
    """A quantized checkpoint tensor, still packed: what the GGUF load format yields.

    ``data`` is ``[rows, bytes_per_row]`` uint8 (usually a view of the memory-mapped file);
    ``shape`` is the logical ``[out, in]`` shape. Rows are whole blocks, so row slicing and
    row permutation work on the packed bytes.
    """

    data: torch.Tensor
    ggml_type: int
    shape: torch.Size
    name: str = ""  # the GGUF tensor name, for error messages
    path: str = ""  # the file it came from, for error messages
    # drops the file's pages behind the tensor from memory (a view of a memory-mapped file: the
    # load format's GGUFFile.release_pages); called by a layer that has packed or dequantized
    # the tensor into memory of its own. Weights cut from this one keep it: it frees their source
    release: Callable[[], None] | None = None

    def __post_init__(self):
        self.shape = torch.Size(self.shape)

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def is_supported(self) -> bool:
        return self.ggml_type in DEQUANTIZERS or self.ggml_type in FLOAT_TYPES

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(
            self.data, self.ggml_type, tuple(self.shape), dtype, tensor_name=self.name, path=self.path
        )

    def int8_groups(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Q8_0 only: the int8 codes ``[rows, cols]`` and the float32 scale of each 32 of them
        ``[rows, cols / 32]``, exactly as stored (for :mod:`tokenloom.kernels.int8_matmul`);
        None for any other type."""
        if self.ggml_type != Q8_0:
            return None
        rows, cols = self.shape
        blocks = self.data.reshape(-1, 34)
        return _int8(blocks, 2, 34).reshape(rows, cols), _f16(blocks, 0).reshape(rows, cols // 32)

    def dequantize_rows(self, row_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``row_ids`` (any shape of ids) dequantized: ``[*row_ids.shape, cols]``, equal to
        those rows of :meth:`dequantize` (an embedding's lookup, without a dense table)."""
        picked = self.data.index_select(0, row_ids.reshape(-1))
        values = dequantize_blocks(
            picked, self.ggml_type, (picked.shape[0], self.shape[-1]), dtype, tensor_name=self.name, path=self.path
        )
        return values.view(*row_ids.shape, self.shape[-1])

    def kernel_weight(self) -> Any:
        """The rows packed for one of tokenloom's CPU kernels that multiplies this type in its own
        codes and returns float32 (an LM head's logits): an ``Int8Weight`` for Q8_0, a
        ``KQuantWeight`` for Q5_0, Q5_1, Q5_K and Q6_K, a ``LowbitWeight`` for Q2_K and Q3_K; None
        for other types, or where the kernel is not built or the shape does not suit it."""
        # (imported here: the packers read the blocks through this module)
        from tokenloom.builtin_plugins.quantization.gguf_kquant import KQUANT_TYPES, pack_kquant
        from tokenloom.builtin_plugins.quantization.gguf_lowbit import LOWBIT_TYPES, pack_lowbit

        if self.ggml_type == Q8_0:
            return pack_int8(*self.int8_groups())
        if self.ggml_type in LOWBIT_TYPES:
            return pack_lowbit([self])
        return pack_kquant([self]) if self.ggml_type in KQUANT_TYPES else None

    def rows_in(self, kernel_weight: Any) -> PackedRows | None:
        """A lookup of these rows that reads them back out of ``kernel_weight`` (what
        :meth:`kernel_weight` made of them: a tied LM head's codes), so an embedding needs no
        copy of the file's blocks beside the head's; None where the type has no way back (Q6_K
        and Q8_0 have: ``gguf_unpack_rows``, csrc/cpu_gguf_pack.cpp)."""
        if self.ggml_type not in (Q6_K, Q8_0) or kernel_weight is None:
            return None
        from tokenloom.kernels import cpu_native

        ops = cpu_native.load()
        if ops is None or not hasattr(ops, "gguf_unpack_rows"):
            return None
        return PackedRows(kernel_weight.packed, self.ggml_type, self.shape, ops.gguf_unpack_rows, self.name, self.path)

    def padded_rows(self, rows: int) -> GGUFWeight:
        """Zero rows appended up to ``rows`` (the last tensor-parallel shard of a vocabulary):
        zero bytes are zero values in every block type."""
        padding = rows - self.shape[0]
        if padding <= 0:
            return self
        data = torch.cat([self.data, self.data.new_zeros(padding, self.data.shape[1])])
        return GGUFWeight(data, self.ggml_type, torch.Size((rows, *self.shape[1:])), self.name, self.path, self.release)

    def permute_rows(self, row_order: torch.Tensor) -> GGUFWeight:
        """Rows reordered (``new[i] = old[row_order[i]]``); copies the packed bytes once."""
        return GGUFWeight(
            self.data.index_select(0, row_order), self.ggml_type, self.shape, self.name, self.path, self.release
        )

    def narrow_rows(self, start: int, length: int) -> GGUFWeight:
        """Rows ``start:start+length`` (a tensor-parallel shard, or one part of a fused weight)."""
        return GGUFWeight(
            self.data[start : start + length],
            self.ggml_type,
            torch.Size((length, *self.shape[1:])),
            self.name,
            self.path,
            self.release,
        )

    def narrow_columns(self, start: int, length: int) -> GGUFWeight:
        """Input columns ``start:start+length`` of every row (a row-parallel shard), cut from
        the packed bytes: the range must cover whole quantization blocks; a boundary inside a
        block is an error naming the tensor (its blocks cannot be split without re-quantizing)."""
        _, block_values, block_bytes = GGML_TYPES[self.ggml_type]
        columns = self.shape[-1]
        if start < 0 or length < 0 or start + length > columns:
            raise ModelLoadError(f"GGUF tensor {self.name!r} of {self.path} has no columns {start}:{start + length}")
        if start % block_values or length % block_values:
            raise ModelLoadError(
                f"GGUF tensor {self.name!r} of {self.path} is stored as {self.type_name} in blocks of {block_values} "
                f"values per row: a tensor-parallel shard of columns {start}:{start + length} starts or ends inside "
                "a block; choose a --tensor-parallel-size whose shards cover whole blocks"
            )
        byte_start, byte_length = start // block_values * block_bytes, length // block_values * block_bytes
        return GGUFWeight(
            self.data[:, byte_start : byte_start + byte_length].contiguous(),
            self.ggml_type,
            torch.Size((*self.shape[:-1], length)),
            self.name,
            self.path,
            self.release,
        )

    def __repr__(self) -> str:
        return f"GGUFWeight(name={self.name!r}, type={self.type_name}, shape={tuple(self.shape)})"


@dataclass
class PackedRows:
    """The rows of a GGUF tensor as a kernel's packed weight holds them (:meth:`GGUFWeight.rows_in`):
    ``dequantize_rows`` unpacks the looked-up rows to the file's blocks, byte for byte, and
    dequantizes those, so it returns what the file's blocks would."""

    packed: torch.Tensor
    ggml_type: int
    shape: torch.Size
    unpack: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    name: str = ""
    path: str = ""

    def dequantize_rows(self, row_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``row_ids`` (any shape of ids) dequantized: ``[*row_ids.shape, cols]``."""
        blocks = self.unpack(self.packed, row_ids.reshape(-1).to(torch.int64), self.ggml_type)
        values = dequantize_blocks(
            blocks, self.ggml_type, (blocks.shape[0], self.shape[-1]), dtype, tensor_name=self.name, path=self.path
        )
        return values.view(*row_ids.shape, self.shape[-1])
