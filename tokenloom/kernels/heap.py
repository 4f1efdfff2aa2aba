"""glibc's heap told to keep the memory a step frees, so the next step's large temporaries reuse it.

A prefill step's activations are tens of megabytes each (a 2048-token step of a 1.7B model: 64 MiB
for the gate and up projections' output alone). glibc's ``malloc`` serves every allocation above
its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it when torch frees it, so
each such tensor is faulted in and zeroed by the kernel page by page, in every layer of every step;
and below that threshold it gives a freed top of the heap back to the system (``M_TRIM_THRESHOLD``,
128 KiB at first) for the next step to fault in again. :func:`keep_freed_memory` turns both off
through ``mallopt``: allocations come from the heap, and what a step frees stays mapped for the
next one (measured in ``benchmarks/BENCHMARKS.md``). The process then holds its largest step's
temporaries for good, as a caching allocator would: a few hundred MiB for a 2048-token step of a
1.7B model.

vLLM's CPU backend asks its users for the same effect with ``LD_PRELOAD`` of tcmalloc; this does
it with the C library every Linux process already has. Elsewhere (another C library, another
OS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from functools import cache

logger = logging.getLogger(__name__)

# <malloc.h> (glibc)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# a freed top of the heap larger than this goes back to the system: (almost) never
_TRIM_THRESHOLD_BYTES = 2**31 - 1


@cache
def keep_freed_memory() -> bool:
    """Ask glibc, once per process, to serve large allocations from its heap and keep what is
    freed; returns whether it took both settings (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    taken = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1
    if taken:
        logger.debug("glibc heap: large allocations from the heap, freed memory kept")
    return taken
