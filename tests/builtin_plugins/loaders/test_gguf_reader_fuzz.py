"""The GGUF reader on untrusted bytes: truncated files, flipped bytes and extreme values in
every length, count and offset field (hypothesis), and the hand-made cases that used to raise
something other than ModelLoadError (alignment 0, too many dimensions, a tensor listed twice).
Every malformed file gets a ModelLoadError that names it; a file that still parses describes
tensors that lie inside it."""

from __future__ import annotations

import os
import struct
import tempfile

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from helpers.gguf_files import finish
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile
from tokenloom.errors import ModelLoadError

# values that break naive readers: zero, one, sign bits, the largest 32- and 64-bit values
EXTREME_VALUES = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


def write_sample(path: str, alignment: int | None = None, extra: dict | None = None) -> None:
    writer = GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_uint32("general.alignment", alignment)
    writer.add_uint32("llama.block_count", 2)
    writer.add_string("general.name", "fuzz ✓")
    writer.add_array("llama.some_ints", [1, -2, 3])
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "<|x|>"])
    writer.add_tensor("dense.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.add_tensor(
        "quant.weight",
        quantize(np.ones((1, 32), np.float32), GGMLQuantizationType.Q8_0),
        raw_dtype=GGMLQuantizationType.Q8_0,
    )
    finish(writer)


@pytest.fixture(scope="module")
def sample_bytes(tmp_path_factory) -> bytes:
    path = str(tmp_path_factory.mktemp("gguf") / "sample.gguf")
    write_sample(path)
    with open(path, "rb") as handle:
        return handle.read()


def open_bytes(data: bytes, directory: str) -> None:
    """Open ``data`` as a GGUF file: it parses, or it fails with a ModelLoadError naming it."""
    with tempfile.NamedTemporaryFile(dir=directory, suffix=".gguf", delete=False) as handle:
        handle.write(data)
        path = handle.name
    try:
        try:
            gguf = GGUFFile(path, string_arrays=("tokenizer.ggml.tokens",))
        except ModelLoadError as error:
            assert path in str(error)
            return
        size = os.path.getsize(path)
        for info in gguf.tensors.values():
            assert 0 <= info.offset and info.offset + info.nbytes <= size
            assert gguf.tensor_data(info).size == info.nbytes
    finally:
        os.unlink(path)


FUZZ_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ_SETTINGS
@given(cut=st.integers(min_value=0, max_value=4096))
def test_every_truncation(sample_bytes, tmp_path, cut):
    open_bytes(sample_bytes[:cut], str(tmp_path))


@FUZZ_SETTINGS
@given(
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)), min_size=1, max_size=8)
)
def test_flipped_bytes(sample_bytes, tmp_path, flips):
    data = bytearray(sample_bytes)
    for position, mask in flips:
        data[position % len(data)] ^= mask
    open_bytes(bytes(data), str(tmp_path))


@FUZZ_SETTINGS
@given(position=st.integers(min_value=4), value=st.sampled_from(EXTREME_VALUES), width=st.sampled_from([4, 8]))
@example(position=16, value=2**64 - 1, width=8)  # kv_count
@example(position=8, value=2**63, width=8)  # tensor_count
def test_extreme_values_in_any_field(sample_bytes, tmp_path, position, value, width):
    data = bytearray(sample_bytes)
    position %= len(data) - width
    data[position : position + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    open_bytes(bytes(data), str(tmp_path))


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_an_alignment_that_is_not_a_power_of_two(tmp_path, alignment):
    path = str(tmp_path / "aligned.gguf")
    write_sample(path, alignment=8)
    data = bytearray(open(path, "rb").read())
    key = b"general.alignment"
    value_at = data.index(key) + len(key) + 4  # after the key and its value type
    data[value_at : value_at + 4] = struct.pack("<I", alignment)
    with open(path, "wb") as handle:
        handle.write(data)
    with pytest.raises(ModelLoadError, match="general.alignment must be a power of two") as error:
        GGUFFile(path)
    assert path in str(error.value)


def test_too_many_dimensions_and_a_tensor_listed_twice(sample_bytes, tmp_path):
    dims_at = sample_bytes.index(b"dense.weight") + len(b"dense.weight")
    data = bytearray(sample_bytes)
    data[dims_at : dims_at + 4] = struct.pack("<I", 2**32 - 1)
    path = tmp_path / "dims.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="4294967295 dimensions"):
        GGUFFile(str(path))
    twice = bytearray(sample_bytes)
    second_name_at = sample_bytes.index(b"quant.weight")
    twice[second_name_at : second_name_at + len(b"quant.weight")] = b"dense.weight"
    path = tmp_path / "twice.gguf"
    path.write_bytes(bytes(twice))
    with pytest.raises(ModelLoadError, match="lists tensor 'dense.weight' twice"):
        GGUFFile(str(path))


def test_an_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError) as error:
        GGUFFile(str(path))
    assert str(path) in str(error.value)
