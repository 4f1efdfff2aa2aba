"""Large CPU tensors backed by transparent huge pages (2 MiB) instead of 4 KiB pages.

A decode step streams every weight byte from memory once. With 4 KiB pages a 1 GB model is
262,144 pages a token, and in a virtual machine each TLB miss walks two page tables; the kernels'
prefetches that miss the TLB wait on those walks. Measured on a 2-vCPU Intel Xeon VM (AVX-512,
AMX) with a 1.7B Q4_K_M file: a decode step's linear layers read 20-22 GB/s on 4 KiB pages and
26-27 GB/s on huge pages.

torch allocates weights with ``posix_memalign`` (4 KiB pages unless the system makes every
mapping huge), and a quantization method's packing writes them, so they are already resident when
loading ends. :func:`collapse` asks Linux (6.1 or later) to copy a tensor's pages into huge pages
in place (``madvise(MADV_COLLAPSE)``, after ``MADV_HUGEPAGE`` so they stay huge), the whole 2
MiB-aligned stretches inside each tensor, once, at load.

The KV cache is read the same way at every decode step (each sequence's keys and values, a layer
at a time), but it is allocated lazily and its pages fault in as blocks are first used:
:func:`advise` marks its mapping ``MADV_HUGEPAGE`` when it is allocated, before any page is
touched, so that those faults (the CPU platform maps blocks ahead of the steps that write them,
``page_mapping.populate``) take 2 MiB pages. Where the kernel or the system's setting
(``/sys/kernel/mm/transparent_hugepage/enabled``: ``never``) refuses, the pages stay as they are:
only the speed differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any

import torch

from tokenloom.kernels.page_mapping import libc_madvise

HUGE_PAGE_BYTES = 2 * 1024 * 1024
# <sys/mman.h> (Linux)
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@cache
def _madvise() -> Any:
    """libc's ``madvise``, or None where there is none to ask (not Linux, THP set to never)."""
    try:
        with open(_THP_SETTING, encoding="ascii") as setting:
            if "[never]" in setting.read():
                return None
    except OSError:
        return None
    return libc_madvise()


def _huge_range(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The 2 MiB-aligned ``(start, length)`` inside ``tensor``'s storage, None if there is none."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_mkldnn:
        return None  # (a oneDNN-packed weight is opaque: its memory is oneDNN's)
    storage = tensor.untyped_storage()
    begin, size = storage.data_ptr(), storage.nbytes()
    start = -(-begin // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (begin + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return (start, end - start) if end > start else None


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Back each tensor's aligned 2 MiB stretches with huge pages, in place (contents unchanged;
    a storage shared by several tensors once). Returns the bytes now on huge pages."""
    madvise = _madvise()
    if madvise is None:
        return 0
    done: set[int] = set()
    collapsed = 0
    for tensor in tensors:
        found = _huge_range(tensor)
        if found is None or found[0] in done:
            continue
        done.add(found[0])
        start, length = found
        if madvise(start, length, _MADV_HUGEPAGE) == 0 and madvise(start, length, _MADV_COLLAPSE) == 0:
            collapsed += length
    return collapsed


def advise(tensor: torch.Tensor) -> int:
    """Ask that the pages of ``tensor``'s aligned 2 MiB stretches be huge when they first fault in
    (``MADV_HUGEPAGE``; pages already there stay as they are). Returns the bytes advised."""
    madvise = _madvise()
    found = _huge_range(tensor)
    if madvise is None or found is None:
        return 0
    start, length = found
    return length if madvise(start, length, _MADV_HUGEPAGE) == 0 else 0


def module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor ``module`` and its submodules hold: parameters, buffers, and the tensors a
    quantization method keeps as attributes (directly, in dataclasses such as a packed weight's,
    or in lists and tuples of those)."""
    for child in module.modules():
        yield from child.parameters(recurse=False)
        yield from child.buffers(recurse=False)
        for value in vars(child).values():
            yield from _tensors_in(value, depth=2)


def _tensors_in(value: Any, depth: int) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth - 1)
    elif depth > 0 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, field.name), depth - 1)
