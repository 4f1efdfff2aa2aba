"""W8A8 int8 layers (int8 weights, one scale per output channel; activations quantized to int8
by the kernel) per batch size, on SmolLM2-135M's shapes and one large layer: median microseconds
per layer call of the rounds, each shape's weights copied enough times that a pass reads them from
memory, not from cache. The paths:

  grouped   the Q8_0 kernel (int8_linear: activations per group of 32, one float scale per
            group; what compressed-tensors W8A8 layers took before w8a8_linear), then cast to x's dtype
  channel   w8a8_linear without AMX (the AVX-512 CPUs without AMX, AMD EPYC's)
  amx       w8a8_linear with AMX-INT8 for every row count (where the CPU has it)

  python benchmarks/w8a8_layers.py 1,8,32,256 [--paths grouped,channel,amx] [--rounds 7] [--threads 1]
                                  [--shapes 576x576,2048x8192]

Shapes are in_features x out_features. The paths are measured alternately (one pass of each per
round), so a drift of the shared machine's speed hits them all alike.
"""

import argparse
import statistics
import time

import torch

from tokenloom.kernels import cpu_native
from tokenloom.kernels.int8_matmul import GROUP_SIZE, int8_linear, pack_int8
from tokenloom.kernels.w8a8_matmul import amx_available, pack_w8a8, w8a8_linear

SHAPES = [(576, 576), (576, 1536), (1536, 576), (2048, 8192)]
WEIGHT_BYTES = 64 << 20  # per shape: copies enough for this many bytes of weights (past the caches)

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("rows", help="comma-separated batch sizes")
parser.add_argument("--paths", default="grouped,channel,amx")
parser.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES))
parser.add_argument("--rounds", type=int, default=7)
parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own count)")
options = parser.parse_args()
if options.threads:
    torch.set_num_threads(options.threads)
paths = options.paths.split(",")
if "amx" in paths and not amx_available():
    print("no AMX-INT8 here: the amx path is left out")
    paths.remove("amx")
shapes = [tuple(int(side) for side in shape.split("x")) for shape in options.shapes.split(",")]
torch.manual_seed(0)
print(f"kernel level {cpu_native.selected_level().name}, {torch.get_num_threads()} threads, bfloat16 rows")


def calls(path, in_features, out_features, copies):
    layers = []
    for _ in range(copies):
        codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
        scales = torch.rand(out_features) * 0.01
        if path == "grouped":
            weight = pack_int8(codes, scales.unsqueeze(1).expand(-1, in_features // GROUP_SIZE))
            layers.append(lambda x, weight=weight: int8_linear(x, weight).to(x.dtype))
        else:
            weight = pack_w8a8(codes, scales)
            amx_rows = 1 if path == "amx" else 0
            layers.append(lambda x, weight=weight, amx_rows=amx_rows: w8a8_linear(x, weight, amx_rows=amx_rows))
    return layers


for in_features, out_features in shapes:
    copies = max(1, min(60, WEIGHT_BYTES // (in_features * out_features)))
    layers = {path: calls(path, in_features, out_features, copies) for path in paths}
    for rows in [int(row) for row in options.rows.split(",")]:
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        times = {path: [] for path in paths}
        for _ in range(options.rounds):
            for path in paths:
                for layer in layers[path][:2]:  # warm the code path
                    layer(x)
                started = time.perf_counter()
                for layer in layers[path]:
                    layer(x)
                times[path].append((time.perf_counter() - started) / len(layers[path]) * 1e6)
        medians = {path: statistics.median(values) for path, values in times.items()}
        base = medians.get("grouped")
        cells = "  ".join(
            f"{path} {medians[path]:8.1f} us"
            + (f" ({base / medians[path]:4.2f}x)" if base and path != "grouped" else "")
            for path in paths
        )
        print(f"{in_features:5d}x{out_features:<5d} rows {rows:4d}: {cells}", flush=True)
