"""GGUF blocks packed for tokenloom's CPU kernels in one native pass: the ``gguf_repack`` operator
(csrc/cpu_moe.cpp, every kernel level) rewrites rows of Q4_K blocks into the layout of
:mod:`tokenloom.kernels.int4_matmul` and rows of Q6_K blocks into that of
:mod:`tokenloom.kernels.kquant_matmul` (the same codes and scales those modules' torch packers
take, no value re-quantized). A Q4_K_M mixture of experts holds gigabytes of such rows
(:mod:`tokenloom.layers.fused_moe` packs them at load); the torch packers' many passes over each
weight took most of its start-up."""

from __future__ import annotations

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import NATIVE_GROUP_SIZE, Int4Weight
from tokenloom.kernels.kquant_matmul import Q6_SUPERBLOCK_GROUPS, KQuantWeight

# ggml's type ids of the blocks gguf_repack takes
GGML_Q4_K, GGML_Q6_K = 12, 14
_ROWS_MULTIPLE, _SUPERBLOCK_VALUES = 16, 256


def repack_gguf_rows(blocks: torch.Tensor, ggml_type: int, rows: int, columns: int) -> Int4Weight | KQuantWeight | None:
    """``rows`` rows of ``columns`` values stored as ``blocks`` (the file's bytes, uint8) packed for
    int4_linear (Q4_K) or int6_linear (Q6_K); None for another type, a shape the layouts do not
    take (rows a multiple of 16, whole blocks of 256), or where the kernels are not built."""
    ops = cpu_native.load()
    if ops is None or ggml_type not in (GGML_Q4_K, GGML_Q6_K) or rows % _ROWS_MULTIPLE or columns % _SUPERBLOCK_VALUES:
        return None
    packed = ops.gguf_repack(blocks.contiguous().view(-1), ggml_type, rows, columns)
    if ggml_type == GGML_Q4_K:
        return Int4Weight(packed, rows, NATIVE_GROUP_SIZE, torch.bfloat16, kernel=ops.int4_linear)
    return KQuantWeight(packed, rows, 6, Q6_SUPERBLOCK_GROUPS, ops.int6_linear)
