"""Linear weights pre-packed for oneDNN's CPU matmul (``mkldnn._reorder_linear_weight`` and
``mkldnn._linear_pointwise``, the pair torch.compile's freezing pass uses).

``torch.nn.functional.linear`` hands oneDNN a plain row-major weight and oneDNN reorders it into
its blocked layout on every call; a weight reordered once at load skips that (figures in
docs/design.md, "Compute on the CPU"). The packed layout does not depend on the batch size it
was packed for, and float32 gains as much as bfloat16.
"""

from __future__ import annotations

import torch

# dtypes oneDNN multiplies natively here (float16 has no fast CPU kernel without AVX512-FP16)
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (``[out_features, in_features]``) can be packed for oneDNN here."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.is_mkldnn or weight.dtype not in _PACKABLE_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in oneDNN's blocked layout: an opaque (``torch._mkldnn``) tensor of the same
    shape and dtype; ``.to_dense()`` gives the values back exactly."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., in_features] @ W.T + bias`` with ``W`` packed by :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
