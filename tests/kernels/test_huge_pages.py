"""kernels/huge_pages.py: a model's large tensors found wherever a layer keeps them, and moved
onto huge pages in place with their contents unchanged."""

from __future__ import annotations

import dataclasses
import mmap
from unittest import mock

import pytest
import torch

from tokenloom.kernels import huge_pages


@dataclasses.dataclass
class Packed:
    packed: torch.Tensor
    out_features: int


def anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(part, 16) for part in fields[0].split("-"))
                inside = low < end and high > start
            elif inside and fields[0] == "AnonHugePages:":
                total += int(fields[1])
    return total


def test_module_tensors_reach_parameters_buffers_and_packed_weights():
    layer = torch.nn.Linear(4, 4)
    layer.register_buffer("table", torch.zeros(3))
    packed = Packed(torch.ones(8, dtype=torch.uint8), 16)
    segment = Packed(torch.full((2,), 7, dtype=torch.uint8), 16)
    layer.int4_weight = packed
    layer.native_segments = [segment, None]
    model = torch.nn.Sequential(layer)
    found = {id(tensor) for tensor in huge_pages.module_tensors(model)}
    expected = {layer.weight, layer.bias, layer.table, packed.packed, segment.packed}
    assert {id(tensor) for tensor in expected} <= found


@pytest.mark.skipif(huge_pages._madvise() is None, reason="no transparent huge pages here")
def test_collapse_moves_a_tensor_onto_huge_pages_unchanged():
    tensor = torch.randint(0, 255, (12 * 2**20,), dtype=torch.uint8)  # 12 MiB, written: 4 KiB pages
    expected = tensor.clone()
    start = tensor.data_ptr()
    end = start + tensor.numel()
    collapsed = huge_pages.collapse([tensor, tensor[: 2**20]])  # a view of the same storage: once
    if collapsed == 0:
        pytest.skip("this kernel refused MADV_COLLAPSE (older than 6.1, or no memory to compact)")
    assert collapsed % huge_pages.HUGE_PAGE_BYTES == 0 and 8 * 2**20 <= collapsed <= 12 * 2**20
    # (the mappings it overlaps, which may hold more: the allocator can hand out a stretch that
    # an earlier test's weights had already moved onto huge pages, so no "before" to subtract)
    assert anon_huge_kib(start, end) >= collapsed // 1024
    assert torch.equal(tensor, expected)
    # too small for an aligned 2 MiB stretch: nothing to do
    assert huge_pages.collapse([torch.zeros(1000)]) == 0


def test_opaque_tensors_are_left_alone():
    dense = torch.randn(2048, 1024)
    assert huge_pages.collapse([dense.to_mkldnn()]) == 0


def vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(part, 16) for part in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "VmFlags:":
                return set(fields[1:])
    return set()


@pytest.mark.skipif(huge_pages._madvise() is None, reason="no transparent huge pages here")
def test_advise_marks_a_fresh_mapping_for_huge_pages():
    """advise sets MADV_HUGEPAGE ("hg") on the tensor's aligned 2 MiB stretches, before any page
    is touched; a mapping of our own, so no allocator's earlier advice is in the way."""
    area = mmap.mmap(-1, 8 * 2**20)
    tensor = torch.frombuffer(area, dtype=torch.uint8)
    middle = tensor.data_ptr() + 4 * 2**20
    assert "hg" not in vm_flags(middle)
    assert huge_pages.advise(tensor) >= 6 * 2**20
    assert "hg" in vm_flags(middle)
    assert huge_pages.advise(torch.zeros(1000)) == 0  # no aligned 2 MiB stretch inside
    del tensor
    area.close()


def test_the_cpu_platforms_kv_cache_is_advised_when_allocated():
    from tokenloom.builtin_plugins.platforms.cpu import CpuPlatform

    with mock.patch.object(huge_pages, "advise") as advise:
        cache = CpuPlatform().zeros((2, 8, 16, 4, 64), torch.bfloat16)
    assert advise.call_count == 1 and advise.call_args.args[0] is cache
    assert not cache.any()
