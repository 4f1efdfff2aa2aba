"""A fast, memory-mapped GGUF reader: metadata, the tensor table, and zero-copy tensor bytes.

``gguf.GGUFReader`` turns every element of every metadata array into a numpy object, which
costs seconds on a 262k-token vocabulary; this reader skips string arrays nobody asked for
and reads numeric arrays as numpy views, so opening a file takes milliseconds.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from tokenloom.builtin_plugins.quantization.ggml_types import tensor_nbytes
from tokenloom.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml tensors have at most four dimensions (GGML_MAX_DIMS)
MAX_TENSOR_DIMS = 4

# GGUF metadata value types (gguf.GGUFValueType): scalar struct formats, and numpy dtypes for arrays
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class SkippedStringArray:
    """A string array that was not decoded (only its length is known); ask for it by key."""

    count: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table."""

    name: str
    shape: tuple[int, ...]  # torch order: the last dimension is the contiguous one
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def num_elements(self) -> int:
        return prod(self.shape)


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> value), ``tensors`` (name -> info) and ``tensor_data``.

    Opening reads the header only; tensor bytes stay on disk until touched.
    """

    def __init__(self, path: str, *, string_arrays: Iterable[str] = ()):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ModelLoadError(f"GGUF file {self.path} does not exist")
        self._wanted_string_arrays = set(string_arrays)
        try:
            with open(self.path, "rb") as handle:
                # the header is parsed from a plain mmap: slicing it yields bytes fastest
                self._header = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            # copy-on-write: torch can wrap the pages without a read-only warning, and nothing is copied
            self._mapped = np.memmap(self.path, dtype=np.uint8, mode="c")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot memory-map GGUF file {self.path}: {exc}") from exc
        try:
            self._parse()
        except ModelLoadError:
            raise
        except (struct.error, UnicodeDecodeError, IndexError, ValueError, OverflowError, MemoryError, TypeError) as exc:
            # a file from anywhere must fail as a load error naming itself, whatever its bytes
            raise ModelLoadError(
                f"GGUF file {self.path} is truncated or corrupt ({type(exc).__name__}: {exc}); "
                "download or assemble it again"
            ) from exc
        finally:
            self._header.close()

    # -- public ------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}``, e.g. ``arch_get("block_count")``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw_metadata(self, key: str) -> np.ndarray:
        """The bytes of one key-value entry as stored in the file (key, type and value; a
        skipped string array too), as a uint8 view of the mapping: what a cache keys on."""
        start, end = self.metadata_spans[key]
        return self._mapped[start:end]

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's raw bytes as a uint8 view of the mapping (no copy)."""
        return self._mapped[info.offset : info.offset + info.nbytes]

    def release_pages(self, info: GGUFTensorInfo) -> None:
        """Drop the pages wholly inside the tensor's bytes from this process's memory, once they
        are packed into memory of their own: the mapping stays, and a later read faults them in
        again from the page cache. (Nothing writes into the copy-on-write mapping, so no page
        holds bytes the file lacks.) Without this, every page packing read stays resident for as
        long as any view of the file lives (a GGUF embedding keeps one), a second copy of the model."""
        page = mmap.PAGESIZE
        start = -(-info.offset // page) * page
        end = (info.offset + info.nbytes) // page * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._mapped._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    # -- parsing -----------------------------------------------------------------------------

    def _parse(self) -> None:
        buffer = self._header
        if len(buffer) < 24 or buffer[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
        if version not in SUPPORTED_VERSIONS:
            raise ModelLoadError(
                f"GGUF file {self.path} has format version {version}; supported versions: "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        self.version = version
        position = 24
        self.metadata: dict[str, Any] = {}
        self.metadata_spans: dict[str, tuple[int, int]] = {}
        for _ in range(kv_count):
            start = position
            key, position = self._read_string(position)
            (value_type,) = struct.unpack_from("<I", buffer, position)
            self.metadata[key], position = self._read_value(position + 4, value_type, key)
            self.metadata_spans[key] = (start, position)

        entries = []
        for _ in range(tensor_count):
            name, position = self._read_string(position)
            (num_dims,) = struct.unpack_from("<I", buffer, position)
            if num_dims > MAX_TENSOR_DIMS:
                raise ModelLoadError(
                    f"GGUF file {self.path} is corrupt: tensor {name!r} claims {num_dims} "
                    f"dimensions (ggml tensors have at most {MAX_TENSOR_DIMS})"
                )
            dims = struct.unpack_from(f"<{num_dims}Q", buffer, position + 4)
            ggml_type, relative_offset = struct.unpack_from("<IQ", buffer, position + 4 + 8 * num_dims)
            position += 4 + 8 * num_dims + 12
            # ggml lists dimensions fastest-first; torch wants them slowest-first
            entries.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, relative_offset))

        alignment = self._alignment()
        data_start = -(-position // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, relative_offset in entries:
            if name in self.tensors:
                raise ModelLoadError(f"GGUF file {self.path} is corrupt: it lists tensor {name!r} twice")
            nbytes = tensor_nbytes(ggml_type, shape, tensor_name=name, path=self.path)
            offset = data_start + relative_offset
            if offset + nbytes > len(buffer):
                raise ModelLoadError(
                    f"GGUF file {self.path} is truncated: tensor {name!r} needs bytes {offset}..{offset + nbytes} "
                    f"but the file has {len(buffer)} bytes; download or assemble it again"
                )
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)

    def _alignment(self) -> int:
        """``general.alignment``: a power of two (GGUF's rule), 32 when absent."""
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, (int, np.integer))
            or alignment < 1
            or alignment & (alignment - 1)
        ):
            raise ModelLoadError(
                f"GGUF file {self.path} is corrupt: general.alignment must be a power of two, got {alignment!r}"
            )
        return int(alignment)

    def _read_string(self, position: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._header, position)
        start = position + 8
        if start + length > len(self._header):
            raise ValueError(f"a string at byte {position} runs past the end of the file")
        return self._header[start : start + length].decode("utf-8"), start + length

    def _read_value(self, position: int, value_type: int, key: str) -> tuple[Any, int]:
        buffer = self._header
        if value_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[value_type]
            (value,) = struct.unpack_from(fmt, buffer, position)
            return value, position + struct.calcsize(fmt)
        if value_type == _STRING:
            return self._read_string(position)
        if value_type == _ARRAY:
            element_type, count = struct.unpack_from("<IQ", buffer, position)
            position += 12
            if element_type in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[element_type])
                end = position + count * dtype.itemsize
                if end > len(buffer):
                    raise ValueError(f"array {key!r} runs past the end of the file")
                return np.frombuffer(buffer[position:end], dtype=dtype), end
            if element_type == _STRING:
                if key in self._wanted_string_arrays:
                    return self._read_string_array(position, count)
                for _ in range(count):  # variable-length elements: walking is the only way past them
                    (length,) = struct.unpack_from("<Q", buffer, position)
                    position += 8 + length
                return SkippedStringArray(count), position
            raise ValueError(f"metadata {key!r} is an array of unsupported element type {element_type}")
        raise ValueError(f"metadata {key!r} has unknown value type {value_type}")

    def _read_string_array(self, position: int, count: int) -> tuple[list[str], int]:
        raw = self._header
        unpack = struct.Struct("<Q").unpack_from
        values = []
        append = values.append
        size = len(raw)
        for _ in range(count):
            (length,) = unpack(raw, position)
            position += 8
            if position + length > size:
                raise ValueError(f"a string at byte {position - 8} runs past the end of the file")
            append(raw[position : position + length].decode("utf-8"))
            position += length
        return values, position


def find_gguf_file(path: str) -> str | None:
    """``path`` itself if it is a .gguf file, the one .gguf in a directory, else None."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") or _has_gguf_magic(path) else None
    if os.path.isdir(path):
        candidates = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
        if len(candidates) == 1:
            return os.path.join(path, candidates[0])
    return None


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False
