"""kernels/page_mapping.py: a lazily zeroed tensor's pages faulted in before its first write,
contents unchanged; a span that is only partly whole pages populates those pages only; the C
heap's freed pages given back."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tokenloom.kernels import page_mapping

needs_populate = pytest.mark.skipif(not page_mapping.available(), reason="no MADV_POPULATE_WRITE here")

PAGE = page_mapping.PAGE_BYTES


def resident_pages(tensor: torch.Tensor) -> int:
    """How many of the whole pages inside ``tensor``'s span are resident (mincore)."""
    return resident_pages_in(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def resident_pages_in(address: int, num_bytes: int) -> int:
    """How many of the whole pages inside ``[address, address + num_bytes)`` are resident."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    start = -(-address // PAGE) * PAGE
    end = (address + num_bytes) // PAGE * PAGE
    pages = (end - start) // PAGE
    vector = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, end - start, vector) == 0
    return sum(byte & 1 for byte in vector.raw)


def lazy_zeros(num_bytes: int) -> torch.Tensor:
    """calloc'd memory, as the CPU platform's KV cache: nothing resident until written (above
    glibc's largest mmap threshold, 32 MiB, a fresh mapping)."""
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8))


@needs_populate
def test_populate_maps_the_whole_pages_and_changes_nothing():
    tensor = lazy_zeros(40 * 2**20 + 100)
    if resident_pages(tensor) > 8:
        pytest.skip("the allocator handed out memory already mapped")
    tensor[5 * 2**20] = 7  # a written byte keeps its value
    span = tensor[1000 : 4 * 2**20 + 5000]
    done = page_mapping.populate(span)
    start = -(-(tensor.data_ptr() + 1000) // PAGE) * PAGE
    end = (tensor.data_ptr() + 4 * 2**20 + 5000) // PAGE * PAGE
    assert done == end - start
    assert resident_pages(span) == done // PAGE
    assert int(tensor[5 * 2**20]) == 7 and int(tensor.sum()) == 7


@needs_populate
def test_only_a_contiguous_cpu_tensor_is_taken():
    with pytest.raises(ValueError, match="contiguous"):
        page_mapping.populate(torch.zeros(4, 4).t())


@pytest.mark.skipif(not hasattr(ctypes.CDLL("libc.so.6"), "malloc_trim"), reason="not glibc")
def test_trim_heap_gives_the_pages_of_freed_heap_chunks_back():
    """Chunks below glibc's mmap threshold, written, then freed under one still held (so free()
    itself cannot shrink the heap): their pages stay resident until trim_heap."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    size = 64 * 1024
    chunks = [libc.malloc(size) for _ in range(256)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, size)
    held = libc.malloc(size)
    for chunk in chunks:
        libc.free(chunk)
    pages = sum(resident_pages_in(chunk + PAGE, size - 2 * PAGE) for chunk in chunks)
    whole = 256 * (size - 2 * PAGE) // PAGE
    assert pages >= 0.9 * whole
    assert page_mapping.trim_heap()
    assert sum(resident_pages_in(chunk + PAGE, size - 2 * PAGE) for chunk in chunks) <= 0.1 * whole
    libc.free(held)
