"""The W8A8 layers of one SmolLM2-135M step at ROWS rows, as a decode step reads them: 30 layers
x (qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576), each with its own random int8
weights, in layer order, after a 64 MiB write that pushes the weights out of the caches. Prints
the best and the median over the rounds, in the thread's CPU time at one thread (what a loaded
machine stretches least) and wall time otherwise.

    python benchmarks/w8a8_step.py ROWS [--threads 1] [--rounds 15]

For an A/B of a kernel change, run the two builds alternately (e.g. each from its own checkout
with its own TOKENLOOM_CACHE_DIR).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenloom.kernels.w8a8_matmul import pack_w8a8, w8a8_linear

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # in x out
NUM_LAYERS = 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    layers = []
    for _ in range(NUM_LAYERS):
        for in_features, out_features in SHAPES:
            codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
            weight = pack_w8a8(codes, torch.rand(out_features) * 0.01)
            if weight is None:
                raise SystemExit("w8a8_linear is not built here")
            layers.append((in_features, weight))
    inputs = {k: torch.randn(args.rows, k, dtype=torch.bfloat16) for k, _ in SHAPES}
    flush = torch.ones(64 << 20, dtype=torch.uint8)
    times = []
    for _ in range(args.rounds):
        flush.add_(1)
        started = clock()
        for in_features, weight in layers:
            w8a8_linear(inputs[in_features], weight)
        times.append(clock() - started)
    print(
        f"{args.rows} rows, {args.threads} threads: a step's W8A8 layers best {min(times) * 1e3:.2f} ms, "
        f"median {statistics.median(times) * 1e3:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
