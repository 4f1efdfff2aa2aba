"""The memory-mapped GGUF reader against gguf-py's GGUFReader, and its errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize
from helpers.gguf_files import byte_level_vocab, finish, write_metadata_only_gguf

from tokenloom.builtin_plugins.loaders.gguf_reader import GGUFFile, SkippedStringArray, find_gguf_file
from tokenloom.errors import ModelLoadError


@pytest.fixture
def sample_gguf(tmp_path):
    path = str(tmp_path / "sample.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_string("general.name", "ünïcode name ✓")
    writer.add_array("llama.some_ints", [1, -2, 3])
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "<|x|>", ""])
    writer.add_uint64("general.big", 2**40)
    writer.add_tensor("dense.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("half.weight", np.ones((2, 8), dtype=np.float16))
    writer.add_tensor(
        "quant.weight",
        quantize(np.ones((2, 64), np.float32), GGMLQuantizationType.Q8_0),
        raw_dtype=GGMLQuantizationType.Q8_0,
    )
    finish(writer)
    return path


def test_metadata_and_tensor_table_match_gguf_py(sample_gguf):
    ours = GGUFFile(sample_gguf, string_arrays=("tokenizer.ggml.tokens",))
    reference = GGUFReader(sample_gguf)
    assert ours.architecture == "llama" and ours.version == 3
    assert ours.arch_get("block_count") == 3
    assert ours.get("llama.rope.freq_base") == pytest.approx(500000.0)
    assert ours.get("tokenizer.ggml.add_bos_token") is True
    assert ours.get("general.name") == "ünïcode name ✓"
    assert ours.get("general.big") == 2**40
    assert ours.get("llama.some_ints").tolist() == [1, -2, 3]
    assert ours.get("tokenizer.ggml.tokens") == ["a", "bé", "<|x|>", ""]
    assert set(ours.tensors) == {t.name for t in reference.tensors}
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.ggml_type == int(tensor.tensor_type)
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert info.offset == tensor.data_offset and info.nbytes == tensor.n_bytes
        np.testing.assert_array_equal(ours.tensor_data(info), np.asarray(tensor.data).reshape(-1).view(np.uint8))


def test_string_arrays_are_skipped_unless_asked_for(sample_gguf):
    skipped = GGUFFile(sample_gguf).get("tokenizer.ggml.tokens")
    assert skipped == SkippedStringArray(count=4)


def test_a_big_vocabulary_opens_in_well_under_a_second(tmp_path):
    vocab = byte_level_vocab()
    vocab["tokens"] = [f"token{i}" for i in range(200_000)]
    vocab["token_type"] = [1] * 200_000
    vocab.pop("merges")
    path = write_metadata_only_gguf(str(tmp_path / "big.gguf"), "llama", tokenizer=vocab)
    import time

    started = time.perf_counter()
    header_only = GGUFFile(path)
    with_tokens = GGUFFile(path, string_arrays=("tokenizer.ggml.tokens",))
    # gguf-py's reader takes seconds on a vocabulary this size; generous bound for a busy CI machine
    assert time.perf_counter() - started < 3.0
    assert header_only.get("tokenizer.ggml.tokens").count == 200_000
    assert with_tokens.get("tokenizer.ggml.tokens")[-1] == "token199999"


def test_truncated_file_is_a_model_load_error_naming_the_file(sample_gguf, tmp_path):
    data = open(sample_gguf, "rb").read()
    for cut in (len(data) - 50, 100, 30):  # the last 24 bytes are alignment padding
        truncated = str(tmp_path / f"cut{cut}.gguf")
        with open(truncated, "wb") as handle:
            handle.write(data[:cut])
        with pytest.raises(ModelLoadError) as error:
            GGUFFile(truncated)
        assert truncated in str(error.value) and ("truncated" in str(error.value))


def test_not_a_gguf_and_missing_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(str(bogus))
    with pytest.raises(ModelLoadError, match="does not exist"):
        GGUFFile(str(tmp_path / "absent.gguf"))


def test_unsupported_version(sample_gguf, tmp_path):
    data = bytearray(open(sample_gguf, "rb").read())
    data[4:8] = (7).to_bytes(4, "little")
    path = tmp_path / "v7.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="version 7"):
        GGUFFile(str(path))


def test_find_gguf_file(sample_gguf, tmp_path):
    assert find_gguf_file(sample_gguf) == sample_gguf
    assert find_gguf_file(str(tmp_path)) == sample_gguf
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    assert find_gguf_file(str(tmp_path)) is None  # two candidates: ambiguous
    assert find_gguf_file(str(tmp_path / "nothing")) is None
    renamed = tmp_path / "model.bin"
    os.link(sample_gguf, renamed)
    assert find_gguf_file(str(renamed)) == str(renamed)  # recognised by its magic bytes


def mapped_rss_kib(path: str) -> int:
    """This process's resident KiB of its mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == os.path.realpath(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps to read resident pages from")
def test_released_tensor_pages_leave_resident_memory_and_read_back_unchanged(smollm2_gguf):
    gguf = GGUFFile(smollm2_gguf)
    info = max(gguf.tensors.values(), key=lambda tensor: tensor.nbytes)
    checksum = int(gguf.tensor_data(info).sum(dtype=np.uint64))  # every page of the tensor read in
    before = mapped_rss_kib(smollm2_gguf)
    gguf.release_pages(info)
    assert before - mapped_rss_kib(smollm2_gguf) >= info.nbytes // 1024 - 8  # all but the two partial pages
    assert int(gguf.tensor_data(info).sum(dtype=np.uint64)) == checksum
