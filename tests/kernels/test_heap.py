"""kernels/heap.py: after keep_freed_memory(), a large tensor comes from glibc's heap instead of a
fresh mmap, and the memory a freed one held is still mapped (resident) when the next one reuses
it. Run in a fresh interpreter: the setting is process-wide and the test process's own heap
history would decide where its allocations land."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)

PROBE = r"""
import ctypes
import torch
from tokenloom.kernels import heap

PAGE = 4096
libc = ctypes.CDLL("libc.so.6")
libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def in_heap(tensor):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            begin, end = (int(part, 16) for part in line.split()[0].split("-"))
            return begin <= tensor.data_ptr() < end
    return False


def resident_fraction(tensor):
    start = -(-tensor.data_ptr() // PAGE) * PAGE
    end = (tensor.data_ptr() + tensor.numel()) // PAGE * PAGE
    vector = ctypes.create_string_buffer((end - start) // PAGE)
    assert libc.mincore(start, end - start, vector) == 0
    return sum(byte & 1 for byte in vector.raw) / len(vector.raw)


size = 64 * 2**20
before = torch.empty(size, dtype=torch.uint8)
print("before", in_heap(before))
del before
print("taken", heap.keep_freed_memory(), heap.keep_freed_memory())
first = torch.empty(size, dtype=torch.uint8)
first.fill_(1)
address = first.data_ptr()
print("after", in_heap(first))
del first
second = torch.empty(size, dtype=torch.uint8)
print("reused", second.data_ptr() == address, resident_fraction(second) > 0.99)
"""


def test_large_tensors_come_from_the_heap_and_stay_mapped_after_free():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:4] == ["before False", "taken True True", "after True", "reused True True"]
