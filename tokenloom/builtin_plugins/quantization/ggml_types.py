"""GGML tensor types: ids, names and block sizes, and the byte size of a tensor. Pure Python, so
the GGUF reader (and plugin registration) need no torch."""

from __future__ import annotations

from math import prod

from tokenloom.errors import ModelLoadError

# ggml type ids (enum ggml_type in ggml.h)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
BF16 = 30

# every type a GGUF can hold: id -> (name, values per block, bytes per block); used to size tensors
# even of types we cannot dequantize, so such a file still opens and the error names the tensor
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}


def type_name(ggml_type: int) -> str:
    return GGML_TYPES.get(ggml_type, (f"type {ggml_type}",))[0]


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...], *, tensor_name: str = "", path: str = "") -> int:
    """Bytes a tensor of this type and shape occupies in a GGUF file."""
    where = f"tensor {tensor_name!r} of {path}" if tensor_name else "a tensor"
    if ggml_type not in GGML_TYPES:
        raise ModelLoadError(f"{where} has unknown ggml type {ggml_type}; this GGUF needs a newer tokenloom")
    _, block_values, block_bytes = GGML_TYPES[ggml_type]
    row_length = shape[-1] if shape else 1
    if row_length % block_values:
        raise ModelLoadError(
            f"{where}: rows of {row_length} values are not a whole number of {type_name(ggml_type)} "
            f"blocks of {block_values}; the file is corrupt"
        )
    return prod(shape) // block_values * block_bytes
