"""This machine's memory read bandwidth, the floor under a weight-bound decode step.

A decode step at c=1 reads every weight byte once, so ``file bytes / bandwidth`` is the least
time a token can take. The read is a streaming reduction over a buffer far larger than the
last-level cache (torch's vectorized ``sum`` over float32, which is memory-bound; its int32 sum
is not), with every thread torch uses, then with one; the best of several passes is reported.

    python benchmarks/memory_bandwidth.py [--gib 2] [--passes 7] [--model-bytes N]

With ``--model-bytes`` (e.g. a GGUF file's size) it also prints the floor per token.
The sum reads one stream a thread; ``read_streams.c`` (beside this file) reads several, which a
kernel can too, and reached 5 % more here (34.0 against 32.4 GB/s on 2 threads, session 28): name
that rate's floor too.
"""

from __future__ import annotations

import argparse
import time

import torch


def read_bandwidth(buffer: torch.Tensor, passes: int) -> float:
    """GB/s (10^9 bytes) of the fastest pass of ``buffer.sum()``."""
    best = float("inf")
    buffer.sum()  # page in
    for _ in range(passes):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * buffer.element_size() / best / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="buffer size")
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--model-bytes", type=int, default=0, help="weight bytes read per token")
    args = parser.parse_args(argv)
    buffer = torch.ones(int(args.gib * 2**30) // 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    results = {threads: read_bandwidth(buffer, args.passes)}
    if threads > 1:
        torch.set_num_threads(1)
        results[1] = read_bandwidth(buffer, args.passes)
        torch.set_num_threads(threads)
    for count, rate in results.items():
        line = f"read bandwidth, {count} thread(s): {rate:.1f} GB/s"
        if args.model_bytes:
            line += f"; floor for {args.model_bytes / 1e9:.2f} GB per token: {args.model_bytes / rate / 1e6:.1f} ms"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
