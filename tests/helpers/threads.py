"""torch's intra-op thread count set for a block and restored after it: the kernels split their
work by thread, and a test of every split runs the same call on 1, 2 and 3 threads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """``torch.set_num_threads(count)`` inside the block, the previous count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
