"""GEMM rate of this machine: linear(x[M,576], w[3072,576]) in float32 and bfloat16, 2 threads.
python benchmarks/gemm_roofline.py"""

import time

import torch

torch.set_num_threads(2)
for M in (1, 8, 32, 256):
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(M, 576, dtype=dt)
        w = torch.randn(3072, 576, dtype=dt)
        for _ in range(5):
            torch.nn.functional.linear(x, w)
        n = 200
        t = time.perf_counter()
        for _ in range(n):
            torch.nn.functional.linear(x, w)
        el = (time.perf_counter() - t) / n
        print(f"M={M} {dt}: {el * 1e3:.3f} ms  {2 * M * 576 * 3072 / el / 1e9:.1f} GFLOP/s")
