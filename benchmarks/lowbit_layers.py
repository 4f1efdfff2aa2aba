"""The 2- and 3-bit kernels (csrc/cpu_lowbit.cpp) against the dense path Q2_K and Q3_K layers took
before (dequantized at load into the model dtype, oneDNN-packed), on a 1.7B model's MLP shapes
([2048 -> 8192] gate/up, [8192 -> 2048] down), per batch size, with the 4-bit kernel beside them
for scale. Random codes; median milliseconds per matmul, each layer in several copies (more bytes
than the caches hold) taken in turn, so the weights come from memory as in a real step.

  int3   Q3_K through int3_linear          int2  Q2_K through int2_linear
  int4   Q4_K-like codes through int4_linear
  dense  the dequantized weight in --dtype, oneDNN-packed (what Q3_K/Q2_K layers ran before)

  python benchmarks/lowbit_layers.py 1,8 [--paths int3,int2,int4,dense] [--rounds 15]

TOKENLOOM_CPU_ISA=avx2 (or benchmarks/avx2_host.sh) measures a lower kernel level. The paths are
measured alternately (one pass of each per round): the machine's drift hits them all alike.
"""

import argparse
import time

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int4_matmul import int4_linear, pack_int4
from tokenloom.kernels.lowbit_matmul import dequantize_int3, lowbit_linear, pack_int2, pack_int3
from tokenloom.kernels.onednn_linear import pack_weight, packable, packed_linear

SHAPES = [(8192, 2048), (2048, 8192)]  # (out, in)

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("rows", help="comma-separated batch sizes")
parser.add_argument("--paths", default="int3,int2,int4,dense")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
parser.add_argument("--rounds", type=int, default=15)
parser.add_argument("--copies", type=int, default=4, help="copies of each layer, taken in turn")
options = parser.parse_args()
dtype = getattr(torch, options.dtype)
paths = options.paths.split(",")
torch.manual_seed(0)


def build(path: str, out_features: int, in_features: int):
    superblocks = in_features // 256
    if path in ("int3", "dense"):
        codes = torch.randint(0, 8, (out_features, in_features), dtype=torch.uint8)
        scales = torch.randint(-32, 32, (out_features, in_features // 16)).to(torch.int8)
        d = (torch.rand(out_features, superblocks) * 0.001).half()
        if path == "dense":
            weight = dequantize_int3(codes, scales, d).to(dtype)
            packed = pack_weight(weight) if packable(weight) else weight
            return lambda x: packed_linear(x, packed) if packed.is_mkldnn else torch.nn.functional.linear(x, packed)
        weight3 = pack_int3(codes, scales, d)
        return lambda x: lowbit_linear(x, weight3)
    if path == "int2":
        codes = torch.randint(0, 4, (out_features, in_features), dtype=torch.uint8)
        scales, mins = (torch.randint(0, 16, (out_features, in_features // 16), dtype=torch.uint8) for _ in "ab")
        d, dmin = ((torch.rand(out_features, superblocks) * 0.001).half() for _ in "ab")
        weight2 = pack_int2(codes, scales, mins, d, dmin)
        return lambda x: lowbit_linear(x, weight2)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    group_scales = (torch.rand(out_features, in_features // 32) * 0.02).half().float()
    weight4 = pack_int4(codes, group_scales, 8 * group_scales, torch.bfloat16)
    return lambda x: int4_linear(x, weight4)


print(
    f"kernel level {cpu_native.selected_level().name}, activations {options.dtype}, {torch.get_num_threads()} threads, "
    f"median of {options.rounds} alternating rounds, ms per matmul (noisy: a shared machine)"
)
for out_features, in_features in SHAPES:
    layers = {path: [build(path, out_features, in_features) for _ in range(options.copies)] for path in paths}
    for rows in [int(size) for size in options.rows.split(",")]:
        x = torch.randn(rows, in_features).to(dtype)
        times: dict[str, list[float]] = {path: [] for path in paths}
        for round_index in range(options.rounds + 1):
            for path in paths:
                started = time.perf_counter()
                for matmul in layers[path]:
                    matmul(x)
                if round_index:  # the first round warms up
                    times[path].append((time.perf_counter() - started) / options.copies)
        medians = {path: sorted(values)[len(values) // 2] * 1e3 for path, values in times.items()}
        print(
            f"[{in_features:5d} -> {out_features:5d}] {rows:2d} rows: "
            + "  ".join(f"{path} {ms:6.3f}" for path, ms in medians.items()),
            flush=True,
        )
