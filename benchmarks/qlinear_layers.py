"""SmolLM2's 30 layers of projections (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536)
with random 4-bit weights, as one decode or prefill step multiplies them: tokenloom's int4
kernel, and with `dense` the oneDNN-packed bfloat16 matmul, per batch size (median of 7 passes,
weights read from memory as in a real step).

  python benchmarks/qlinear_layers.py 1,8,32,256 [dense]

For an A/B of two versions of the kernel, run it alternately from each checkout
(PYTHONPATH=CHECKOUT), a few times: the machine's speed drifts.
"""
import sys
import time

import torch

from tokenloom.kernels.int4_matmul import dequantize_int4, int4_linear, pack_int4
from tokenloom.kernels.onednn_linear import pack_weight, packed_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
dense = "dense" in sys.argv[2:]
torch.manual_seed(0)
layers = []
for _ in range(30):
    for out_features, in_features in SHAPES:
        groups = in_features // 32
        codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
        scales = (torch.rand(out_features, groups) * 0.02).half().float()
        zeros = (torch.randn(out_features, groups) * 0.05).half().float() + 8 * scales
        packed = pack_int4(codes, scales, zeros, torch.bfloat16)
        weight = pack_weight(dequantize_int4(codes, scales, zeros).to(torch.bfloat16)) if dense else None
        layers.append((in_features, packed, weight))


def median_ms(rows: int, use_dense: bool) -> float:
    inputs = {features: torch.randn(rows, features).to(torch.bfloat16) for features in (576, 1536)}

    def one_pass():
        for features, packed, weight in layers:
            packed_linear(inputs[features], weight) if use_dense else int4_linear(inputs[features], packed)

    for _ in range(2):
        one_pass()
    times = []
    for _ in range(7):
        started = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - started)
    return sorted(times)[3] * 1e3


for rows in [int(size) for size in sys.argv[1].split(",")]:
    line = f"{rows:5d} rows: int4 {median_ms(rows, False):8.2f} ms"
    if dense:
        line += f"   bfloat16 {median_ms(rows, True):8.2f} ms"
    print(line, flush=True)
